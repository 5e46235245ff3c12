"""The governor in the simulator (kind ``governed``): without an SLO it is the stock continuous
scheduler, a tight TPOT SLO caps the running batch, and nothing is ever dropped."""

from __future__ import annotations

import pytest

from benchmark.sim.core.batching import OptionError
from benchmark.sim.mechanisms.governor import GovernedScheduler
from benchmark.sim.runner import run_spec
from benchmark.sim.scenario import parse_scenario


def _run(kind, tpot_s=None):
    model = {"name": "g", "model": "Llama-3.1-8B", "scheduler": {"kind": kind}}
    if tpot_s is not None:
        model["slo"] = {"tpot_s": tpot_s}
    spec = {"name": "gov", "duration_s": 4, "drain_s": 60, "node": {"gpu": "H100-SXM"}, "models": [model],
            "workloads": [{"model": "g", "arrival": {"kind": "poisson", "rate": 16}}]}  # fmt: skip
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


@pytest.mark.parametrize("opts,field", [({"min_samples": 0}, "min_samples"), ({"decay": 2}, "decay"),
                                        ({"use_kv": "yes"}, "use_kv")])  # fmt: skip
def test_bad_options_name_the_option(opts, field):
    with pytest.raises(OptionError) as err:
        GovernedScheduler(None, **opts)
    assert err.value.option == field
