"""What the server's mechanisms ask of the activation sharing its pool (``ActivationSide``).

The coordinator passes its activation component (``coordinator.components.ActivationBalloonPart``)
or, when no activation shares the pool, a side that holds, needs and costs nothing and admits
every batch (``NoActivation``). Callers never test whether there is one.
"""

from __future__ import annotations

from typing import Protocol

from memory_ext.pool.lent_pool import LentPool


class ActivationSide(Protocol):
    def held_chunks(self) -> int: ...

    def idle_chunks(self) -> int: ...

    def next_step_chunks(self, scheduler) -> int:
        """Chunks the admitted requests' next step needs (``demand.admitted_activation_chunks``)."""

    def head_prefill_chunks(self, scheduler) -> int: ...

    def release_idle(self, keep: int) -> None: ...

    def admission_cost_pages(self, tokens: int, seqs: int) -> int:
        """KV pages making a batch of ``tokens`` / ``seqs`` live takes from admission's budget."""

    def reserve(self, allocator, tree, tokens: int, seqs: int, *, lent: LentPool | None, urgent: bool = False) -> bool:
        """Hold a batch's activation chunks (``ballooning.reserve_activation``); False: it does not fit."""

    def live_chunks(self) -> int: ...

    def set_live_chunks(self, chunks: int) -> None:
        """Give a refused request's share back to idle (admission's undo)."""

    def count(self, event: str) -> None:
        """Count ``event`` in the activation's stats (deferred requests, overcommitted chunks)."""
