"""docs/gpu.md's claims about upstream's VMM code that the code can contradict.

* the private hook targets it lists (and counts) are exactly the manifest's;
* every upstream name it says was adopted is declared in the manifest.
"""

from __future__ import annotations

import re
from pathlib import Path

from sglang_memx.upstream import manifest

DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
SECTION = "## Upstream's VMM code: what we use and why"


def _section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def _private_targets() -> set[str]:
    """``Class.method`` of every private hook target in the manifest."""
    return {".".join(t.split(".")[-2:]) for t in manifest.TARGETS if manifest.is_private(t)}


def test_the_private_hook_targets_the_doc_lists_are_the_manifests():
    match = re.search(r"\*\*Private hook targets: (\d+)\*\* \(([^)]*)\)", _section())
    assert match, "docs/gpu.md: the line '**Private hook targets: N** (`A.b`, ...)' is missing"
    listed = set(re.findall(r"`([^`]+)`", match.group(2)))
    assert int(match.group(1)) == len(listed), "the count and the list in docs/gpu.md disagree"
    assert listed == _private_targets(), "update docs/gpu.md: the manifest's private hook targets changed"


def test_every_name_the_doc_says_was_adopted_is_declared_in_the_manifest():
    adopted = re.findall(r"\*\*adopted\*\*: `([^`]+)` \(manifest `MEMBERS\[\"(\w+)\"\]`\)", _section())
    assert adopted, "docs/gpu.md: no adopted upstream name found"
    for member, cls in adopted:
        assert member in manifest.MEMBERS.get(cls, {}), f"{cls}.{member} is not declared in the manifest"
