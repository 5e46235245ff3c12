"""eLLM's admission under the governor in the simulator (kind ``governed_ellm``): where nothing binds
it is the stock scheduler ("do nothing"); where KV binds it overrides eLLM's refusals that protect
nobody and refuses admissions that would preempt a running request; nothing is dropped."""

from __future__ import annotations

import pytest

from benchmark.sim.core.batching import OptionError
from benchmark.sim.mechanisms.governed_ellm import GovernedEllmScheduler
from benchmark.sim.runner import run_spec
from benchmark.sim.scenario import parse_scenario


def _run(scheduler, rate, kv_gb=None):
    model = {"name": "m", "model": "Llama-3.1-8B", "scheduler": scheduler, "max_running": 2048,
             "slo": {"ttft_s": 2.0, "tpot_s": 0.1}}  # fmt: skip
    if kv_gb is not None:
        model["kv_memory_gb"] = kv_gb
    spec = {"name": "ge", "duration_s": 6, "drain_s": 120, "node": {"gpu": "H100-SXM"}, "models": [model],
            "workloads": [{"model": "m", "arrival": {"kind": "poisson", "rate": rate}}]}  # fmt: skip
    return run_spec(parse_scenario(spec, "<ge>"), seed=5).summary["instances"]["m"]


def _governor(inst):
    (st,) = [s for s in inst["mechanisms"] if s["mechanism"] == "governor"]
    return st["counters"]


def test_where_nothing_binds_it_is_the_stock_scheduler():
    """Do nothing: ample KV, a loose SLO -> the same iterations and latencies as ``continuous``."""
    stock, governed = _run({"kind": "continuous"}, 4), _run({"kind": "governed_ellm"}, 4)
    for key in ("finished", "iterations", "ttft_s", "tpot_s", "e2e_s", "preemptions"):
        assert governed[key] == stock[key], key
    c = _governor(governed)
    assert c["verdict_protects_running"] == c["verdict_over_slo"] == 0


def test_where_kv_binds_it_overrides_refusals_without_gain_and_keeps_running_requests():
    stock = _run({"kind": "continuous"}, 60, kv_gb=2.0)
    ellm = _run({"kind": "ellm_elastic"}, 60, kv_gb=2.0)
    governed = _run({"kind": "governed_ellm"}, 60, kv_gb=2.0)
    c = _governor(governed)
    assert stock["preemptions"] > 0 and governed["preemptions"] == 0  # exact output lengths: no harm slips by
    assert c["verdict_protects_running"] > 0 and c["verdict_no_predicted_gain"] > 0
    assert 0 < c["ellm_refusals_overridden"] <= c["verdict_no_predicted_gain"]  # stock may still refuse
    assert governed["slo"]["attainment"] > ellm["slo"]["attainment"]
    assert governed["finished"] == governed["requests"] and governed["unfinished"] == 0


def test_without_the_gate_ellms_refusals_stand():
    gated = _governor(_run({"kind": "governed_ellm"}, 60, kv_gb=2.0))
    ungated = _run({"kind": "governed_ellm", "options": {"gate": False}}, 60, kv_gb=2.0)
    assert _governor(ungated)["ellm_refusals_overridden"] == 0 < gated["ellm_refusals_overridden"]
    assert ungated["finished"] == ungated["requests"]


@pytest.mark.parametrize("opts,field", [({"gate": "yes"}, "gate"), ({"min_samples": 0}, "min_samples"),
                                        ({"use_kv": 1}, "use_kv")])  # fmt: skip
def test_bad_options_name_the_option(opts, field):
    from benchmark.sim.core.engine import InstanceConfig
    from benchmark.sim.core.models import model_spec

    cfg = InstanceConfig(name="m", model=model_spec("Llama-3.1-8B"), gpu=0, kv_blocks=100)
    with pytest.raises(OptionError) as err:
        GovernedEllmScheduler(cfg, **opts)
    assert err.value.option == field
