"""Tensor parallel ranks on one shared pool agree on their FREE chunks and the arbiter's reclaims
(``coordinator.rank_pools``), in two real processes on a gloo group as upstream's tensor parallel CPU
group is: after the step every rank holds the smallest rank's FREE (the others shed the rest), every
rank frees the largest rank's pending ask at the next tick (taken once), and gives back only its own
ask (``shared_pool.answer_reclaim`` with ``agreed``). Idle ticks run the step too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

dist = pytest.importorskip("torch.distributed")

from sglang_memx.coordinator import rank_agreement, rank_pools  # noqa: E402
from sglang_memx.elastic import shared_pool  # noqa: E402
from support.two_ranks import gloo_group, run_two_ranks  # noqa: E402


class FakeLockstepPool:
    """FREE and the arbiter's pending ask as numbers; ``shed`` and ``give_back`` lower FREE."""

    def __init__(self, free: int, pending: int, short: int = 0, clock_s: float = 0.0):
        self.free, self._pending, self.shed_calls, self.given = free, pending, [], 0
        self.borrow_fell_short = bool(short)  # this tick's borrow got less than it asked
        self.clock_s = clock_s  # this rank's monotonic clock at the agreement
        self.borrows_paused = False
        self.pool = SimpleNamespace(available=lambda: self.free)

    @property
    def pending_reclaim(self) -> int:
        return self._pending

    def shed(self, n: int) -> int:
        self.shed_calls.append(n)
        n = max(0, min(n, self.free))
        self.free -= n
        return n

    def take_pending_reclaim(self, at_most: int | None = None) -> int:
        n = self._pending if at_most is None else min(at_most, self._pending)
        self._pending -= n
        return n

    def give_back(self, n: int) -> int:
        self.given += n
        self.free -= n
        return n


def _rank(rank: int, init_file: str, ticks: list[tuple[int, ...]], out) -> None:
    import torch.distributed as d

    group = gloo_group(rank, init_file)
    freed: list[int] = []
    shared_pool.free_groups = lambda kv, allocator, tree, groups: freed.append(groups) or groups
    shared_pool.spare_free_chunks = lambda kv, allocator, scheduler, activation: 100
    results = []
    short: list = []
    # one agreement for every tick (its pause lasts across ticks); each tick brings a pool and a clock
    pools = rank_pools.RankPools(FakeLockstepPool(0, 0), rank_agreement.RankAgreement(2, group),
                                 lambda: short.append(1))  # fmt: skip
    (even,) = pools.steps()
    for tick in ticks:
        lent = pools.lent = FakeLockstepPool(*tick)
        rank_pools.time = SimpleNamespace(monotonic_ns=lambda lent=lent: int(lent.clock_s * 1e9))
        before = len(short)
        even.run(SimpleNamespace(busy=False))  # idle: the step runs all the same
        lent.short = len(short) - before
        assert not lent.borrow_fell_short  # read and cleared
        agreed = pools.take_agreed_reclaim()
        activation = SimpleNamespace(release_idle=lambda keep: None, next_step_chunks=lambda scheduler: 0)
        kv = SimpleNamespace(buffers=SimpleNamespace(chunks_per_group=2))
        back = shared_pool.answer_reclaim(kv, lent, None, None, None, activation, agreed=agreed)
        results.append((lent.free, lent.shed_calls, agreed, pools.take_agreed_reclaim(), back, lent.pending_reclaim,
                        pools.status()["tensor_parallel_pool"], lent.short, lent.borrows_paused))  # fmt: skip
    out.put((rank, results, freed))
    d.destroy_process_group()


def _run(per_rank: dict[int, list[tuple[int, ...]]]) -> dict[int, tuple[list, list[int]]]:
    return run_two_ranks(_rank, {r: (ticks,) for r, ticks in per_rank.items()})


def test_ranks_even_their_free_chunks_and_free_the_largest_ask_giving_back_their_own():
    # tick 1: rank 0 holds 10 FREE, rank 1 holds 7 and was asked for 5 chunks; tick 2: equal, no ask
    got = _run({0: [(10, 0), (6, 0)], 1: [(7, 5), (6, 0)]})
    (r0, freed0), (r1, freed1) = got[0], got[1]
    # rank 0 sheds its 3 surplus chunks, frees what rank 1 was asked (5 chunks: 3 groups), gives back none
    assert r0[0][:6] == (7, [3], 5, 0, 0, 0)
    # rank 1 sheds nothing, frees the same, gives back its own ask
    assert r1[0][:6] == (2, [0], 5, 0, 5, 0)
    assert freed0 == freed1 == [3]  # the same groups freed on both ranks: their radix trees stay equal
    for results in (r0, r1):
        assert results[0][6] == {"evened": 1, "chunks_shed": results[0][1][0], "reclaims_agreed": 1,
                                 "free_chunks_min": 7, "free_chunks_max": 10, "short_ticks": 0}  # fmt: skip
        assert results[1][:6] == (6, [0], 0, 0, 0, 0)  # equal and not asked: nothing moves
        # uneven FREE without a borrow that fell short (a reclaim, each rank giving back its own ask) is
        # no refusal: nothing pauses
        assert [r[7:] for r in results] == [(0, False), (0, False)]


def test_a_borrow_short_on_one_rank_is_a_refusal_on_every_rank_and_pauses_both_on_one_clock():
    """Equal FREE, but rank 1's borrow fell short this tick: both ranks take it as a refusal (rank 0's
    Oneiros may then release layers) and pause their borrows until 0.5 s past the ranks' agreed clock
    (the largest rank's: rank 1's clock runs 0.3 s behind and ends it no earlier); a tick without a
    short borrow is no refusal."""
    got = _run({0: [(6, 0, 0, 100.0), (6, 0, 0, 100.4), (6, 0, 0, 100.6)],
                1: [(6, 0, 1, 99.7), (6, 0, 0, 100.1), (6, 0, 0, 100.3)]})  # fmt: skip
    for rank in (0, 1):
        results, _ = got[rank]
        assert [r[7] for r in results] == [1, 0, 0]
        assert results[0][1] == [0]  # nothing to shed: FREE was equal
        assert [r[8] for r in results] == [True, True, False]
