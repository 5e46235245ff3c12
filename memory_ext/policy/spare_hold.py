"""When a server on a shared pool gives its spare chunks back to the device's arbiter.

A spare chunk is FREE memory the server holds beyond what its running requests still need
(``sglang_memx.elastic.shared_pool.spare_free_chunks``). Given back at once, it is borrowed again
at the next arrival: one round trip to the arbiter, the chunks' file descriptors passed and mapped,
their pages faulted in, on the path of that request's first token. Measured on this box (one
``tiny-a`` engine, solo requests back to back, docs/elastic-kv.md "Spare chunks"): the give-back /
borrow step cost about 3 ms a request, the whole of the engine's TTFT gap to stock.

Held instead, a spare chunk is still the device's: every report counts it as idle, so the arbiter
can reclaim it for a peer at any time (the peer then waits for one iteration of this server, or
for its wake-up when it sleeps, instead of taking unheld memory at once). The rule: hold while
the server has work (running or waiting requests) and for ``hold_s`` after its last busy
iteration; then give back. An idle server keeps nothing spare for long.

Numbers in, decisions out: no clock is read here (``now`` is passed in), nothing is moved.

Invariants: never gives back while busy; gives back at the first iteration at least ``hold_s``
after the last busy one (``hold_s = 0``: at the first idle iteration, the rule before this one
but for requests that run with nothing waiting); a server that never had work gives back at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SpareHold"]


@dataclass
class SpareHold:
    """The give-back decision, one ``observe`` per scheduler iteration."""

    hold_s: float = 1.0
    last_busy: float | None = None  # the last busy iteration's time (None: never busy)
    held_iterations: int = 0  # iterations that kept spare chunks (status)

    def __post_init__(self) -> None:
        if isinstance(self.hold_s, bool) or not isinstance(self.hold_s, (int, float)) \
                or not math.isfinite(self.hold_s) or self.hold_s < 0:  # fmt: skip
            raise ValueError(f"hold_s must be a finite number >= 0, got {self.hold_s!r}")

    def observe(self, busy: bool, now: float) -> bool:
        """This iteration's ``busy`` at ``now``; returns whether spare chunks may go back now."""
        if busy:
            self.last_busy = now
        give = not busy and (self.last_busy is None or now - self.last_busy >= self.hold_s)
        self.held_iterations += not give
        return give

    def status(self) -> dict:
        return {"hold_s": self.hold_s, "held_iterations": self.held_iterations}
