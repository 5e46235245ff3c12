"""Entry point of the ``sglang.srt.plugins`` group (name: ``memx``).

Upstream calls ``load()`` in every process it starts, before it parses arguments
(launcher) or builds the scheduler; we only register hooks here. Upstream's
HookRegistry applies them right after all plugins have loaded.

On an SGLang outside ``upstream.version.SUPPORTED_SGLANG`` only the flag hooks are
registered: a ``--memx-*`` feature then stops the launch with an error naming both
versions (``hooks.server_args``), and without one memx stays out of the way.
Filter the plugin out with ``SGLANG_PLUGINS=<other plugins>``. In upstream's detokenizer
process nothing is registered (``upstream.process``: it runs no hooked code).
"""

from __future__ import annotations

import logging

from sglang_memx.upstream import process, version

logger = logging.getLogger("sglang_memx")

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    if process.is_detokenizer():  # it runs no hooked code (upstream.process)
        _loaded = True
        logger.debug("sglang-memx: no hooks in the detokenizer process")
        return
    from sglang_memx.hooks import all_hook_specs, register_all

    specs = all_hook_specs()
    if not version.is_supported(version.installed_sglang()):
        specs = [s for s in specs if s.feature == "flags"]
        logger.warning(
            "sglang-memx: sglang %s is outside the supported range %s; memx registers its flags only",
            version.installed_sglang(),
            version.SUPPORTED_SGLANG,
        )
    count = register_all(specs)
    _loaded = True
    logger.debug("sglang-memx registered %d hooks", count)
