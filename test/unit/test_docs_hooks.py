"""docs/hooks.md holds the current output of ``sglang-memx hooks``."""

from pathlib import Path

from sglang_memx.hooks import hook_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def test_the_hook_table_in_the_docs_is_generated_from_the_code():
    text = DOC.read_text()
    start = text.index("<!-- generated: sglang-memx hooks -->\n") + len("<!-- generated: sglang-memx hooks -->\n")
    end = text.index("\n<!-- end generated -->")
    assert text[start:end] == hook_table(), "regenerate the table: sglang-memx hooks"
