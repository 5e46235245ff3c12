"""The governor in the simulator (kind ``governed``): without an SLO it is the stock continuous
scheduler, a tight TPOT SLO caps the running batch, and nothing is ever dropped."""

from __future__ import annotations

import pytest

from benchmark.sim.core.batching import OptionError
from benchmark.sim.mechanisms.governor import GovernedScheduler
from benchmark.sim.runner import run_spec
from benchmark.sim.scenario import parse_scenario


def _run(kind, tpot_s=None, rate=16, duration_s=4, lengths=None):
    model = {"name": "g", "model": "Llama-3.1-8B", "scheduler": {"kind": kind}}
    if tpot_s is not None:
        model["slo"] = {"tpot_s": tpot_s}
    workload = {"model": "g", "arrival": {"kind": "poisson", "rate": rate}}
    if lengths is not None:  # fixed (input, output) tokens
        workload |= {"input": {"kind": "fixed", "value": lengths[0]}, "output": {"kind": "fixed", "value": lengths[1]}}
    spec = {"name": "gov", "duration_s": duration_s, "drain_s": 120, "node": {"gpu": "H100-SXM"}, "models": [model],
            "workloads": [workload]}  # fmt: skip
    return run_spec(parse_scenario(spec, "<gov>"), seed=3).summary["instances"]["g"]


def test_without_an_slo_it_is_the_stock_scheduler():
    stock, governed = _run("continuous"), _run("governed")
    for key in ("finished", "iterations", "ttft_s", "tpot_s", "e2e_s"):
        assert governed[key] == stock[key], key
    counters = governed["mechanisms"][0]["counters"]
    assert counters["decisions_no_slo"] == governed["requests"] and counters["decisions_over_slo"] == 0


def test_a_tight_tpot_slo_caps_the_batch_and_drops_nothing():
    loose, tight = _run("governed", 1.0), _run("governed", 0.0062)
    lg, tg = loose["mechanisms"][0], tight["mechanisms"][0]
    assert lg["counters"]["decisions_over_slo"] == 0 and tg["counters"]["decisions_over_slo"] > 0
    assert tg["gauges"]["max_running"] < lg["gauges"]["max_running"]
    assert tight["tpot_s"]["p90"] <= 0.0062 * 1.02 < loose["tpot_s"]["p90"]
    assert tight["finished"] == tight["requests"] == loose["finished"] and tight["unfinished"] == 0


def test_long_prompts_their_prefill_stalls_count_in_the_cap():
    """4,000-token prompts: the decode step alone stays under 12 ms at every batch this load reaches,
    but the running requests wait through the newcomers' prefills (mixed iterations), so stock's
    TPOT p90 is over it; the governor counts those stalls and keeps the p90 within the SLO."""
    lengths = (4000, 128)
    stock, tight = _run("continuous", None, 4, 20, lengths), _run("governed", 0.012, 4, 20, lengths)
    counters = tight["mechanisms"][0]["counters"]
    assert stock["tpot_s"]["p90"] > 0.012 * 1.05
    assert counters["decisions_over_slo"] > 0 and counters["decisions_slo_infeasible"] == 0
    assert tight["tpot_s"]["p90"] <= 0.012
    assert tight["finished"] == tight["requests"] == stock["finished"] and tight["unfinished"] == 0


@pytest.mark.parametrize("opts,field", [({"min_samples": 0}, "min_samples"), ({"decay": 2}, "decay"),
                                        ({"use_kv": "yes"}, "use_kv")])  # fmt: skip
def test_bad_options_name_the_option(opts, field):
    with pytest.raises(OptionError) as err:
        GovernedScheduler(None, **opts)
    assert err.value.option == field
