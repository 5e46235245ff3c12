"""When an engine gives its allocator's kept heap back to the system (``sglang_memx.heap_trim``
does it; this module only decides).

A trim returns the free pages the C allocator kept after a burst; the next burst faults them back
in. It is only worth doing, and only harmless, when the engine has nothing to run: a trim during a
step would add its time (0.2 ms median, 2.3 ms worst, docs/reliability.md) to the TPOT of the
requests in that step. So the rule is: at the first idle iteration after a busy one, and at most
once per ``min_interval_s``.

Numbers in, decisions out: no clock is read here (``now`` is passed in), nothing is freed.

Invariants: never ``True`` while busy (no running or waiting request can be delayed by a trim);
at most one ``True`` per idle period; two ``True`` at least ``min_interval_s`` apart; an idle
period skipped for the interval is not made up later in the same idle period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["IdleTrimRule", "IdleTrimError"]


class IdleTrimError(ValueError):
    """A bad setting of the rule; the message names the field."""


@dataclass
class IdleTrimRule:
    """The trim decision, one call per scheduler iteration."""

    min_interval_s: float = 2.0
    _was_busy: bool = False
    _last_at: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_interval_s, (int, float)) or not math.isfinite(self.min_interval_s) \
                or self.min_interval_s < 0:  # fmt: skip
            raise IdleTrimError(f"min_interval_s must be a finite number >= 0, got {self.min_interval_s!r}")

    def should_trim(self, busy: bool, now: float) -> bool:
        """One iteration (``busy``: requests wait or run, ``now``: seconds, monotonic). True means
        trim now; the caller trims, and the rule counts it as done at ``now``."""
        went_idle = self._was_busy and not busy
        self._was_busy = busy
        if not went_idle:
            return False
        if self._last_at is not None and now - self._last_at < self.min_interval_s:
            return False
        self._last_at = now
        return True
