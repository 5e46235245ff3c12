"""The governor's batch decision (``memory_ext.policy.governor``): the step-time model and the
"may the running batch grow by this request?" table, "do nothing" cases included."""

from __future__ import annotations

import math

import pytest

from memory_ext.policy.governor import (
    ADMIT_REASONS,
    CAP_REASONS,
    REASONS,
    BatchGovernor,
    StepTimeModel,
    check_tpot_slo,
)


def _trained(a=0.010, b=0.002, c=0.0, n=40, use_kv=True, min_samples=8):
    """A model fed ``n`` exact samples of t = a + b*batch + c*kv over varied batches."""
    m = StepTimeModel(min_samples=min_samples, use_kv=use_kv)
    for i in range(n):
        batch = 1 + i % 7
        kv = 100 * batch + 37 * (i % 5)
        m.observe(batch, kv, a + b * batch + c * kv)
    return m


def test_model_learns_an_exact_linear_step_time():
    m = _trained(a=0.010, b=0.002, c=1e-6)
    assert m.predict(10, 2000) == pytest.approx(0.010 + 0.020 + 0.002, rel=1e-3)
    a, b, c = m.coef
    assert (a, b, c) == pytest.approx((0.010, 0.002, 1e-6), rel=1e-2, abs=1e-7)


def test_model_solves_its_fit_when_read_not_at_every_sample(monkeypatch):
    """The fit is solved once per read after new samples (a decode step is observed every
    iteration, a prediction asked only when a request waits), and reads see every sample."""
    m, fits = _trained(n=40), []
    solve = StepTimeModel._fit
    monkeypatch.setattr(StepTimeModel, "_fit", lambda self: fits.append(1) or solve(self))
    for i in range(30):
        m.observe(1 + i % 3, 100, 0.5)  # the step got much slower
    assert fits == []
    first = m.predict(2, 100)
    assert m.predict(2, 100) == first and m.coef is not None and len(fits) == 1
    assert first > 0.1  # the new samples are in the fit that was read
    m.observe(1, 100, 0.5)
    m.predict(1, 100)
    assert len(fits) == 2


def test_model_predicts_nothing_before_enough_samples():
    m = StepTimeModel(min_samples=5)
    for i in range(4):
        m.observe(1 + i, 100, 0.01)
    assert m.predict(3, 300) is None and m.cap(0.05, 100) is None
    m.observe(2, 100, 0.01)
    assert m.predict(3, 300) is not None


def test_one_batch_size_only_is_a_fixed_cost():
    m = StepTimeModel(min_samples=3)
    for _ in range(10):
        m.observe(4, 400, 0.02)
    assert m.predict(4, 400) == pytest.approx(0.02, rel=1e-3)
    assert m.predict(8, 800) == pytest.approx(0.02, rel=0.05)  # slopes stay near 0 until the batch varies


def test_negative_slope_is_dropped_growth_never_looks_free():
    m = StepTimeModel(min_samples=3, use_kv=False)
    for batch, t in ((1, 0.030), (2, 0.029), (3, 0.028), (4, 0.027)):
        m.observe(batch, 0, t)
    assert m.coef[1] == 0.0
    assert m.predict(10, 0) >= m.predict(1, 0) - 1e-12


def test_old_samples_fade():
    m = StepTimeModel(min_samples=2, decay=0.5, use_kv=False)
    for batch in (1, 2, 3) * 5:
        m.observe(batch, 0, 0.1 * batch)  # slow phase
    for batch in (1, 2, 3) * 10:
        m.observe(batch, 0, 0.01 * batch)  # the machine got faster
    assert m.predict(2, 0) == pytest.approx(0.02, rel=0.05)


def test_cap_is_the_largest_batch_within_the_slo():
    m = _trained(a=0.010, b=0.002, use_kv=False)
    assert m.cap(0.020, 0) == 5  # 10 + 2*5 = 20 ms exactly: within
    assert m.cap(0.011, 0) == 1  # even one request is over: the cap never goes below 1


# (slo_s, running, kv_tokens, add_kv, trained?) -> (admit, reason)
DECISIONS = [
    (None, 50, 5000, 100, True, True, "no_slo"),  # no SLO: stock behaviour, never caps
    (None, 0, 0, 100, False, True, "no_slo"),
    (0.001, 0, 0, 100, True, True, "empty_batch"),  # nothing starves, even under an impossible SLO
    (0.050, 0, 0, 100, False, True, "empty_batch"),
    (0.050, 3, 300, 100, False, True, "learning"),  # not enough samples: admit as stock would
    (0.020, 4, 400, 100, True, True, "within_slo"),  # predicted 10 + 2*5 = 20 ms: exactly at the SLO admits
    (0.020, 5, 500, 100, True, False, "over_slo"),  # predicted 22 ms > 20 ms
    (0.050, 10, 1000, 100, True, True, "within_slo"),
    (0.011, 3, 300, 100, True, True, "slo_infeasible"),  # one alone is 12 ms > 11 ms: a cap gains nothing
    (0.0121, 3, 300, 100, True, False, "over_slo"),  # one alone (12 ms) meets it: a smaller batch would
]


@pytest.mark.parametrize("slo,running,kv,add,trained,admit,reason", DECISIONS)
def test_batch_decisions(slo, running, kv, add, trained, admit, reason):
    gov = BatchGovernor(slo, _trained(a=0.010, b=0.002, use_kv=False) if trained else StepTimeModel())
    d = gov.may_grow(running, kv, add)
    assert (d.admit, d.reason) == (admit, reason)
    assert d.slo_s == slo and d.running == running
    if trained:
        assert d.predicted_s == pytest.approx(0.010 + 0.002 * (running + 1), rel=1e-6)
    else:
        assert d.predicted_s is None
    assert gov.counts[reason] == 1 and sum(gov.counts.values()) == 1
    assert (reason in ADMIT_REASONS) == admit


def test_every_reason_is_exercised_by_the_table():
    assert {row[-1] for row in DECISIONS} == set(REASONS)


def test_decide_does_not_count_may_grow_does():
    gov = BatchGovernor(0.02, _trained(use_kv=False))
    gov.decide(5, 0, 0)
    assert sum(gov.counts.values()) == 0 and gov.last is None
    gov.may_grow(5, 0, 0)
    assert gov.counts["over_slo"] == 1 and gov.last.reason == "over_slo"


def test_infeasible_is_judged_on_the_lighter_request():
    gov = BatchGovernor(0.015, _trained(a=0.010, b=0.001, c=2e-6))  # alone: 11 ms + 2 us per KV token
    assert gov.decide(2, 1000, 4000).reason == "over_slo"  # the newcomer alone is over, the running ones are not
    assert gov.decide(2, 8000, 100).reason == "over_slo"  # the running ones alone are over, the newcomer is not
    assert gov.decide(2, 8000, 4000).reason == "slo_infeasible"  # neither meets the SLO alone: admit as stock


def test_kv_tokens_of_the_request_count():
    gov = BatchGovernor(0.020, _trained(a=0.010, b=0.001, c=2e-6))
    assert gov.decide(4, 1000, 100).admit  # 10 + 5 + 2.2 = 17.2 ms
    assert not gov.decide(4, 1000, 2000).admit  # 10 + 5 + 6 = 21 ms


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "50", True])
def test_bad_slo_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="^tpot_slo_s"):
        BatchGovernor(bad)
    with pytest.raises(ValueError, match="^my_field"):
        check_tpot_slo("my_field", bad)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"decay": 0}, "decay"), ({"decay": 1.5}, "decay"), ({"min_samples": 0}, "min_samples")],
)
def test_bad_model_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        StepTimeModel(**kwargs)


@pytest.mark.parametrize(
    "args,field",
    [((0, 10, 0.01), "batch"), ((1, -1, 0.01), "kv_tokens"), ((1, 0, -0.1), "step_s"), ((1, 0, math.nan), "step_s")],
)
def test_bad_samples_name_the_field(args, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        StepTimeModel().observe(*args)


def test_status_shows_slo_cap_reason_and_counts():
    gov = BatchGovernor(0.020, _trained(a=0.010, b=0.002, use_kv=False))
    gov.may_grow(5, 0, 0)
    doc = gov.status(running=3, kv_tokens=300, measured_s=0.0165)
    assert doc["tpot_slo_ms"] == 20 and doc["batch_cap"] == 5 and doc["batch_cap_reason"] == "predicted_tpot_within_slo"
    assert doc["predicted_tpot_ms"] == pytest.approx(16.0) and doc["measured_tpot_ms"] == 16.5
    assert doc["decisions"]["over_slo"] == 1 and doc["last_decision"]["reason"] == "over_slo"
    assert BatchGovernor(None).status(0, 0, None)["batch_cap_reason"] == "no_slo"
    assert BatchGovernor(0.02).status(2, 0, None)["batch_cap_reason"] == "learning"


# the status' batch cap and why: (slo_s, trained?, running, kv_tokens) -> (cap, reason, predicted ms)
# (model: 10 ms + 2 ms per request; kv not in the fit)
CAPS = [
    (None, True, 3, 300, None, "no_slo", 16.0),  # no SLO: no cap, whatever the model knows (do nothing)
    (None, False, 0, 0, None, "no_slo", None),
    (0.050, False, 3, 300, None, "learning", None),  # too few samples: no cap yet, admits as stock
    (0.020, True, 3, 300, 5, "predicted_tpot_within_slo", 16.0),  # 10 + 2*5 = 20 ms: 5 fits exactly
    (0.0121, True, 1, 100, 1, "predicted_tpot_within_slo", 12.0),  # one alone (12 ms) meets it: cap 1
    (0.011, True, 1, 100, None, "slo_infeasible", 12.0),  # even one is over: no cap (it would gain nothing)
    (0.050, True, 0, 0, 20, "predicted_tpot_within_slo", 12.0),  # idle: the prediction is for one request
]


@pytest.mark.parametrize("ms", [63.644, 0.01, 45.6, 1000.0, 3.727216516])
def test_status_reports_the_slo_in_ms_as_set(ms):
    """The SLO is held in seconds; the status gives back the milliseconds set (to 1e-9 ms), not
    63.64399999999999."""
    assert BatchGovernor(ms / 1e3).status(running=0, kv_tokens=0, measured_s=None)["tpot_slo_ms"] == ms


@pytest.mark.parametrize("slo,trained,running,kv,cap,why,predicted_ms", CAPS)
def test_status_cap_and_why(slo, trained, running, kv, cap, why, predicted_ms):
    gov = BatchGovernor(slo, _trained(a=0.010, b=0.002, use_kv=False) if trained else StepTimeModel())
    doc = gov.status(running=running, kv_tokens=kv, measured_s=None)
    assert (doc["batch_cap"], doc["batch_cap_reason"]) == (cap, why)
    assert doc["tpot_slo_ms"] == (None if slo is None else pytest.approx(slo * 1e3))
    assert doc["predicted_tpot_ms"] == (None if predicted_ms is None else pytest.approx(predicted_ms))
    assert doc["measured_tpot_ms"] is None and doc["running"] == running
    assert sum(doc["decisions"].values()) == 0 and doc["last_decision"] is None  # status decides nothing


def test_every_cap_reason_is_exercised_by_the_table():
    assert {row[5] for row in CAPS} == set(CAP_REASONS)


def _taught_governor(slo_s, a=0.010, b=0.001, c=1e-5, n=60):
    """A governor taught through ``observe`` (as the server feeds it): exact steps of
    t = a + b*batch + c*kv, requests holding 400, 500 or 600 KV tokens (mean 500)."""
    gov = BatchGovernor(slo_s)
    for i in range(n):
        batch = 1 + i % 7
        kv = (400 + 100 * (i % 3)) * batch
        gov.observe(batch, kv, a + b * batch + c * kv)
    return gov


def test_idle_cap_counts_the_kv_of_recent_requests():
    # 10 ms + (1 ms + ~500 KV * 0.01 ms = ~6 ms) per request: 40 ms fits 5 requests, whatever runs now
    gov = _taught_governor(0.040)
    recent = gov.recent_kv_per_request
    assert 400 < recent < 600
    idle = gov.status(running=0, kv_tokens=0, measured_s=None)
    busy = gov.status(running=2, kv_tokens=round(2 * recent), measured_s=None)
    assert idle["batch_cap"] == busy["batch_cap"] == gov.model.cap(0.040, recent) == 5
    assert gov.model.cap(0.040, 0.0) >= 29  # what the idle cap was before it counted the KV (30 but the ridge)
    assert idle["kv_tokens_per_request"] == round(recent, 1)
    assert idle["predicted_tpot_ms"] == pytest.approx(gov.predict_tpot(1, round(recent)) * 1e3)
    # while requests run, their own KV decides: twice the KV, a smaller cap
    assert gov.status(running=2, kv_tokens=2000, measured_s=None)["batch_cap"] == 2


def test_status_curve_is_the_prediction_by_batch_and_reaches_past_the_cap():
    gov = _taught_governor(0.040)
    doc = gov.status(running=0, kv_tokens=0, measured_s=None)
    curve, per = doc["predicted_tpot_ms_by_batch"], gov.recent_kv_per_request
    assert list(curve) == ["1", "2", "4", "8"]  # the first power of two past the cap (5) and 8
    for n, ms in curve.items():
        assert ms == pytest.approx(gov.predict_tpot(int(n), round(int(n) * per)) * 1e3, abs=1e-3)
    assert curve["4"] <= 40.0 < curve["8"]
    loose = _taught_governor(1.0).status(running=3, kv_tokens=1500, measured_s=None)
    assert loose["batch_cap"] == 165 and list(loose["predicted_tpot_ms_by_batch"])[-1] == "256"
    assert BatchGovernor(0.040).status(0, 0, None)["predicted_tpot_ms_by_batch"] == {}  # learning: no curve
