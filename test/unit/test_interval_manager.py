"""Streaming budget per iteration (memory_ext/policy/interval_manager.py)."""

import pytest

from memory_ext.policy.interval_manager import (
    IntervalManager,
    demand_from_profile,
    iteration_seconds,
    stream_budget,
)
from memory_ext.policy.layer_profile import LayerProfile
from memory_ext.policy.oneiros import BufferMode, plan_layers
from memory_ext.policy.select_n import LayerTiming, LinkCoordinator, SloKind, optimal_interval


def _profile(**kw):
    base = dict(
        model="m",
        device="cpu",
        dtype="bf16",
        n_layers=8,
        layer_bytes=3_000,
        link_bytes_per_s=1_000.0,  # T_T = 3 s
        decode_layer_s={1: 1.0, 4: 2.0},
        prefill_layer_s_per_token=0.5,
        seq_len=64,
        measured_at="2026-11-30T10:00:00+00:00",
        command="test",
    )
    base.update(kw)
    return LayerProfile(**base)


def test_one_slot_hand_example():
    # n=8, t_c=1, T_T=3, SLO 12: latency(i) = 8 + (8//i)*max(0, 3-(i-1))
    # i=1: 32, i=2: 16, i=3: 10 <= 12 -> interval 3, 2 layers (6 and 3 ... every third)
    b = stream_budget(8, 1.0, 3.0, 12.0, slots=1)
    assert (b.layers, b.interval, b.feasible) == (2, 3, True)
    assert b.iteration_s == pytest.approx(10.0)
    assert "SLO 12 s binds" in b.reason and "interval 2 (4 layers) would take 16 s" in b.reason


@pytest.mark.parametrize("t_c, t_tr, slo", [(1.0, 3.0, 48.0), (1e-3, 12.6e-3, 0.054), (4.8e-3, 12.6e-3, 0.23)])
def test_one_slot_is_select_n_optimal_interval(t_c, t_tr, slo):
    n = 32
    b = stream_budget(n, t_c, t_tr, slo, slots=1)
    i = optimal_interval(n, LayerTiming(t_c, t_tr), slo, SloKind.ABSOLUTE)
    assert (b.interval, b.layers) == (i, n // i)
    assert iteration_seconds(n, i, t_c, t_tr, 1) <= slo < iteration_seconds(n, i - 1, t_c, t_tr, 1)


@pytest.mark.parametrize("n, ratio", [(12, 2.0), (40, 3.2), (32, 12.6), (8, 1.0), (40, 1.7)])
def test_no_slack_one_slot_meets_oneiros_eq4_and_two_slots_is_eq5(n, ratio):
    # SLO = compute: no stall allowed. One slot: m layers satisfy Eq. 4 with m = alpha + 1.
    one = stream_budget(n, 1.0, ratio, float(n), slots=1)
    if one.layers:
        assert plan_layers(n, one.layers - 1, ratio, 1.0, BufferMode.SINGLE).feasible
    # two slots: exactly the largest m with Eq. 5 (m = alpha + 2)
    two = stream_budget(n, 1.0, ratio, float(n), slots=2)
    assert two.layers * ratio <= n < (two.layers + 1) * ratio or two.layers == n
    if 2 < two.layers < n:
        assert plan_layers(n, two.layers - 2, ratio, 1.0, BufferMode.DOUBLE).feasible
        assert not plan_layers(n, two.layers - 1, ratio, 1.0, BufferMode.DOUBLE).feasible


def test_n12_no_slack_one_slot_equals_eq4_when_interval_divides():
    # T_T = 2 T_c: interval 3 (every third layer), m = 4: Eq. 4 8 <= 8 holds, m = 5 fails
    b = stream_budget(12, 1.0, 2.0, 12.0, slots=1)
    assert (b.layers, b.interval) == (4, 3)
    assert plan_layers(12, 3, 2.0, 1.0, BufferMode.SINGLE).feasible
    assert not plan_layers(12, 4, 2.0, 1.0, BufferMode.SINGLE).feasible


def test_interval_is_the_smallest_meeting_the_slo_not_the_smallest_with_its_count():
    # n=32, T_T=12.6, t_c=1.12: intervals 9 and 10 both stream 3 layers; only 10 meets 44.7
    b = stream_budget(32, 1.12, 12.6, 32 * 1.12 + 8.0)
    assert (b.layers, b.interval) == (3, 10)
    assert iteration_seconds(32, 9, 1.12, 12.6) > 32 * 1.12 + 8.0


def test_paper_n40_double_buffering_count():
    # §7.5 reading (test_policy_oneiros): T_T/T_c = 3.2, n = 40: Eq. 5 allows alpha 10 -> m = 12
    assert stream_budget(40, 1.0, 3.2, 40.0, slots=2).layers == 12
    assert stream_budget(40, 1.0, 3.2, 40.0, slots=3).layers == 12  # more slots: same model


def test_infeasible_all_layers_and_fixed_time():
    b = stream_budget(8, 1.0, 3.0, 7.9)
    assert (b.layers, b.interval, b.feasible) == (0, 9, False) and "unattainable" in b.reason
    b = stream_budget(8, 1.0, 3.0, 1e6)
    assert (b.layers, b.interval) == (8, 1) and "all 8 layers" in b.reason
    # time outside the layers comes off the budget
    assert stream_budget(8, 1.0, 3.0, 14.0, fixed_s=2.0).layers == stream_budget(8, 1.0, 3.0, 12.0).layers
    assert stream_budget(8, 1.0, 3.0, 14.0, fixed_s=6.5).feasible is False


@pytest.mark.parametrize("slots", [1, 2])
def test_looser_slo_never_streams_fewer_layers(slots):
    prev = -1
    for k in range(60):
        b = stream_budget(32, 1e-3, 12.6e-3, 0.032 + k * 0.002, slots=slots)
        assert b.layers >= prev
        assert b.iteration_s <= 0.032 + k * 0.002 + 1e-12
        prev = b.layers


def test_manager_uses_interpolated_decode_time_and_never_exceeds_n():
    p = _profile()
    m = IntervalManager(p, tbt_slo_s=12.0)
    assert m.decide(1) == stream_budget(8, 1.0, 3.0, 12.0)
    # batch 2: t_c = 1 + 1/3; batch 100: extrapolated 2 + 96/3
    assert m.decide(2) == stream_budget(8, 4 / 3, 3.0, 12.0)
    assert IntervalManager(p, 1e9).streamable_layers(100) == 8
    assert IntervalManager(p, 5.0).decide(1).feasible is False
    pre = m.decide_prefill(4, slo_s=30.0)  # t_c = 2
    assert pre == stream_budget(8, 2.0, 3.0, 30.0)


def test_demand_from_profile_feeds_the_link_coordinator():
    p = _profile()
    tight = demand_from_profile("a", IntervalManager(p, 12.0), 1)
    loose = demand_from_profile("b", IntervalManager(p, 20.0), 1)
    # min interval = Select-N's optimal interval under each GPU's own SLO
    assert tight.min_interval == 3 and loose.min_interval == 2
    # rate of an interval = its bytes over its own modelled iteration
    assert loose.transfer_rate(2) == pytest.approx(4 * 3000 / 16.0)
    assert tight.transfer_rate(4) == pytest.approx(2 * 3000 / 8.0)
    alone = LinkCoordinator(p.link_bytes_per_s).decide(loose)
    assert alone.accepted and alone.intervals["b"] == 2
    # sharing one link of 1000 B/s: 750 + 750 does not fit, the coordinator backs one off
    both = LinkCoordinator(p.link_bytes_per_s).decide(loose, [tight])
    assert both.accepted and both.total_rate <= 1000.0
    assert both.host_bytes == max(
        (loose.offloaded_bytes(i) + tight.offloaded_bytes(j))
        for i in loose.candidate_intervals()
        for j in tight.candidate_intervals()
        if loose.transfer_rate(i) + tight.transfer_rate(j) <= 1000.0
    )
    # a contended share is passed explicitly: half the link, T_T doubles
    half = demand_from_profile("c", IntervalManager(p, 12.0), 1, link_bytes_per_s=500.0)
    assert half.min_interval == optimal_interval(8, LayerTiming(1.0, 6.0), 12.0, SloKind.ABSOLUTE)
    assert demand_from_profile("d", IntervalManager(p, 5.0), 1).min_interval is None
    two = demand_from_profile("e", IntervalManager(p, 12.0, slots=2), 1)
    assert two.min_interval == 2 and two.transfer_rate(2) == pytest.approx(4 * 3000 / 12.0)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: IntervalManager(object(), 1.0), "profile"),
        (lambda: IntervalManager(_profile(), 0.0), "tbt_slo_s"),
        (lambda: IntervalManager(_profile(), 1.0, slots=0), "slots"),
        (lambda: IntervalManager(_profile(), 1.0, fixed_s=-1.0), "fixed_s"),
        (lambda: IntervalManager(_profile(), 1.0).decide(0), "batch"),
        (lambda: IntervalManager(_profile(), 1.0).decide_prefill(0, 1.0), "tokens"),
        (lambda: IntervalManager(_profile(), 1.0).decide_prefill(4, float("nan")), "slo_s"),
        (lambda: stream_budget(0, 1.0, 1.0, 1.0), "n_layers"),
        (lambda: stream_budget(8, 0.0, 1.0, 1.0), "t_c"),
        (lambda: stream_budget(8, 1.0, -1.0, 1.0), "t_tr"),
        (lambda: demand_from_profile("a", IntervalManager(_profile(), 1.0), 1, link_bytes_per_s=0), "link_bytes_per_s"),
    ],
)
def test_bad_arguments_name_the_field(call, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        call()


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_copies_on_the_compute_cores_add_to_the_iteration(slots):
    """CPU: m streamed layers take n t_c + m T_T whatever the slots; the largest m within the SLO."""
    n, t_c, t_tr = 8, 1.0, 3.0
    assert iteration_seconds(n, 2, t_c, t_tr, slots, 0.5, copies_share_compute=True) == 8 + 4 * 3 + 0.5
    b = stream_budget(n, t_c, t_tr, 21.0, slots, 0.5, copies_share_compute=True)
    assert (b.layers, b.interval, b.feasible) == (4, 2, True)  # 8.5 + 4 * 3 = 20.5 <= 21 < 23.5
    assert b.iteration_s == 20.5 and "added to it" in b.reason
    overlapped = stream_budget(n, t_c, t_tr, 21.0, slots, 0.5)
    # beside a copy engine the same layers cost less, and the same SLO streams at least as many
    assert overlapped.layers >= b.layers and overlapped.iteration_s < b.iteration_s
    assert stream_budget(n, t_c, t_tr, 10.0, slots, 0.5, copies_share_compute=True).layers == 0
    assert stream_budget(n, t_c, t_tr, 100.0, slots, copies_share_compute=True).layers == n
    none = stream_budget(n, t_c, t_tr, 7.0, slots, copies_share_compute=True)
    assert (none.layers, none.feasible) == (0, False)  # compute alone misses it


def test_manager_and_demand_carry_the_shared_compute_rule():
    p = _profile()
    shared = IntervalManager(p, 14.0, 2, copies_share_compute=True)
    assert shared.decide(1).layers == 2  # 8 * 1 + m * 3 <= 14
    assert IntervalManager(p, 14.0, 2).decide(1).layers == 4  # max(8, m * 3) <= 14
    demand = demand_from_profile("cpu0", shared, 1)
    assert demand.iter_times[2] == 8 + 4 * 3 and demand.min_interval == 4
