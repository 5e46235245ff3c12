"""The prefills a running request waits through (``memory_ext.policy.prefill_stalls``) and how
the governor counts them in the TPOT it predicts: a batch of ``b`` sees ``step(b) + b * q``."""

from __future__ import annotations

import math

import pytest

from memory_ext.policy.governor import BatchGovernor, StepTimeModel
from memory_ext.policy.prefill_stalls import PrefillStalls

# (seconds, decoded, stalled, prefilled, predicted decode step) -> (tokens, stalled seconds) counted
ITERATIONS = [
    ((0.010, 4, 0, False, None), (4, 0.0)),  # a pure decode step: tokens, no stall
    ((0.030, 0, 4, True, None), (0, 0.030)),  # a prefill the 4 running requests waited through
    ((0.030, 0, 0, True, None), None),  # a prefill with nobody running stalls nobody: not counted
    ((0.020, 4, 0, True, 0.012), (4, 0.008)),  # mixed: the part beyond the predicted decode step
    ((0.010, 4, 0, True, 0.012), (4, 0.0)),  # mixed, faster than predicted: no stall, never negative
    ((0.020, 4, 0, True, None), (4, 0.0)),  # mixed before the step is known: no stall counted
    ((0.0, 0, 0, False, None), None),  # nothing ran (do nothing)
]


@pytest.mark.parametrize("args,counted", ITERATIONS)
def test_each_iteration_is_classified(args, counted):
    s = PrefillStalls(decay=1.0)
    s.observe_iteration(*args)
    if counted is None:
        assert (s.iterations, s.tokens, s.stalled_s) == (0, 0.0, 0.0)
    else:
        assert s.iterations == 1 and (s.tokens, s.stalled_s) == (counted[0], pytest.approx(counted[1]))


def test_per_token_is_stalled_seconds_over_tokens_and_fades():
    s = PrefillStalls(decay=1.0)
    assert s.per_token() == 0.0  # nothing measured: no stall assumed
    for _ in range(9):
        s.observe(10, 0.0)
    s.observe(0, 0.045)  # one 45 ms prefill per 90 tokens decoded
    assert s.per_token() == pytest.approx(0.0005) and s.stalls == 1
    assert s.status() == {"ms_per_token": 0.5, "iterations": 10, "stalls": 1}
    fading = PrefillStalls(decay=0.5)
    fading.observe(0, 1.0)
    for _ in range(30):
        fading.observe(10, 0.0)
    assert fading.per_token() < 1e-9  # an old stall no longer counts


@pytest.mark.parametrize(
    "call,field",
    [(lambda s: s.observe(-1, 0.0), "tokens"), (lambda s: s.observe(1, math.nan), "stalled_s"),
     (lambda s: s.observe_iteration(-0.1, 1, 0, False, None), "seconds"),
     (lambda s: s.observe_iteration(0.1, 1, -2, True, None), "stalled"),
     (lambda s: PrefillStalls(decay=0), "decay"), (lambda s: PrefillStalls(decay=1.5), "decay")],
)  # fmt: skip
def test_bad_numbers_name_the_field(call, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        call(PrefillStalls())


def _governor(slo, q_stall_s=0.0):
    """10 ms + 2 ms per request decode steps; then, if given, one prefill of ``q_stall_s`` that a batch of
    4 waited through, after 10 steps of 4 (so q = q_stall_s / 40 tokens, before decay)."""
    model = StepTimeModel(min_samples=4, use_kv=False, decay=1.0)
    gov = BatchGovernor(slo, model)
    for i in range(10):
        gov.observe(4, 0, 0.018)
        gov.observe(1 + i % 6, 0, 0.010 + 0.002 * (1 + i % 6))
    if q_stall_s:
        gov.observe_iteration(q_stall_s, 0, 0, 4, prefilled=True)
    return gov


def test_the_predicted_tpot_adds_each_requests_share_of_the_stalls():
    plain, stalled = _governor(0.030), _governor(0.030, q_stall_s=0.1)
    q = stalled.prefill.per_token()
    assert q == pytest.approx(0.1 / (10 * 4 + sum(1 + i % 6 for i in range(10))))
    for b in (1, 5, 9):
        assert plain.predict_tpot(b, 0) == pytest.approx(0.010 + 0.002 * b)
        assert stalled.predict_tpot(b, 0) == pytest.approx(0.010 + 0.002 * b + b * q)


def test_stalls_lower_the_cap_and_can_refuse_what_the_step_alone_admits():
    plain, stalled = _governor(0.030), _governor(0.030, q_stall_s=0.1)
    assert plain.status(4, 0, None)["batch_cap"] == 10  # 10 + 2 * 10 = 30 ms
    q = stalled.prefill.per_token()
    cap = stalled.status(4, 0, None)["batch_cap"]
    assert cap == math.floor(0.020 / (0.002 + q) + 1e-9) < 10
    assert 0.010 + 0.002 * cap + cap * q <= 0.030 < 0.010 + 0.002 * (cap + 1) + (cap + 1) * q
    assert plain.may_grow(cap, 0, 0).reason == "within_slo"  # the decode step alone would admit it
    d = stalled.may_grow(cap, 0, 0)
    assert (d.admit, d.reason) == (False, "over_slo")
    assert d.predicted_s == pytest.approx(stalled.predict_tpot(cap + 1, 0))
    doc = stalled.status(4, 0, 0.018)
    stalls = doc["prefill_stalls"]
    assert stalls["stalls"] == 1 and stalls["ms_per_token"] == pytest.approx(q * 1e3, abs=1e-4)
    assert doc["measured_decode_step_ms"] == 18.0
    assert doc["measured_tpot_ms"] == pytest.approx(18.0 + 4 * q * 1e3, abs=1e-4)


def test_without_prefill_iterations_nothing_changes():
    """Do nothing: a server whose running requests never wait through a prefill decides as before."""
    gov = _governor(0.020)
    assert gov.prefill.per_token() == 0.0 and gov.status(3, 0, 0.0165)["measured_tpot_ms"] == 16.5
    assert [gov.decide(n, 0, 0).reason for n in (0, 3, 4, 5)] == ["empty_batch", "within_slo", "within_slo", "over_slo"]


def test_one_request_alone_sees_one_share_of_the_stalls():
    """Infeasible is judged on a batch of one: its own share of the stalls, not the full batch's."""
    gov = _governor(0.0125, q_stall_s=0.1)  # one alone: 12 ms + q, q ~ 1.4 ms: over 12.5 ms
    q = gov.prefill.per_token()
    assert 0.012 + q > 0.0125
    assert gov.decide(3, 0, 0).reason == "slo_infeasible"
    assert _governor(0.0125).decide(3, 0, 0).reason == "over_slo"
