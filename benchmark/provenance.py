"""Where a benchmark's figures came from: the commit of the code that ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["code_version"]

REPO = Path(__file__).resolve().parents[1]


def code_version(checkout: Path = REPO) -> str:
    """The commit of ``checkout`` (default: this repository; ``+dirty`` with local changes), or
    ``unknown``."""
    try:
        head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
