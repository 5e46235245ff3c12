"""Tensor parallel ranks agree on what memx tells upstream (``coordinator.rank_agreement``).

Two real processes on a gloo group, as upstream's tensor parallel CPU group is: a measured activation
peak becomes the largest rank's on both; a decision row becomes rank 0's on both; ranks that see the
same available size pass and count the check; ranks that see different sizes both raise
``RanksDisagree`` in the same iteration (neither is left waiting in a collective), naming both
sizes; an iteration without work makes no collective on any rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

dist = pytest.importorskip("torch.distributed")

from sglang_memx.coordinator import rank_agreement  # noqa: E402
from sglang_memx.coordinator.parts import ITERATION_RANKS  # noqa: E402
from support.two_ranks import gloo_group, run_two_ranks  # noqa: E402


def _rank(rank: int, init_file: str, available: list[int], busy: list[bool], out) -> None:
    import torch.distributed as d

    group = gloo_group(rank, init_file)
    rank_agreement.up_kv.available_tokens = lambda allocator: allocator.available
    agreement = rank_agreement.RankAgreement(2, group)
    new_tick, check = agreement.steps()
    results = [agreement.max_over_ranks(1000 + 7 * rank)]  # a measured peak: the largest rank's, on all
    results.append(agreement.rank0s([rank, 5 + rank, -1]))  # a decision row: rank 0's, on all
    first = agreement.tick_time()
    results.append(agreement.tick_time() == first)  # once a tick: the second read makes no broadcast
    new_tick.run(None)
    results.append(agreement.tick_time() >= first)  # a new tick reads rank 0's clock again
    for value, is_busy in zip(available, busy):
        kv = SimpleNamespace(buffers=SimpleNamespace(num_mapped=3 + rank))  # the ranks' mapped groups, for the status
        it = SimpleNamespace(busy=is_busy, allocator=SimpleNamespace(available=value), kv=kv, scheduler=None)
        try:
            check.run(it)
            results.append("ok")
        except rank_agreement.RanksDisagree as exc:
            results.append(str(exc))
            break
    out.put((rank, results, agreement.status()))
    d.destroy_process_group()


def _run(per_rank: dict[int, tuple[list[int], list[bool]]]) -> dict[int, tuple[list[str], dict]]:
    return run_two_ranks(_rank, per_rank)


def test_ranks_that_agree_pass_and_idle_iterations_make_no_collective():
    # rank 1 idles where rank 0 idles too; the values differ only there (never compared)
    got = _run({0: ([100, 7, 90], [True, False, True]), 1: ([100, 999, 90], [True, False, True])})
    for rank in (0, 1):
        results, status = got[rank]
        assert results == [1007, [0, 5, -1], True, True, "ok", "ok", "ok"]
        assert status == {"tensor_parallel": {"size": 2, "checks": 2, "last_available_tokens": 90,
                                              "groups_mapped_min": 3, "groups_mapped_max": 4, "peaks_agreed": 1,
                                              "broadcasts_from_rank0": 3}}  # fmt: skip


def test_ranks_that_disagree_both_raise_in_the_same_iteration_naming_both_sizes():
    got = _run({0: ([64, 40], [True, True]), 1: ([64, 48], [True, True])})
    for rank, own in ((0, 40), (1, 48)):
        results, _ = got[rank]
        assert results[:5] == [1007, [0, 5, -1], True, True, "ok"] and len(results) == 6
        assert "different available KV (40 to 48 tokens; this rank " + str(own) + ")" in results[5]


def test_the_clock_is_read_afresh_first_and_the_check_is_the_last_step_of_the_tick():
    in_tick = {name: rank for name, rank in ITERATION_RANKS.items() if name != "peer tier step"}
    assert max(in_tick, key=in_tick.get) == "agree across ranks"
    assert min(in_tick, key=in_tick.get) == "new tick for the ranks"
    new_tick, check = rank_agreement.RankAgreement(2, None).steps()
    assert new_tick.in_tick and check.in_tick and check.rank == ITERATION_RANKS["agree across ranks"]
