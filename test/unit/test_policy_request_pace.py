"""The governor's per-request rule (``memory_ext.policy.request_pace``): each running request on time
keeps its predicted TPOT within the SLO with the newcomer; a burst's prefills share one iteration."""

from __future__ import annotations

import pytest

from memory_ext.policy.governor import BATCH, PER_REQUEST, BatchGovernor
from memory_ext.policy.request_pace import PrefillTimeModel, RunningPace, worst_tpot
from memory_ext.policy.step_time import StepTimeModel

SLO = 0.030


def _governor(slo=SLO, a=0.010, b=0.002, p0=0.020, p1=0.0001, stalls=0.0):
    """A governor whose decode step is ``a + b * batch``, whose prefill of ``t`` tokens takes
    ``p0 + p1 * t``, and whose steady-state prefill stalls are ``stalls`` s per decoded token."""
    model = StepTimeModel(min_samples=4, use_kv=False)
    for i in range(24):
        model.observe(1 + i % 6, 0, a + b * (1 + i % 6))
    g = BatchGovernor(slo, model)
    for t in (64, 128, 256, 512):
        g.prefill_time.observe(t, p0 + p1 * t)
    if stalls:
        g.prefill.observe(100, stalls * 100)
    return g


def test_a_pace_is_its_time_so_far_plus_the_stall_and_the_steps_left_per_token():
    pace = RunningPace(elapsed_s=0.5, decoded=20, remaining=30)
    assert pace.tpot(0.1, 0.01) == pytest.approx((0.5 + 0.1 + 30 * 0.01) / 50)
    assert RunningPace(0.0, 0, 10).tpot(0.05, 0.01) == pytest.approx(0.015)  # the first token just came
    assert RunningPace(0.3, 10, 0).tpot(1.0, 1.0) is None  # finishing: nothing more to wait for


@pytest.mark.parametrize(
    "paces,want",
    [
        ([], None),
        ([RunningPace(0.0, 0, 10)], (0.02 + 10 * 0.012) / 10),
        # the second is late without the newcomer (0.6 s for 10 tokens): not one it pushes past
        ([RunningPace(0.0, 0, 10), RunningPace(0.6, 10, 10)], (0.02 + 10 * 0.012) / 10),
        ([RunningPace(0.6, 10, 10)], None),
        ([RunningPace(0.2, 10, 10), RunningPace(0.0, 0, 10)], (0.2 + 0.02 + 10 * 0.012) / 20),
    ],
)
def test_the_worst_counts_only_requests_on_time_without_the_newcomer(paces, want):
    got = worst_tpot(paces, SLO, 0.0, 0.02, 0.010, 0.012)
    assert got == (None if want is None else pytest.approx(want))


def test_the_prefill_time_is_learned_by_tokens_and_unknown_until_then():
    m = PrefillTimeModel(min_samples=3)
    m.observe(100, 0.03)
    m.observe(300, 0.07)
    assert m.coef is None and m.predict(200) is None and m.predict(0) is None
    m.observe(500, 0.11)
    assert m.coef == pytest.approx((0.01, 0.0002)) and m.predict(200) == pytest.approx(0.05)
    assert m.predict(0) == 0.0  # no prefill, no stall


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("elapsed_s", {"elapsed_s": -1.0, "decoded": 0, "remaining": 1}),
        ("decoded", {"elapsed_s": 0.0, "decoded": -1, "remaining": 1}),
        ("remaining", {"elapsed_s": 0.0, "decoded": 0, "remaining": 1.5}),
    ],  # fmt: skip
)
def test_bad_paces_are_refused_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        RunningPace(**kwargs)


@pytest.mark.parametrize("field", ["pass_tokens", "add_tokens"])
def test_bad_prefill_tokens_are_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        _governor().decide(2, 0, 0, paces=[], **{field: -1})


def test_a_burst_is_admitted_where_the_steady_state_batch_rule_caps_it():
    """Five fresh requests (first token just now, 64 tokens to go): the batch rule charges each
    ``b * q`` of steady-state stalls (q = 4 ms/token: 5 * 4 + step 22 ms > 30 ms) and refuses; per
    request, one more 100-token prefill (30 ms) spread over 64 tokens and a step of 6 keep each at
    (0.030 + 64 * 0.022) / 64 ~ 22.5 ms: admitted."""
    g = _governor(stalls=0.004)
    fresh = [RunningPace(0.0, 0, 64)] * 5
    assert not g.decide(5, 0, 0).admit  # the batch rule (no paces)
    d = g.decide(5, 0, 0, paces=fresh, add_tokens=100)
    assert d.admit and d.rule == PER_REQUEST and d.predicted_s == pytest.approx((0.030 + 64 * 0.022) / 64)


def test_a_request_near_its_slo_is_not_pushed_past_it():
    """One running request has fallen behind (33 ms a token so far; its last 10 tokens at 14 ms
    bring it to 29.4 ms): one more 40 ms prefill pushes it past 30 ms, so the newcomer waits,
    though a fresh batch of the same size would take it."""
    g = _governor()
    near = RunningPace(elapsed_s=1.33, decoded=40, remaining=10)
    assert near.tpot(0.0, 0.014) <= SLO  # on time without the newcomer
    d = g.decide(2, 0, 0, paces=[RunningPace(0.0, 0, 64), near], add_tokens=200)
    assert not d.admit and d.reason == "over_slo" and d.rule == PER_REQUEST
    assert d.predicted_s == pytest.approx((1.33 + 0.040 + 10 * 0.016) / 50)
    assert g.decide(2, 0, 0, paces=[RunningPace(0.0, 0, 64)] * 2, add_tokens=200).admit


def test_prefills_of_one_pass_share_one_iteration():
    """The second prefill of a pass adds its tokens to the iteration (21 -> 22 ms), not another
    intercept: counted as an iteration of its own (21 + 21 ms) it would push the request past."""
    g = _governor()
    tight = RunningPace(elapsed_s=1.31, decoded=40, remaining=10)
    d = g.decide(2, 0, 0, paces=[tight], pass_tokens=10, add_tokens=10)
    assert d.admit and d.predicted_s == pytest.approx((1.31 + 0.022 + 10 * 0.016) / 50)
    assert (1.31 + 0.021 + 0.021 + 10 * 0.016) / 50 > SLO


def test_the_newcomers_own_step_bounds_the_batch():
    """With nobody on time to protect, the newcomer's decode step still has to fit the SLO."""
    g = _governor(slo=0.021)
    late = [RunningPace(1.0, 10, 10)] * 5
    assert g.decide(4, 0, 0, paces=late[:4], add_tokens=10).admit  # step of 5: 20 ms
    d = g.decide(5, 0, 0, paces=late, add_tokens=10)
    assert not d.admit and d.predicted_s == pytest.approx(0.022)


def test_without_paces_or_a_learned_prefill_time_the_batch_rule_decides():
    g = _governor(stalls=0.001)
    assert g.decide(3, 0, 0).rule == BATCH
    learning = BatchGovernor(SLO, g.model)
    d = learning.decide(3, 0, 0, paces=[RunningPace(0.0, 0, 10)] * 3, add_tokens=10)
    assert d.rule == BATCH and d.predicted_s == pytest.approx(learning.predict_tpot(4, 0))
    assert g.decide(0, 0, 0, paces=[], add_tokens=10).reason == "empty_batch"
    assert BatchGovernor(None, g.model).decide(3, 0, 0, paces=[], add_tokens=10).reason == "no_slo"


def test_the_status_shows_the_prefill_time_and_which_rule_decided():
    g = _governor()
    g.may_grow(1, 0, 0, paces=[RunningPace(0.0, 0, 64)], add_tokens=100)
    doc = g.status(1, 0, 0.012)
    assert doc["last_decision"]["rule"] == PER_REQUEST
    assert doc["prefill_time"] == {
        "samples": 4,
        "intercept_ms": pytest.approx(20.0),
        "per_1k_tokens_ms": pytest.approx(100.0),
    }
