"""vLLM v0 default scheduling in the simulator (scheduler kind ``vllm_v0``,
benchmark/sim/core/batching.py): prefill-only iterations, recomputation that
stalls every running decode, option validation, the Oneiros scenarios."""

import copy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.core.batching import OptionError, VllmV0Scheduler  # noqa: E402
from benchmark.sim.core.request import FINISHED  # noqa: E402
from benchmark.sim.runner import build_simulation  # noqa: E402
from benchmark.sim.scenario import ScenarioError, load_scenario, parse_scenario  # noqa: E402

# one model with a small static KV (~1.4K tokens) under a load that overflows it
BASE = {
    "name": "t",
    "duration_s": 20,
    "drain_s": 600,
    "seed": 3,
    "node": {"gpu": "H100-SXM"},
    "models": [
        {
            "name": "m",
            "model": "Llama-3.1-8B",
            "kv_memory_gb": 0.18,
            "prefix_caching": False,
            "scheduler": {"kind": "vllm_v0"},
        }
    ],
    "workloads": [
        {
            "model": "m",
            "arrival": {"kind": "poisson", "rate": 5.0},
            "input": {"kind": "lognormal", "mean": 120, "sigma": 0.8, "min": 8, "max": 400},
            "output": {"kind": "lognormal", "mean": 200, "sigma": 0.6, "min": 8, "max": 400},
        }
    ],
}


def _spec(scheduler=None):
    d = copy.deepcopy(BASE)
    if scheduler is not None:
        d["models"][0]["scheduler"] = scheduler
    return parse_scenario(d, "<test>")


class _Recorder:
    """Hook recording, per iteration, what the plan holds and which running
    requests were decoding but left out of it; checks preempted requests hold
    no KV."""

    def __init__(self):
        self.rows = []

    def before_iteration(self, inst, plan, now):
        in_plan = {id(r) for r in plan.decodes}
        stalled = [r for r in inst.running if r.decoding and id(r) not in in_plan]
        recompute = [r for r, _ in plan.prefills if r.generated > 0]  # prompt + tokens already generated
        self.rows.append(
            {
                "decodes": len(plan.decodes),
                "prefills": len(plan.prefills),
                "recompute": len(recompute),
                "stalled": [(r, r.last_token_t) for r in stalled],
                "start": now,
            }
        )
        for r in inst.waiting:
            if r.preemptions:
                assert r.private_blocks == 0 and not r.cached_keys and r.ctx == 0
        held = sum(r.private_blocks for r in inst.running)
        assert held == inst.kv.private  # no prefix cache: every used block is a running request's

    def after_iteration(self, inst, plan, now, duration):
        self.rows[-1]["end"] = now


def _run(spec):
    sim = build_simulation(spec)
    rec = _Recorder()
    sim.instances[0].hooks.append(rec)
    sim.run()
    sim.check()
    return sim, rec


def test_v0_prefill_iterations_hold_no_decode_and_everything_finishes():
    sim, rec = _run(_spec())
    assert all(r.state == FINISHED for r in sim.requests)
    pre = [x for x in rec.rows if x["prefills"]]
    assert pre and any(x["decodes"] for x in rec.rows)
    assert all(x["decodes"] == 0 for x in pre)  # prefill-only iterations
    # and they do stall running decodes: decoding requests sat them out
    assert sum(len(x["stalled"]) for x in pre) > 0
    # a decode iteration leaves nobody out (no chunked prefill, no token budget binding)
    assert all(not x["stalled"] for x in rec.rows if not x["prefills"])


def test_stock_scheduler_mixes_prefill_chunks_with_decodes():
    # the same workload under the default (SGLang-like) scheduler: the property above is v0's
    _, rec = _run(_spec({"kind": "continuous"}))
    assert any(x["prefills"] and x["decodes"] for x in rec.rows)


def test_v0_recompute_after_preemption_stalls_every_running_decode():
    sim, rec = _run(_spec())
    assert sim.instances[0].preemptions > 0
    recomputes = [x for x in rec.rows if x["recompute"]]
    assert recomputes, "no preempted request was recomputed"
    assert all(x["decodes"] == 0 for x in recomputes)
    stalled = [x for x in recomputes if x["stalled"]]
    assert stalled, "no recomputation happened while other requests were decoding"
    for x in stalled:
        for r, last in x["stalled"]:
            # no token during the recompute iteration: the gap spans all of it
            assert last <= x["start"] and (r.last_token_t >= x["end"] or r.state == FINISHED)
    # the stock scheduler recomputes in chunks mixed with the running decodes instead
    _, mixed = _run(_spec({"kind": "continuous"}))
    assert any(x["recompute"] and x["decodes"] for x in mixed.rows)


def test_v0_preempts_the_latest_admitted_request_and_requeues_it_first():
    spec = _spec()
    sim = build_simulation(spec)
    inst = sim.instances[0]
    seen = []
    orig = inst.preempt

    def preempt(req):
        seen.append((req, list(inst.running)))
        orig(req)
        assert inst.waiting[0] is req

    inst.preempt = preempt
    sim.run()
    assert seen
    for req, running in seen:
        assert running[-1] is req


def test_v0_chunked_prefill_option_mixes_like_the_stock_scheduler():
    _, rec = _run(_spec({"kind": "vllm_v0", "options": {"chunked_prefill": True}}))
    assert any(x["prefills"] and x["decodes"] for x in rec.rows)


@pytest.mark.parametrize(
    "options, expect",
    [
        ({"chunked_prefill": "yes"}, "models[0].scheduler.options.chunked_prefill: expected true or false, got 'yes'"),
        ({"watermark": 1.5}, "models[0].scheduler.options.watermark: expected a number in [0, 1), got 1.5"),
        ({"watermark": True}, "models[0].scheduler.options.watermark: expected a number in [0, 1)"),
        ({"prefill_first": True}, "models[0].scheduler.options: "),
    ],
)
def test_bad_v0_options_name_the_field(options, expect):
    with pytest.raises(ScenarioError) as e:
        build_simulation(_spec({"kind": "vllm_v0", "options": options}))
    assert expect in str(e.value)


def test_bad_scheduler_kind_names_the_field():
    d = copy.deepcopy(BASE)
    d["models"][0]["scheduler"] = {"kind": "vllm_v1"}
    with pytest.raises(ScenarioError, match=r"models\[0\]\.scheduler\.kind: expected one of .*vllm_v0"):
        parse_scenario(d, "<test>")


def test_option_error_is_a_value_error_naming_the_option():
    with pytest.raises(OptionError) as e:
        VllmV0Scheduler(None, watermark=-0.1)
    assert e.value.option == "watermark" and isinstance(e.value, ValueError)


def test_oneiros_scenarios_run_v0_in_both_variants_and_others_keep_the_default():
    scen = REPO / "benchmark" / "sim" / "scenarios"
    for name in ("oneiros_c1.yaml", "oneiros_c1_alpaca.yaml", "oneiros_c2.yaml", "oneiros_c2_alpaca.yaml"):
        sc = load_scenario(scen / name)
        assert {n for n, _ in sc.variants} == {"vllm-static", "oneiros", "vllm-static-iter-rr", "oneiros-iter-rr"}
        for _, spec in sc.variants:
            assert all(m.scheduler == "vllm_v0" and not m.scheduler_options for m in spec.models)
    d = copy.deepcopy(BASE)
    del d["models"][0]["scheduler"]
    assert parse_scenario(d, "<test>").models[0].scheduler == "continuous"
    for p in sorted(scen.glob("*.yaml")):
        if not p.name.startswith("oneiros_"):
            sc = load_scenario(p)
            assert all(m.scheduler != "vllm_v0" for _, s in sc.variants for m in s.models), p.name
