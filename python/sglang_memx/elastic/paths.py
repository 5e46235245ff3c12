"""Where a shared pool's files live: ``<pool dir>/<pool>.sock`` (the arbiter), ``.lock``,
``.pid``, ``.log``, ``.server.<pid>.json`` and the peer tier's sockets.

Invariant: every part of memx (shared pool, peer tier, CLI) finds a pool's directory here,
so they agree on it for a given ``--memx-pool-dir``.
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_memx.config import MemxConfig


def pool_dir(config: MemxConfig) -> Path:
    if config.pool_dir:
        return Path(config.pool_dir)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "sglang-memx" if runtime else Path(f"/tmp/sglang-memx-{os.getuid()}")


def pool_socket(config: MemxConfig, name: str | None = None) -> Path:
    return pool_dir(config) / f"{name or config.pool}.sock"
