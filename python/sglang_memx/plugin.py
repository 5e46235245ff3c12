"""Entry point of the ``sglang.srt.plugins`` group (name: ``memx``).

Upstream calls ``load()`` in every process it starts, before it parses
arguments (launcher) or builds the scheduler; we only register hooks here.
Upstream's HookRegistry applies them right after all plugins have loaded.
Filter the plugin out with ``SGLANG_PLUGINS=<other plugins>``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_memx")

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    from sglang_memx.hooks import register_all

    count = register_all()
    _loaded = True
    logger.debug("sglang-memx registered %d hooks", count)
