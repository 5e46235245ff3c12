"""Tensor parallel ranks on one shared pool (``--memx-pool`` at ``--tp`` > 1, issue 28 item 4).

Each rank is one client of the device's arbiter with a pool of its own (``LockstepLentPool``), so the
arbiter counts every rank's chunks: a server of two ranks holds two ranks' KV and activations. Borrows
and reclaims reach the ranks one at a time, so their FREE counts could part; what upstream's schedulers
read next (``available_size``: free pages plus the pages FREE could map) must not
(``rank_agreement``). Two rules keep it equal:

* The ranks borrow only in the tick's "give back, borrow" step (``Coordinator.borrow_pool`` is None
  for a lockstep pool: admission, a decode step's capacity check and the head's activation take what
  the pool holds, as on an own pool, and there is no "borrow from the shared pool" source), and right
  after it every rank sheds what the smallest rank lacks ("even the ranks' pools": one all-reduce of
  FREE a tick; the surplus goes back to the arbiter at once, where the short rank can borrow it next
  tick; kept warm, it stayed booked to its rank and the ranks could pass each other for ever). Late
  grants wait warm (booked; the next borrow of that rank takes them).
* The arbiter's reclaims: the same all-reduce carries every rank's pending ask; at the next tick every
  rank frees the largest ask (the same idle activation, free groups and cached prefixes: the ranks'
  radix trees stay equal) and gives back its own (``shared_pool.answer_reclaim``'s ``agreed``).

A borrow that fell short on any rank (it may wait, got less than it asked and no grant is on its way:
``LockstepLentPool.borrow_fell_short``) means the arbiter could not fund every rank's ask: every rank
then takes it as a refusal (``short_of_memory``:
``shared_pool.note_refused``), so rank 0's Oneiros may release layers (on a shared pool an active server
remaps its own layers only after the arbiter refused; rank 0's borrow, asked first, was often granted and
its surplus shed while the batch waited). Each rank's own back-off would end in another tick on each
rank (one rank borrowing alone, evened back, nothing admitted: seen); instead the ranks pause their
borrows for ``BORROW_PAUSE_S`` of an agreed clock (the largest rank's, in the same all-reduce), the
pause read at the next tick's borrow (``LockstepLentPool.borrows_paused``).

The step runs on idle ticks too (reclaims come mostly to idle servers); upstream's ranks pass every
iteration together (rank 0 broadcasts the received requests), so the collective never waits long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.coordinator.parts import Iteration, Source, Step, step
from sglang_memx.coordinator.rank_agreement import RankAgreement, RanksDisagree, spreads

BORROW_PAUSE_S = 0.5  # the ranks' borrows after a refusal (a plain server's first back-off, shared_pool)


@dataclass(eq=False)
class RankPools:
    """One rank's side of the ranks' agreement on a shared pool (``lent``), over ``ranks``' group;
    ``short_of_memory`` runs on every rank in a tick where one rank came out of the borrow step short."""

    lent: LockstepLentPool
    ranks: RankAgreement
    short_of_memory: Callable[[], None]
    name: str = "ranks' shared pools"
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("evened", "chunks_shed", "reclaims_agreed", "free_chunks_min",
                                                "free_chunks_max", "short_ticks"), 0)
    )  # fmt: skip
    _agreed_reclaim: int = field(default=0, repr=False)
    _pause_until: float = field(default=0.0, repr=False)  # on the agreed clock

    def steps(self) -> tuple[Step, ...]:
        return (step("even the ranks' pools", self._even),)

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"tensor_parallel_pool": dict(self.counts)}

    def take_agreed_reclaim(self) -> int:
        """The chunks every rank frees for the arbiter this tick (the largest rank's ask at the last
        agreement; 0 once taken)."""
        n, self._agreed_reclaim = self._agreed_reclaim, 0
        return n

    def _even(self, it: Iteration) -> None:
        free = self.lent.pool.available()
        fell_short, self.lent.borrow_fell_short = self.lent.borrow_fell_short, False
        values = [free, self.lent.pending_reclaim, int(it.busy), int(fell_short), time.monotonic_ns()]
        (low, high), (_, ask), busy, (_, any_short), (_, clock_ns) = spreads(values, self.ranks.group)
        now = clock_ns / 1e9  # the same on every rank
        if busy[0] != busy[1]:  # the ranks' check runs on busy ticks only: their collectives would part
            raise RanksDisagree(f"memx: tensor parallel ranks disagree on whether this iteration has work (this "
                                f"rank: {it.busy}); they would part in the next collective and hang")  # fmt: skip
        self._agreed_reclaim = ask
        shed = self.lent.shed(free - low)
        if any_short:  # the arbiter did not fund every rank's ask: a refusal for all of them (FREE may also
            # differ after a reclaim, each rank giving back its own ask: that is no refusal)
            self.short_of_memory()
            self.counts["short_ticks"] += 1
            self._pause_until = now + BORROW_PAUSE_S
        self.lent.borrows_paused = now < self._pause_until
        self.counts["evened"] += 1
        self.counts["chunks_shed"] += shed
        self.counts["reclaims_agreed"] += ask > 0
        # the ranks' FREE before the step (rank 0's status shows the others'); after it, every rank's is ``low``
        self.counts["free_chunks_min"], self.counts["free_chunks_max"] = low, high
