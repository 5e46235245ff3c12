"""Tensor parallel ranks agree on what memx tells upstream (``--tp`` above 1, issue 28 item 4).

Upstream runs one scheduler per tensor parallel rank; each picks its batch alone from the same
requests, and the forward's collectives need every rank to pick the same one. With elastic KV every
rank has its own pool, and the one number memx adds to what upstream's scheduling reads is the
allocator's available size (free pages plus the pages the pool could map now). It is the same on
every rank by construction at ``--tp`` > 1: premap, deflation and the budget read only the allocator,
the queue and the budget, and the activation balloon's one rank-local input, the activation peak
measured on a forward, is agreed before it is used (``max_over_ranks``: the largest rank's peak, on
every rank; measured forwards are the same forwards on every rank). Remappable weights decide from
timings each rank measures alone: every rank applies rank 0's decision (``rank0s``: one broadcast);
the governor and the host buffer's Alg. 2 read rank 0's clock (``tick_time``: one broadcast a tick
for both), so their measured steps and TTFT / TPOT samples are rank 0's. On a shared pool the ranks
agree on their FREE chunks and the arbiter's reclaims (``rank_pools``). ``families.TP_READY_FLAGS``
refuses the features whose rank-local inputs are not agreed: the peer tier (remappable weights and sleep
run on rank 0's answer, their layers not lent to reclaims at --tp > 1).

``RankAgreement`` checks that construction in every iteration with work, with one all-reduce of the
available size over upstream's tensor parallel CPU group (and, for the status, of the mapped KV
groups: only rank 0 answers ``/memx/status``, so the other ranks' memory shows as the ranks' min and
max). Ranks that disagree would next pick different batches and hang in the forward's collectives;
instead every rank raises at once (each sees the same reduced pair), naming both sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sglang_memx.coordinator.parts import Iteration, Source, Step, step
from sglang_memx.upstream import kv as up_kv


class RanksDisagree(RuntimeError):
    """Two tensor parallel ranks saw different available KV sizes in the same iteration."""


def spreads(values: list[int], group) -> list[tuple[int, int]]:
    """(smallest, largest) over the ranks of ``group`` of each of this rank's ``values``: one
    all-reduce (MAX) of (v, -v) pairs. Every rank of the group must call it in the same iteration,
    with as many values."""
    t = torch.tensor([x for v in values for x in (v, -v)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [(-int(t[2 * i + 1]), int(t[2 * i])) for i in range(len(values))]


def spread(value: int, group) -> tuple[int, int]:
    """(smallest, largest) of each rank's ``value`` over ``group`` (``spreads`` of one value)."""
    return spreads([value], group)[0]


@dataclass(eq=False)
class RankAgreement:
    """The ranks' check (one per scheduler process at ``--tp`` > 1) on ``group``, upstream's tensor
    parallel CPU group."""

    tp_size: int
    group: Any
    name: str = "rank agreement"
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("checks", "last_available_tokens", "groups_mapped_min",
                                                "groups_mapped_max", "peaks_agreed", "broadcasts_from_rank0"), 0)
    )  # fmt: skip
    _tick_time: float | None = field(default=None, repr=False)  # this tick's ``tick_time``, once read

    def steps(self) -> tuple[Step, ...]:
        return (step("new tick for the ranks", self._new_tick), step("agree across ranks", self._agree))

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"tensor_parallel": {"size": self.tp_size, **self.counts}}

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` of all ranks (every rank calls it for the same forward)."""
        self.counts["peaks_agreed"] += 1
        return spread(value, self.group)[1]

    def rank0s(self, row: list[int]) -> list[int]:
        """Rank 0's ``row`` on every rank (one broadcast; every rank passes a row of the same length
        in the same iteration): a decision, or a clock, read from what each rank measures alone."""
        t = torch.tensor(row, dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.counts["broadcasts_from_rank0"] += 1
        return [int(v) for v in t]

    def tick_time(self) -> float:
        """Rank 0's monotonic clock at this tick (seconds), the same on every rank: one broadcast at the
        tick's first reader (the governor's measure, the host buffer's Alg. 2: each reads it every tick)."""
        if self._tick_time is None:
            self._tick_time = self.rank0s([time.monotonic_ns()])[0] / 1e9
        return self._tick_time

    def _new_tick(self, it: Iteration) -> None:
        self._tick_time = None

    def _agree(self, it: Iteration) -> None:
        if not it.busy:  # every rank has the same queue: all of them skip, or none
            return
        available = up_kv.available_tokens(it.allocator)
        (low, high), mapped = spreads([available, it.kv.buffers.num_mapped], self.group)
        self.counts["checks"] += 1
        self.counts["last_available_tokens"] = available
        # the other ranks' memory, seen from rank 0's /memx/status (equal by construction; not checked)
        self.counts["groups_mapped_min"], self.counts["groups_mapped_max"] = mapped
        if low != high:
            raise RanksDisagree(
                f"memx: tensor parallel ranks see different available KV ({low} to {high} tokens; this rank "
                f"{available}); they would pick different batches and hang in the forward's collectives"
            )
