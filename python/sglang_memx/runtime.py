"""Where a process finds its MemxConfig, and the startup log line.

The config travels on the ServerArgs record (attribute ``_memx_config``, a
plain dict, pickled by upstream into its subprocesses). A record built without
the CLI (``sgl.Engine(...)``) has none and gets the defaults.
"""

from __future__ import annotations

import logging

from sglang_memx import __version__
from sglang_memx.config import MemxConfig

logger = logging.getLogger("sglang_memx")

CONFIG_ATTR = "_memx_config"


def attach_config(server_args, config: MemxConfig) -> None:
    setattr(server_args, CONFIG_ATTR, config.to_dict())


def config_of(server_args) -> MemxConfig:
    data = getattr(server_args, CONFIG_ATTR, None) if server_args is not None else None
    return MemxConfig() if data is None else MemxConfig.from_dict(dict(data))


def upstream_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # pragma: no cover - sglang is a hard dependency
        return "unknown"


def startup_line(config: MemxConfig) -> str:
    on = [name for name, enabled in config.features.items() if enabled]
    state = "disabled (--memx-disable)" if config.disabled else "active"
    return f"sglang-memx {__version__} {state} on sglang {upstream_version()}; features on: {', '.join(on) or 'none'}"


def log_startup_line(config: MemxConfig) -> None:
    logger.info(startup_line(config))
