"""eLLM in the simulator: CPU elastic buffer (offload over d2h, fetch over
h2d) and Alg. 2 logical buffer scaling (benchmark/sim/ellm_buffer.py)."""

import copy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.runner import run_spec  # noqa: E402
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


def test_alg2_grows_on_ttft_violations():
    r, s = _run(lambda d: d["models"][0]["scheduler"]["options"].update(buffer_scaling=True))
    assert s.events["ttft"] > 0
    assert s.logical_trace and s.logical_trace[0][1] == 2  # starts at 1 chunk, doubles (alpha = 2)
    assert max(v for _, v in s.logical_trace) >= 64  # a 1024-token prompt needs 64 blocks
    assert s.offloads > 0 and r.summary["overall"]["finished"] == 24


def test_alg2_shrinks_on_tpot_violations():
    def tight(d):
        d["models"][0]["scheduler"]["options"].update(buffer_scaling=True)
        d["models"][0]["slo"]["tpot_s"] = 1e-4  # every projected TPOT misses

    r, s = _run(tight)
    _, grow = _run(lambda d: d["models"][0]["scheduler"]["options"].update(buffer_scaling=True))
    assert s.events["tpot"] > 0
    assert s.scaler.logical_chunks == 1
    assert s.offloads < grow.offloads
    assert r.summary["overall"]["finished"] == 24


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
