"""Where the coordinator's time goes: calls, total and longest seconds per step and per source.

``Coordinator.tick`` and ``cover_allocation`` time each step / source they run; ``/memx/status``
prints the figures (``coordinator.time``), so a stall inside memx's per-iteration work names the
step that caused it. Invariant: ``total_s >= max_s >= 0`` and ``calls >= 1`` for every entry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("sglang_memx")

SLOW_STEP_S = 0.25  # a step this long is logged (an iteration of a tiny model takes ~10-100 ms)


@dataclass
class _Entry:
    calls: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class StepClock:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def record(self, name: str, seconds: float) -> None:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry()
        entry.calls += 1
        entry.total_s += seconds
        if seconds > entry.max_s:
            entry.max_s = seconds
        if seconds >= SLOW_STEP_S:
            logger.info("memx: %s took %.3f s", name, seconds)

    def status(self) -> dict[str, dict[str, float]]:
        return {
            name: {"calls": e.calls, "total_s": round(e.total_s, 4), "max_s": round(e.max_s, 4)}
            for name, e in self._entries.items()
        }
