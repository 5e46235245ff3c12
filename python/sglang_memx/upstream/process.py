"""Which upstream process loads the plugin, where memx needs to know it at load time.

Upstream calls every plugin's ``load()`` in each process it starts. Its detokenizer process
(``managers.detokenizer_manager.run_detokenizer_process``) sets its title to
``DETOKENIZER_TITLE`` right before it loads plugins, and runs none of the code memx hooks (every
hook target is in the launcher's argument parsing, its HTTP server or the scheduler's process).
So memx registers no hook there: upstream would import each target's module (the scheduler's and
the HTTP server's included) and walk every loaded module once per target to apply them, about
2 CPU-seconds of the detokenizer's start on the 2-core box, for nothing.

``test/upstream_compat/test_process_title.py`` checks that upstream still sets that title before
it loads plugins, and that no hook targets the detokenizer's own module.
"""

from __future__ import annotations

DETOKENIZER_TITLE = "sglang::detokenizer"
DETOKENIZER_ENTRY = "sglang.srt.managers.detokenizer_manager.run_detokenizer_process"

__all__ = ["DETOKENIZER_ENTRY", "DETOKENIZER_TITLE", "is_detokenizer"]


def is_detokenizer() -> bool:
    """Whether this process is upstream's detokenizer (its title, set before plugins load)."""
    try:
        import setproctitle
    except ImportError:  # upstream sets no title without it: not known, so every hook is registered
        return False
    return setproctitle.getproctitle() == DETOKENIZER_TITLE
