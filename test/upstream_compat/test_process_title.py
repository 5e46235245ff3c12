"""The detokenizer's title tells memx's plugin where it is loaded (``sglang_memx.upstream.process``):
upstream must set it before it loads plugins, and no memx hook may target the detokenizer's module."""

from __future__ import annotations

import ast
import inspect
import textwrap

from sglang_memx.hooks import all_hook_specs
from sglang_memx.upstream import manifest, process


def _calls_in_order(fn) -> list[str]:
    """The dotted names of the calls in ``fn``'s body statements, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = []
    for stmt in tree.body[0].body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                calls.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [text for *_, text in sorted(calls)]


def test_upstream_titles_its_detokenizer_before_it_loads_plugins():
    entry = manifest.resolve(process.DETOKENIZER_ENTRY)
    calls = _calls_in_order(entry)
    title = f"setproctitle.setproctitle({process.DETOKENIZER_TITLE!r})"
    assert title in calls and "load_plugins()" in calls, calls[:6]
    assert calls.index(title) < calls.index("load_plugins()"), calls[:6]


def test_no_hook_targets_the_detokenizers_module():
    module = process.DETOKENIZER_ENTRY.rsplit(".", 1)[0]
    assert not [s.target for s in all_hook_specs() if s.target.startswith(module + ".")]
