"""Where the coordinator's time goes: calls, total and longest seconds per step and per source.

``Coordinator.tick`` and ``cover_allocation`` time each step / source they run; ``/memx/status``
prints the figures (``coordinator.time``), so a stall inside memx's per-iteration work names the
step that caused it. Each entry also holds the part spent in *busy* iterations (those whose "work?"
step found requests waiting or running; a source always runs on a request's path): that part is
what delays requests, the rest runs while the engine is idle. Invariant: ``total_s >= max_s >= 0``,
``calls >= 1``, ``busy_calls <= calls`` and ``busy_s <= total_s`` for every entry.
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
    busy_calls: int = 0
    busy_s: float = 0.0


class StepClock:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def record(self, name: str, seconds: float, busy: bool = True) -> None:
        """One call of ``name`` that took ``seconds``; ``busy``: in an iteration with work."""
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry()
        entry.calls += 1
        entry.total_s += seconds
        if busy:
            entry.busy_calls += 1
            entry.busy_s += seconds
        if seconds > entry.max_s:
            entry.max_s = seconds
        if seconds >= SLOW_STEP_S:
            logger.info("memx: %s took %.3f s", name, seconds)

    def status(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "calls": e.calls,
                "total_s": round(e.total_s, 4),
                "max_s": round(e.max_s, 4),
                "busy_calls": e.busy_calls,
                "busy_s": round(e.busy_s, 4),
            }
            for name, e in self._entries.items()
        }
