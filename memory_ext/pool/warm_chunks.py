"""Chunks an engine no longer needs but has not yet returned to the arbiter: kept warm for a short
while so its next borrow skips the round trip (``lent_pool.LentPool``).

Under steady traffic a server in a shared pool borrows its prefill's memory at admission and gives
it back a step later: a round trip on every request's path (the arbiter's scheduling latency; on
this 2-core box about half of the shared pool's per-request cost, docs/governor.md). Warm chunks
break that loop without taking memory from anyone: they are outside the engine's own pool (its
admission never counts them), so the client's reclaim thread may hand them to the arbiter the
moment it asks, without waiting for the engine's next iteration, as it may not for FREE chunks.

Invariants: a warm chunk is mapped nowhere, is booked by the arbiter as this client's, and is in
exactly one of: this holder, the engine's pool (re-adopted by a borrow), or on its way back to the
arbiter; ``hold_s`` after the last chunk was put here, every warm chunk goes back. No chunk is kept
warm while the arbiter waits for chunks from this client (``owed``: what its RECLAIMs asked for
and no return has paid yet; the arbiter counts on them for a waiting borrow, so ``put`` hands the
owed part back at once). A debt lasts ``owed_for_s`` after the last RECLAIM (the arbiter's default
``reclaim_timeout``, 2 s: by then the borrow was granted, replanned or denied, and the arbiter has
forgotten the ask). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from memory_ext.vmm.base import PhysicalChunk

__all__ = ["WarmChunks"]


class WarmChunks:
    """Up to ``hold_s`` seconds of spare chunks (0: off, every chunk goes back at once)."""

    def __init__(self, hold_s: float = 0.0, owed_for_s: float = 2.0):
        if not hold_s >= 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s!r}")
        if not owed_for_s > 0:
            raise ValueError(f"owed_for_s must be > 0, got {owed_for_s!r}")
        self.hold_s, self.owed_for_s = float(hold_s), float(owed_for_s)
        self._lock = threading.Lock()
        self._chunks: list[PhysicalChunk] = []
        self._until = 0.0
        self.reused_total = 0  # chunks a borrow took from here instead of the arbiter
        self.reclaimed_total = 0  # chunks handed to the arbiter's reclaim from here
        self._owed = 0  # chunks the arbiter asked for (RECLAIM) that no return has paid yet
        self._owed_until = 0.0  # monotonic: the debt lapses then (the module docstring)
        self.owed_paid_at_once = 0  # chunks ``put`` sent straight back because they were owed

    @property
    def owed(self) -> int:
        """Chunks a RECLAIM asked for in the last ``owed_for_s`` that no return has paid."""
        return self._owed if time.monotonic() < self._owed_until else 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

    def put(self, chunks: Sequence[PhysicalChunk], now: float) -> list[PhysicalChunk]:
        """Keep ``chunks`` until ``now + hold_s`` (the deadline moves with each put), except the
        ones the arbiter is owed: those are returned, for the caller to give back at once."""
        with self._lock:
            back = list(chunks[: self.owed])
            self._owed -= len(back)
            self.owed_paid_at_once += len(back)
            kept = chunks[len(back) :]
            if kept:
                self._chunks.extend(kept)
                self._until = now + self.hold_s
            return back

    def paid(self, n: int) -> None:
        """``n`` chunks went back to the arbiter by another way (a give-back, an expiry)."""
        with self._lock:
            self._owed = max(0, self._owed - n)

    def take_exactly(self, n: int) -> list[PhysicalChunk]:
        """``n`` chunks for a borrow, or none if fewer are warm (a borrow is all or nothing)."""
        with self._lock:
            if n <= 0 or len(self._chunks) < n:
                return []
            got, self._chunks = self._chunks[-n:], self._chunks[:-n]
            self.reused_total += n
            return got

    def take_for_reclaim(self, n: int) -> list[PhysicalChunk]:
        """Up to ``n`` chunks for the arbiter's RECLAIM; the rest of ``n`` is owed until paid."""
        with self._lock:
            got = self._chunks[-n:] if n > 0 else []
            self._chunks = self._chunks[: len(self._chunks) - len(got)]
            self.reclaimed_total += len(got)
            if n > len(got):
                self._owed, self._owed_until = self.owed + n - len(got), time.monotonic() + self.owed_for_s
            return got

    def take_expired(self, now: float) -> list[PhysicalChunk]:
        """Every chunk once the hold has passed, else none."""
        with self._lock:
            if not self._chunks or now < self._until:
                return []
            got, self._chunks = self._chunks, []
            self._owed = max(0, self._owed - len(got))  # they go back now
            return got

    def take_all(self) -> list[PhysicalChunk]:
        """Every chunk, for the engine's pool (the arbiter is gone, or this client leaves): nothing
        is owed any more."""
        with self._lock:
            got, self._chunks = self._chunks, []
            self._owed = 0
            return got
