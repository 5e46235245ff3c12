"""An engine that goes idle gives the heap its allocator kept from the burst back to the system.

torch's CPU tensors come from the C allocator. After a burst, glibc keeps the freed memory in
its arenas (one per thread that allocated: the scheduler's and each OpenMP worker's), and its
mmap threshold rises with the largest block freed, so later large tensors come from the arenas
too. The process's RSS then stays at the burst's high-water mark while the engine sits idle:
host memory its co-located siblings (and the shared pool's chunks) cannot use, and that a leak
check between quiet points cannot tell from a leak. Measured on the one-minute soak (four
engines on two cores, the busy engine lending its idle siblings' cores): RSS grew 30-37 MiB
between the quiet points without the trim (three runs), 6.9-16.5 MiB with it (four runs); a
trim took 0.2 ms at the median and 2.3 ms at most over 77 trims (docs/reliability.md).

``tick`` runs once per scheduler iteration (``coordinator.tick.per_iteration``). When the policy
says so (``memory_ext.policy.idle_trim``: the first idle iteration after work, at most once per
``min_interval_s``), it calls glibc's ``malloc_trim(0)``, which returns the free pages of every
arena. It never runs while requests wait or run, so it costs no step time; the next burst faults
its pages back in.

Invariants: no trim while busy; at most one trim per idle period and per ``min_interval_s``; a C
library without ``malloc_trim`` (not glibc) is logged once and nothing more is tried.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memory_ext.policy.idle_trim import IdleTrimRule

__all__ = ["IdleHeapTrim", "tick", "status"]

logger = logging.getLogger("sglang_memx")


@dataclass
class IdleHeapTrim:
    """The mechanism: trims when ``memory_ext.policy.idle_trim.IdleTrimRule`` says so, and times it."""

    trim: Callable[[], object]
    rule: IdleTrimRule = field(default_factory=IdleTrimRule)
    trims: int = 0
    last_ms: float = 0.0
    max_ms: float = 0.0

    def step(self, busy: bool, now: float) -> bool:
        """One iteration: ``busy`` if requests wait or run. True when it trimmed."""
        if not self.rule.should_trim(busy, now):
            return False
        started = time.perf_counter()
        self.trim()
        self.last_ms = (time.perf_counter() - started) * 1e3
        self.max_ms = max(self.max_ms, self.last_ms)
        self.trims += 1
        return True

    def status(self) -> dict[str, Any]:
        return {"trims": self.trims, "last_ms": round(self.last_ms, 3), "max_ms": round(self.max_ms, 3),
                "min_interval_s": self.rule.min_interval_s}  # fmt: skip


def glibc_trim() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of this process's C library, None where it has none."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


_trimmer: IdleHeapTrim | None = None
_unavailable = False


def tick(busy: bool) -> None:
    """One scheduler iteration of this engine (``busy``: requests wait or run)."""
    global _trimmer, _unavailable
    if _unavailable:
        return
    if _trimmer is None:
        trim = glibc_trim()
        if trim is None:
            logger.info("memx: the C library has no malloc_trim; an idle engine keeps its allocator's heap")
            _unavailable = True
            return
        _trimmer = IdleHeapTrim(trim)
    _trimmer.step(busy, time.monotonic())


def status() -> dict[str, Any] | None:
    """``/memx/status``'s ``heap_trim`` section (None before the first iteration or without glibc)."""
    return None if _trimmer is None else _trimmer.status()
