"""Upstream's server arguments (``sglang.srt.server_args.ServerArgs``) as memx reads them,
and the MemxConfig that rides on them into every SGLang process.

The config travels on the ServerArgs record (attribute ``_memx_config``, a plain dict,
pickled by upstream into its subprocesses). A record built without the CLI
(``sgl.Engine(...)``) has none and gets the defaults.
"""

from __future__ import annotations

from sglang_memx.config import MemxConfig

CONFIG_ATTR = "_memx_config"
DEFAULT_MAX_PREFILL_TOKENS = 16384  # upstream's documented default of --max-prefill-tokens


def attach_config(server_args, config: MemxConfig) -> None:
    setattr(server_args, CONFIG_ATTR, config.to_dict())


def config_of(server_args) -> MemxConfig:
    data = vars(server_args).get(CONFIG_ATTR) if server_args is not None else None
    return MemxConfig() if data is None else MemxConfig.from_dict(dict(data))


def radix_cache_disabled(args) -> bool:
    """``--disable-radix-cache`` of a parsed namespace or a ServerArgs record."""
    return bool(args.disable_radix_cache)


def server_url(server_args) -> str:
    return f"http://{server_args.host}:{server_args.port}"


def max_prefill_batch_tokens(server_args) -> int:
    """The most tokens one prefill batch can hold: the chunked-prefill size, else max_prefill_tokens."""
    chunk = server_args.chunked_prefill_size
    if chunk is not None and chunk > 0:
        return int(chunk)
    return int(server_args.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS)
