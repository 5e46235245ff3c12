"""``sglang_memx.plugin.load`` registers no hook in upstream's detokenizer process (told by its
title, ``upstream.process``) and every hook elsewhere."""

from __future__ import annotations

import sys
import types

import pytest

from sglang_memx import plugin
from sglang_memx.upstream import process


@pytest.fixture
def fresh_plugin(monkeypatch):
    registered = []
    monkeypatch.setattr(plugin, "_loaded", False)
    import sglang_memx.hooks as hooks

    monkeypatch.setattr(hooks, "register_all", lambda specs: registered.extend(specs) or len(specs))
    return registered


def _titled(monkeypatch, title: str | None):
    if title is None:
        monkeypatch.setitem(sys.modules, "setproctitle", None)  # not installed: import fails
    else:
        monkeypatch.setitem(sys.modules, "setproctitle", types.SimpleNamespace(getproctitle=lambda: title))


def test_the_detokenizer_gets_no_hook(monkeypatch, fresh_plugin):
    _titled(monkeypatch, process.DETOKENIZER_TITLE)
    assert process.is_detokenizer()
    plugin.load()
    assert fresh_plugin == [] and plugin._loaded


@pytest.mark.parametrize("title", ["sglang::scheduler", "python -m sglang.launch_server", None])
def test_every_other_process_gets_every_hook(monkeypatch, fresh_plugin, title):
    _titled(monkeypatch, title)
    assert not process.is_detokenizer()
    plugin.load()
    from sglang_memx.hooks import all_hook_specs

    assert [s.target for s in fresh_plugin] == [s.target for s in all_hook_specs()]
