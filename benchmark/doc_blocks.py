"""Generated blocks in the docs: the one way the table renderers (``bench_serving_table``,
``families_table``, ``reliability_table``, ``sim_table``, ``peer_kv_tables``, ``map_calls_table``,
``colocated_table``, ...) put what they render between a doc's markers and check it.

Invariant: only the text between a block's begin and end markers (included) changes; a doc without
them is an error, never silently left as it was."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def block_markers(command: str, kind: str, name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name`` that ``command`` renders:
    ``<!-- generated: COMMAND (NAME) -->`` ... ``<!-- end generated: KIND NAME -->``."""
    return f"<!-- generated: {command} ({name}) -->", f"<!-- end generated: {kind} {name} -->"


def replace_block(text: str, begin: str, end: str, block: str) -> str | None:
    """``text`` with its block from ``begin`` to ``end`` replaced by ``block`` (which carries both
    markers); None when either marker is missing."""
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    return head + block + rest.split(end, 1)[1]


def check_args(argv: list[str] | None, description: str) -> bool:
    """The renderers' command line: ``--check`` or nothing."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the doc differs from the JSON")
    return ap.parse_args(argv).check


def write_or_check(doc: Path, blocks: list[tuple[str, str, str]], check: bool, command: str) -> int:
    """Put each ``(begin, end, block)`` into ``doc``; with ``check``, write nothing and exit 1 when the
    doc differs from what the JSON renders. Exit 1 also when a block's markers are missing."""
    text = doc.read_text()
    new: str | None = text
    for begin, end, block in blocks:
        new = replace_block(new, begin, end, block)
        if new is None:
            print(f"{doc}: no generated block ({begin} ... {end})", file=sys.stderr)
            return 1
    if check:
        if new != text:
            print(f"{doc} differs from its JSON: run {command}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(new)
    return 0
