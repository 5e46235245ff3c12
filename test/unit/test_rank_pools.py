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

    def __init__(self, free: int, pending: int, denied: int = 0):
        self.free, self._pending, self.shed_calls, self.given = free, pending, [], 0
        self.denied_total = denied  # borrows the arbiter denied this rank
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
    for tick in ticks:
        lent = FakeLockstepPool(*tick)
        short: list = []
        pools = rank_pools.RankPools(lent, rank_agreement.RankAgreement(2, group), lambda s=short: s.append(1))
        (even,) = pools.steps()
        even.run(SimpleNamespace(busy=False))  # idle: the step runs all the same
        lent.short = len(short)
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
                                 "free_chunks_min": 7, "free_chunks_max": 10, "short_ticks": 1}  # fmt: skip
        assert results[1][:6] == (6, [0], 0, 0, 0, 0)  # equal and not asked: nothing moves
        # a rank came out short: every rank takes it as the arbiter's refusal (and only then)
        assert (results[0][7], results[1][7]) == (1, 0)


def test_a_borrow_denied_on_one_rank_is_a_refusal_on_every_rank():
    """Equal FREE, but the arbiter denied rank 1's borrow this tick: both ranks take it as a refusal
    (rank 0's Oneiros may then release layers); a tick without a denial is none."""
    got = _run({0: [(6, 0, 0), (6, 0, 0)], 1: [(6, 0, 1), (6, 0, 0)]})
    for rank in (0, 1):
        results, _ = got[rank]
        assert [r[7] for r in results] == [1, 0]
        assert results[0][1] == [0]  # nothing to shed: FREE was equal
        # and both ranks pause their next borrows alike (a fresh agreement, never refused: no pause)
        assert [r[8] for r in results] == [True, False]
