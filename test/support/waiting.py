"""Polling for a condition in tests: one loop instead of a copy per module."""

from __future__ import annotations

import time


def wait_until(pred, timeout: float, what: str = "condition", interval: float = 0.02) -> None:
    """Call ``pred`` every ``interval`` s until it returns true; raise ``AssertionError`` naming
    ``what`` once ``timeout`` s have passed without it (``pred`` is never called after that)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
