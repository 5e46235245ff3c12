"""The governor's default TPOT SLO (``memory_ext.policy.default_slo``): scale x the solo decode
step measured at start, held while no SLO is given; its flag (``--memx-tpot-slo-scale``) and
where the server shows it (``/memx/status``, ``/memx/metrics``, ``top``)."""

from __future__ import annotations

import argparse
import math

import pytest

from memory_ext.policy.default_slo import DEFAULT_SCALE, SoloStepDefault, check_scale
from memory_ext.policy.governor import OVER_SLO, SLO_DEFAULT, SLO_GIVEN, BatchGovernor, StepTimeModel
from sglang_memx.config import MemxConfig, MemxConfigError, add_memx_arguments
from sglang_memx.coordinator.governor import GovernorPart
from sglang_memx.coordinator.parts import Iteration
from support.fakes import FakeReq, FakeScheduler
from support.pool_build_stub import governor_parts


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    return MemxConfig.from_namespace(parser.parse_args(argv))


@pytest.mark.parametrize(
    "steps,solo_ms,slo_ms,completed_at",
    [
        # (batch, seconds) in order; the first cold step is outvoted by the median
        ([(1, 0.050), (1, 0.010), (1, 0.011), (1, 0.009), (1, 0.010)], 10.0, 200.0, 4),
        # steps of a larger batch are not solo steps; later solo steps do not move it
        ([(3, 0.030), (1, 0.010), (2, 0.5), (1, 0.012), (1, 0.010), (1, 0.008), (1, 0.010), (1, 0.9)], 10.0, 200.0, 6),
        ([(1, 0.010)] * 4, None, None, None),  # four of five: still measuring (no default)
        ([(2, 0.010)] * 9, None, None, None),  # never alone: no default
    ],
)  # fmt: skip
def test_the_default_is_scale_times_the_median_of_the_first_solo_steps(steps, solo_ms, slo_ms, completed_at):
    d = SoloStepDefault()
    done = [i for i, (batch, s) in enumerate(steps) if d.observe(batch, s)]
    assert done == ([] if completed_at is None else [completed_at])
    assert (d.solo_step_s is None) == (solo_ms is None) and (d.slo_s is None) == (slo_ms is None)
    if solo_ms is not None:
        assert (d.solo_step_s * 1e3, d.slo_s * 1e3) == pytest.approx((solo_ms, slo_ms))
    assert d.status()["tpot_slo_ms"] == (None if slo_ms is None else pytest.approx(slo_ms))
    assert d.status()["solo_samples"] == min(5, sum(1 for b, _ in steps if b == 1))


def test_scale_zero_is_no_default():
    d = SoloStepDefault(0)
    assert not any(d.observe(1, 0.01) for _ in range(9))
    assert (d.enabled, d.slo_s, d.status()["solo_samples"]) == (False, None, 0)


@pytest.mark.parametrize("bad", [1, 0.5, -2, math.nan, math.inf, True, "20"])
def test_a_bad_scale_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="^scale must"):
        SoloStepDefault(bad)
    with pytest.raises(ValueError, match="^samples must"):
        SoloStepDefault(samples=0)
    assert check_scale("x", 0) == 0.0 and check_scale("x", 1.5) == 1.5


@pytest.mark.parametrize("a,b,scale", [(0.010, 0.0002, 20), (0.002, 0.004, 20), (0.05, 0.0001, 10), (0.001, 0.001, 3)])
def test_the_capped_batch_keeps_1_minus_1_over_scale_of_the_best_throughput(a, b, scale):
    """The docstring's bound: with step(n) = a + b n, at the cap (the largest batch whose predicted
    step is within scale x the solo step a + b) n / step(n) >= (1 - 1/scale) / b, up to rounding
    the cap down to a whole request (the factor n / (n + 1))."""
    model = StepTimeModel(min_samples=4, use_kv=False)
    gov = BatchGovernor(None, model, default=SoloStepDefault(scale))
    for i in range(40):
        n = 1 + i % 9
        gov.observe(n, 0, a + b * n)
    assert gov.slo_origin == SLO_DEFAULT and gov.tpot_slo_s == pytest.approx(scale * (a + b))
    cap = gov.status(0, 0, None)["batch_cap"]
    assert cap is not None and a + b * cap <= gov.tpot_slo_s * (1 + 1e-9) < a + b * (cap + 1)
    assert cap / (a + b * cap) >= (1 - 1 / scale) / b * cap / (cap + 1)


def test_the_governor_holds_the_default_only_while_no_slo_is_given():
    model = StepTimeModel(min_samples=4, use_kv=False)
    gov = BatchGovernor(None, model, default=SoloStepDefault())
    for _ in range(4):  # four solo steps: the model has learned, the default not yet
        gov.observe(1, 0, 0.010)
    assert gov.tpot_slo_s is None and gov.slo_origin is None and gov.may_grow(8, 0, 0).reason == "no_slo"
    gov.observe(1, 0, 0.010)  # the fifth: 20 x 10 ms
    for n in range(2, 30):
        gov.observe(n, 0, 0.008 + 0.002 * n)
    assert (gov.tpot_slo_s, gov.slo_origin) == (pytest.approx(0.2), SLO_DEFAULT)
    assert gov.may_grow(200, 0, 0).reason == OVER_SLO and gov.may_grow(10, 0, 0).admit
    doc = gov.status(0, 0, None)
    assert (doc["tpot_slo_ms"], doc["slo_origin"], doc["default_slo"]["solo_step_ms"]) == (200.0, "default", 10.0)
    gov.set_tpot_slo(0.05)  # given (POST /memx/slo): it wins
    assert (gov.tpot_slo_s, gov.slo_origin) == (0.05, SLO_GIVEN)
    gov.set_tpot_slo(None)  # cleared: the default again
    assert (gov.tpot_slo_s, gov.slo_origin) == (pytest.approx(0.2), SLO_DEFAULT)
    plain = BatchGovernor(None)  # no default object: stock behaviour, as before
    assert plain.status(0, 0, None)["default_slo"] is None and plain.may_grow(8, 0, 0).reason == "no_slo"


def test_the_status_names_the_default_as_the_slos_source_and_metrics_and_top_show_it():
    from sglang_memx.metrics import render_prometheus
    from sglang_memx.top import _governor_line

    part = GovernorPart(BatchGovernor(None, StepTimeModel(min_samples=4, use_kv=False), default=SoloStepDefault()))
    assert part.status()["governor"]["slos"]["tpot"] is None
    for s in (0.004, 0.002, 0.002, 0.003, 0.002):
        part.observe(1, 10, s)
    tpot = part.status()["governor"]["slos"]["tpot"]
    want = "default: 20 x the solo decode step measured at start (2 ms; --memx-tpot-slo-scale)"
    assert tpot == {"ms": 40.0, "source": want}
    gov = part.status()["governor"]
    elastic = dict.fromkeys(("mapped_bytes", "logical_bytes", "groups_mapped", "pool_capacity_bytes",
                             "groups_mapped_total", "groups_unmapped_total", "grow_refused", "map_seconds",
                             "unmap_seconds", "max_map_seconds", "max_unmap_seconds", "chunk_bytes"), 0)  # fmt: skip
    text = render_prometheus({"schedulers": [{"dp_rank": 0, "elastic_kv": dict(elastic, governor=gov)}]})
    assert f'memx_governor_tpot_slo_seconds{{dp_rank="0",source="{want}"}} 0.04' in text
    assert f"TPOT 40.0 ms ({want})" in _governor_line(gov)


@pytest.mark.parametrize("argv,scale", [(["--memx-governor"], DEFAULT_SCALE),
                                        (["--memx-governor", "--memx-tpot-slo-scale", "8"], 8.0),
                                        (["--memx-governor", "--memx-tpot-slo-scale", "0"], 0.0)])  # fmt: skip
def test_the_pool_build_gives_the_governor_the_flags_scale(monkeypatch, argv, scale):
    (part,) = governor_parts(monkeypatch, _parse(["--memx-elastic-kv", *argv]))
    assert part.governor.default.scale == scale and part.governor.tpot_slo_s is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--memx-governor", "--memx-tpot-slo-scale", "1"], "must be > 1 (or 0: no default SLO), got 1.0"),
        (["--memx-governor", "--memx-tpot-slo-scale=-3"], "must be >= 0.0, got -3.0"),
        (["--memx-governor", "--memx-tpot-slo-scale", "nan"], "must be finite, got nan"),
        (["--memx-tpot-slo-ms", "50", "--memx-tpot-slo-scale", "10"], "contradicts --memx-tpot-slo-ms"),
        (["--memx-tpot-slo-scale", "10"], "needs --memx-governor"),
    ],
)  # fmt: skip
def test_a_bad_scale_flag_is_refused_naming_it(argv, message):
    with pytest.raises(MemxConfigError) as err:
        _parse(["--memx-elastic-kv", *argv])
    assert err.value.flag == "--memx-tpot-slo-scale" and message in str(err.value)


def test_at_tensor_parallel_every_rank_derives_the_default_from_rank0s_clock():
    """The solo steps are the ones the governor measures, so at --tp > 1 rank 0's (``tick_time``):
    every rank holds the same default, whatever its own clock reads (here 40 ms a tick, rank 0's 25)."""
    own = iter(x * 0.040 for x in range(100))
    rank0 = iter([500.0, 500.025, 500.050, 500.075])
    part = GovernorPart(BatchGovernor(None, default=SoloStepDefault(samples=3)), clock=lambda: next(own),
                        tick_time=lambda: next(rank0))  # fmt: skip
    running = [FakeReq(prompt=10, outputs=2)]  # one request decoding alone
    for _ in range(4):
        (step,) = part.steps()
        step.run(Iteration(FakeScheduler(running=running), None, None, None, None))
    assert part.governor.default.solo_step_s == pytest.approx(0.025)
    assert part.governor.tpot_slo_s == pytest.approx(20 * 0.025) and part.governor.slo_origin == "default"
