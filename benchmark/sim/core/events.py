"""Minimal discrete-event loop: a time-ordered heap of callbacks.

Invariants: time never goes backwards; events at the same time fire in the
order they were scheduled (a sequence number breaks ties), so a run is a
deterministic function of its inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop"]


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at time ``t`` (clamped to now)."""
        if t < self.now:
            t = self.now
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def step(self) -> bool:
        """Fire the earliest event; False when none is left."""
        if not self._heap:
            return False
        t, _, fn, args = heapq.heappop(self._heap)
        self.now = t
        fn(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)
