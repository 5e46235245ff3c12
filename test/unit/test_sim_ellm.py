"""eLLM in the simulator: CPU elastic buffer (offload over d2h, fetch over
h2d) and Alg. 2 logical buffer scaling (benchmark/sim/mechanisms/ellm.py)."""

import copy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.runner import build_simulation, run_spec  # noqa: E402
from benchmark.sim.scenario import ScenarioError, load_scenario, parse_scenario  # noqa: E402

BASE = {
    "name": "ellm_small",
    "duration_s": 5,
    "drain_s": 600,
    "node": {"gpu": "A100-80G"},
    "models": [
        {
            "name": "m",
            "model": "Llama-3-8B",
            "kv_memory_gb": 1.2,
            "activation_tokens": 4096,
            "max_batched_tokens": 4096,
            "prefix_caching": False,
            "slo": {"ttft_s": 0.5, "tpot_s": 0.5},
            "scheduler": {"kind": "ellm_elastic", "options": {"cpu_buffer_gb": 8, "buffer_scaling": False}},
        }
    ],
    "workloads": [
        {
            "model": "m",
            "arrival": {"kind": "batch", "count": 24},
            "input": {"kind": "fixed", "value": 1024},
            "output": {"kind": "fixed", "value": 64},
        }
    ],
}


def _run(mutate=None):
    d = copy.deepcopy(BASE)
    if mutate:
        mutate(d)
    r = run_spec(parse_scenario(d, "<test>"))
    return r, r.sim.instances[0].scheduler


def test_offloaded_prefills_use_both_links_and_finish():
    r, s = _run()
    o = r.summary["overall"]
    assert o["finished"] == 24 and o["unfinished"] == 0 and o["rejected"] == 0
    assert s.offloads > 0 and s.offloads == s.fetches
    links = r.summary["links"]
    per_req = 1024 * r.sim.instances[0].cfg.model.kv_bytes_per_token("bf16")
    assert links["d2h:0"]["bytes"] == pytest.approx(s.offloads * per_req, rel=1e-6)
    assert links["h2d:0"]["bytes"] == pytest.approx(s.fetches * per_req, rel=1e-6)
    assert s.cpu_used == 0 and not s.parked  # everything fetched back


def test_no_buffer_no_traffic_and_slower_ttft():
    r0, s0 = _run(lambda d: d["models"][0]["scheduler"]["options"].update(cpu_buffer_gb=0))
    r1, _ = _run()
    assert s0.offloads == 0
    assert r0.summary["links"]["d2h:0"]["bytes"] == 0 and r0.summary["links"]["h2d:0"]["bytes"] == 0
    assert r1.summary["overall"]["ttft_s"]["p50"] < r0.summary["overall"]["ttft_s"]["p50"]


def _scaling(d):
    """Alg. 2 on, and 48 requests: Alg. 2 gets one TTFT sample per request (``HostBufferRule``),
    so 24 requests give at most 5 violations (1 -> 32 blocks), too few to reach the 64 blocks
    one prompt needs; 48 give enough to see the buffer grow past it and be used."""
    d["models"][0]["scheduler"]["options"].update(buffer_scaling=True)
    d["workloads"][0]["arrival"]["count"] = 48


def test_alg2_grows_on_ttft_violations():
    r, s = _run(_scaling)
    assert s.events["ttft"] > 0
    assert s.logical_trace and s.logical_trace[0][1] == 2  # starts at 1 chunk, doubles (alpha = 2)
    assert max(v for _, v in s.logical_trace) >= 64  # a 1024-token prompt needs 64 blocks
    assert s.offloads > 0 and r.summary["overall"]["finished"] == 48


def test_alg2_shrinks_on_tpot_violations():
    def tight(d):
        _scaling(d)
        d["models"][0]["slo"]["tpot_s"] = 1e-4  # every projected TPOT misses

    r, s = _run(tight)
    _, grow = _run(_scaling)
    assert s.events["tpot"] > 0
    assert s.scaler.logical_chunks == 1
    assert s.offloads < grow.offloads
    assert r.summary["overall"]["finished"] == 48


def test_buffer_requires_prefix_caching_off():
    d = copy.deepcopy(BASE)
    d["models"][0]["prefix_caching"] = True
    with pytest.raises(ScenarioError, match="prefix_caching"):
        run_spec(parse_scenario(d, "<test>"))


def test_shipped_scenario_has_cpu_buffer_variant():
    sc = load_scenario(REPO / "benchmark/sim/scenarios/ellm_2k2k.yaml")
    kinds = {n: (s.models[0].scheduler, s.models[0].scheduler_options) for n, s in sc.variants}
    assert kinds["ellm"] == ("ellm_elastic", {"cpu_buffer_gb": 200})
    assert kinds["vllm-static"][0] == "continuous"


# ---- decode reservation (new_token_ratio) and Alg. 2 through HostBufferRule --------------------

PRESSURE = {
    "name": "ellm_pressure",
    "duration_s": 30,
    "drain_s": 600,
    "seed": 1,
    "node": {"gpu": "H100-SXM"},
    "models": [
        {
            "name": "m",
            "model": "Llama-3.1-8B",
            "kv_memory_gb": 4.0,
            "max_batched_tokens": 8192,
            "scheduler": {"kind": "ellm", "options": {}},
        }
    ],
    "workloads": [
        {
            "model": "m",
            "arrival": {"kind": "poisson", "rate": 6.0},
            "input": {"kind": "fixed", "value": 1024},
            "output": {"kind": "fixed", "value": 512},
        }
    ],
}


def _pressure(kind, **opts):
    d = copy.deepcopy(PRESSURE)
    d["models"][0]["scheduler"] = {"kind": kind, "options": opts}
    sim = build_simulation(parse_scenario(d, "<t>"))
    sched = sim.instances[0].scheduler
    seen = []
    decide = sched.policy.decide

    def spy(**kw):
        inst = sim.instances[0]
        resident = [r for r in inst.running if r.decoding]
        seen.append((kw["reserved_chunks"], sum(r.output_len - r.generated for r in resident)))
        return decide(**kw)

    sched.policy = type("Spy", (), {"decide": staticmethod(spy)})()
    sim.run()
    sim.check()
    return sim, sched, seen


@pytest.mark.parametrize("kind", ["ellm", "ellm_elastic"])
def test_decode_reserve_is_passed_to_alg1(kind):
    _, s, seen = _pressure(kind)
    assert s.new_token_ratio == 0.7  # SGLang's initial new-token ratio
    bs = 16
    assert seen and all(res == -(-(remaining * 7) // (10 * bs)) for res, remaining in seen)
    assert max(res for res, _ in seen) > 0 and s.stats()["gauges"]["max_decode_reserve_blocks"] > 0
    _, s0, seen0 = _pressure(kind, new_token_ratio=0)
    assert all(res == 0 for res, _ in seen0)  # the paper's literal Alg. 1


def test_decode_reserve_avoids_preemptions():
    lit, _, _ = _pressure("ellm", new_token_ratio=0)
    res, _, _ = _pressure("ellm")
    pre = [sum(r.preemptions for r in sim.requests) for sim in (lit, res)]
    assert pre[0] > 0 and pre[1] < pre[0] / 4, pre
    assert all(r.finish_t is not None for sim in (lit, res) for r in sim.requests)


def test_bad_new_token_ratio_is_a_scenario_error():
    d = copy.deepcopy(PRESSURE)
    d["models"][0]["scheduler"]["options"] = {"new_token_ratio": 1.5}
    with pytest.raises(ScenarioError, match=r"models\[0\]\.scheduler\.options: new_token_ratio must be"):
        run_spec(parse_scenario(d, "<t>"))


def test_alg2_is_the_host_buffer_rule_fed_one_ttft_sample_per_first_token():
    from memory_ext.policy.ellm import HostBufferRule

    r, s = _run(_scaling)
    assert isinstance(s.rule, HostBufferRule) and s.scaler is s.rule.scaler and s.scaler.per_sample
    assert s.rule.scaler.initial_chunks == 1
    firsts = sum(1 for q in r.sim.requests if q.first_token_t is not None)
    assert s.ttft_samples == firsts == 48  # one per request, none for waiting
    assert 0 < s.tpot_samples <= r.sim.instances[0].iterations
    assert s.events is s.rule.events
