"""``benchmark.doc_blocks``: the renderers' one way to replace and check a generated block."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.doc_blocks import replace_block, write_or_check  # noqa: E402

B, E = "<!-- b -->", "<!-- e -->"


def test_only_the_block_between_the_markers_changes():
    text = f"head\n{B}\nold\n{E}\ntail\n"
    assert replace_block(text, B, E, f"{B}\nnew\n{E}") == f"head\n{B}\nnew\n{E}\ntail\n"
    assert replace_block("no markers", B, E, "x") is None
    assert replace_block(f"only {B}", B, E, "x") is None


def test_check_writes_nothing_and_fails_on_a_difference(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(f"a\n{B}\nold\n{E}\n")
    new = f"{B}\nnew\n{E}"
    assert write_or_check(doc, [(B, E, new)], True, "cmd") == 1
    assert "old" in doc.read_text()
    assert write_or_check(doc, [(B, E, new)], False, "cmd") == 0
    assert doc.read_text() == f"a\n{new}\n"
    assert write_or_check(doc, [(B, E, new)], True, "cmd") == 0


def test_a_missing_block_is_an_error_and_nothing_is_written(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(f"a\n{B}\nold\n{E}\n")
    assert write_or_check(doc, [(B, E, f"{B}x{E}"), ("<!-- other -->", E, "y")], False, "cmd") == 1
    assert doc.read_text() == f"a\n{B}\nold\n{E}\n"
