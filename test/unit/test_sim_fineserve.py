"""FineServe in the simulator: KV slab sharing, placement (Alg. 1, Eq. 3)
vs the Prism-like heuristic, EDF adaptive batching
(benchmark/sim/mechanisms/fineserve.py)."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.mechanisms import fineserve as fp  # noqa: E402
from benchmark.sim.runner import run_spec  # noqa: E402
from benchmark.sim.scenario import load_scenario  # noqa: E402
from memory_ext.policy.fineserve import blocks_per_slab, slab_bytes  # noqa: E402

SC = load_scenario(REPO / "benchmark/sim/scenarios/fineserve_placement.yaml")
VARIANTS = dict(SC.variants)
HEADLINE = 8.0  # the rate scale the scenario's placements are computed for


def _gpus(spec):
    return {m.name: m.gpu for m in spec.models}


def test_placement_differs_from_heuristic_and_respects_memory():
    fs = fp.fineserve_placement(SC.base, HEADLINE)
    pr = fp.prism_placement(SC.base, HEADLINE)
    assert fs != pr
    budget = fp._budget(SC.base)
    demands = {d.name: d for d in fp.model_demands(SC.base, HEADLINE)}
    for g in range(SC.base.node.count):
        assert sum(demands[n].footprint for n, x in fs.items() if x == g) <= budget
        assert sum(demands[n].weights + demands[n].activations for n, x in pr.items() if x == g) <= budget
    # FineServe pairs the bf16-KV 32B model with the fp8-KV 8B model (higher mean mu)
    assert fs["C-32b-w8kv16"] == fs["B-8b-fp8"] != fs["A-8b-fp16"]


def test_scenario_file_matches_policy_output():
    fs = fp.fineserve_placement(SC.base, HEADLINE)
    pr = fp.prism_placement(SC.base, HEADLINE)
    assert _gpus(VARIANTS["fineserve"]) == fs == _gpus(VARIANTS["static"])
    assert _gpus(VARIANTS["prism"]) == pr
    demands = {d.name: d.footprint / 1e9 for d in fp.model_demands(SC.base, HEADLINE)}
    for m in VARIANTS["static"].models:
        assert m.scheduler_options["weight"] == pytest.approx(demands[m.name], abs=0.01)


def _short(name, scale=HEADLINE, duration=8.0):
    return run_spec(replace(VARIANTS[name], duration_s=duration, drain_s=60), None, scale)


def test_slab_sizes_match_policy_and_pool_conserves_memory():
    r = _short("fineserve", scale=2.0, duration=5.0)
    pools = r.sim._fineserve_pools
    assert set(pools) == {0, 1}
    for g, pool in pools.items():
        insts = [i for i in r.sim.instances if i.cfg.gpu == g]
        sizes = [int(i.cfg.kv_block_bytes) for i in insts]
        assert pool.slab == slab_bytes(sizes, 2 << 20)
        assert all(pool.slab % s == 0 for s in sizes)
        for i, s in zip(insts, sizes):
            assert pool.bps[i.idx] == blocks_per_slab(pool.slab, s)
        pool.check()
    # mixed precisions on GPU 0 (bf16-KV 32B + fp8-KV 8B): block sizes differ
    g0 = [int(i.cfg.kv_block_bytes) for i in r.sim.instances if i.cfg.gpu == 0]
    assert len(set(g0)) == 2


def _only_a(name):
    spec = VARIANTS[name]
    wl = tuple(w for w in spec.workloads if w.model == "A-8b-fp16")
    return run_spec(replace(spec, workloads=wl, duration_s=5.0, drain_s=60), None, 48.0)


def test_shared_slabs_lend_beyond_static_share():
    shared, static = _only_a("fineserve"), _only_a("static")
    a = 0  # models[0] = A, alone under load on GPU 1
    sp, st = shared.sim._fineserve_pools[1], static.sim._fineserve_pools[1]
    assert sp.max_held[a] > st.held[a]  # borrowed the idle neighbour's memory
    assert static.sim.instances[a].kv.capacity == st.floor[a] + st.held[a] * st.bps[a]  # never grew
    sp.check()
    st.check()


def test_edf_drops_hopeless_requests_and_meets_more_slos():
    shared = _short("fineserve", scale=16.0, duration=5.0)
    static = _short("static", scale=16.0, duration=5.0)
    for res in (shared, static):
        for p in res.sim._fineserve_pools.values():
            p.check()
        o = res.summary["overall"]
        assert o["unfinished"] == 0
    # static FCFS never drops; EDF drops hopeless requests and meets more SLOs
    assert static.summary["overall"]["rejected"] == 0
    assert shared.summary["overall"]["slo"]["attainment"] > static.summary["overall"]["slo"]["attainment"]


def test_bad_options_rejected():
    from benchmark.sim.scenario import ScenarioError

    spec = VARIANTS["fineserve"]
    m = replace(spec.models[0], scheduler_options={"batching": "lifo"})
    with pytest.raises(ScenarioError, match="batching"):
        run_spec(replace(spec, models=(m,) + spec.models[1:], duration_s=1.0))
