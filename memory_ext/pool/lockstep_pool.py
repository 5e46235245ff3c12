"""LockstepLentPool: a ``LentPool`` for an engine whose tensor parallel ranks must see the same FREE
count (each rank is one client of the arbiter, with a pool of its own).

The ranks of a tensor parallel engine schedule alone and must pick the same batch, so what each rank
counts as available may change only at points every rank passes together. A plain ``LentPool`` also
changes FREE on two other paths: a late grant lands from the client's thread, and the warm chunks
return to FREE when the arbiter is lost. Here a late grant waits warm instead (the next borrow takes
it without a round trip; when the hold ends it goes back), and warm chunks of a lost arbiter are
destroyed (they had been given up). ``shed(n)`` takes chunks out of FREE at once whatever the
arbiter's state (back to the arbiter, not warm): the engine calls it where its ranks agree, to
bring every rank down to the smallest rank's FREE. ``pending_reclaim`` reads the arbiter's ask without
taking it, for the ranks to agree on.

``ranks``: how many ranks share the arbiter this way; a rank denied a borrow takes at most its share of
what the arbiter has left (``sglang_memx.elastic.shared_pool.borrow_chunks``), and marks
``borrow_fell_short`` (a borrow that may wait got less than it asked, no grant on its way) for the
ranks' agreement to read and clear. ``borrows_paused``: set by that agreement, the same on every rank;
while it holds (0.5 s of the ranks' agreed clock, many ticks) the ranks borrow nothing.

Invariant: FREE changes only inside the engine's own calls (``borrow``, ``give_back``, ``shed`` and
the engine's map / unmap), never from the client's threads.
"""

from __future__ import annotations

import time

from ..vmm.base import PhysicalChunk
from .lent_pool import LentPool


class LockstepLentPool(LentPool):
    BACKS_OFF_ALONE = False  # each rank's clock would end its back-off in another tick

    def __init__(self, *args, ranks: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranks = ranks
        self.borrows_paused = False
        self.borrow_fell_short = False

    def note_fell_short(self) -> None:
        self.borrow_fell_short = True  # the ranks' evening makes it a refusal on every rank

    def _land_late(self, chunks: list[PhysicalChunk]) -> None:
        owed = self.warm.put(chunks, time.monotonic())  # booked ours: the next borrow's
        if owed:  # a RECLAIM waits for them: they go back now
            self.client.give_back(owed, wait=False)
            with self._lock:
                self.returned_total += len(owed)

    def _warm_when_lost(self, chunks: list[PhysicalChunk]) -> None:
        for c in chunks:  # kept like every held chunk (caller holds ``_lock``): given up, so destroyed
            if self._private.pop(c.handle_id, None) is c:
                self._backend.destroy_chunk(c)

    @property
    def pending_reclaim(self) -> int:
        """Chunks the arbiter asked for and the engine has not taken yet (``take_pending_reclaim``)."""
        self._check_lost()
        with self._lock:
            return self._pending_reclaim

    def shed(self, n: int) -> int:
        """Take up to ``n`` FREE chunks out of the engine's pool now; return how many left it. While
        the arbiter is connected they go back to it at once (not warm: warm chunks stay booked to this
        rank, so the rank that is short could not borrow them, and with a borrow taking warm chunks all
        or nothing, the ranks could shed and borrow past each other for ever while a request that needs
        most of the budget waits); while it is lost they are kept chunks no arbiter counts, destroyed."""
        if n <= 0:
            return 0
        if not self._check_lost():
            return self.give_back(n, wait=False)
        chunks = self.pool.disown(n)  # while lost every held chunk is a kept one (``_check_lost``)
        with self._lock:
            for c in chunks:
                del self._private[c.handle_id]
        for c in chunks:
            self._backend.destroy_chunk(c)
        return len(chunks)
