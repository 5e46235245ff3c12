"""FineServe in the simulator: KV slab sharing, placement (Alg. 1, Eq. 3)
vs the Prism-like heuristic, EDF adaptive batching
(benchmark/sim/mechanisms/fineserve.py)."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.core.fineserve_policy import slab_bytes  # noqa: E402
from benchmark.sim.mechanisms import fineserve as fp  # noqa: E402
from benchmark.sim.runner import run_spec  # noqa: E402
from benchmark.sim.scenario import load_scenario  # noqa: E402
from memory_ext.policy.slab_table import blocks_per_slab  # noqa: E402

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
    for v in ("fineserve", "static", "static_edf", "shared_fcfs"):
        assert _gpus(VARIANTS[v]) == fs, v
    assert _gpus(VARIANTS["prism"]) == pr
    demands = {d.name: d.footprint / 1e9 for d in fp.model_demands(SC.base, HEADLINE)}
    for v in ("static", "static_edf"):
        for m in VARIANTS[v].models:
            assert m.scheduler_options["kv"] == "static"
            assert m.scheduler_options["footprint_gb"] == pytest.approx(demands[m.name], abs=0.01)


def test_footprint_kv_is_taken_at_the_smallest_batch_meeting_the_rate():
    """FineServe 6.2: F_M's KV at the smallest batch whose profiled throughput meets the rate."""
    from benchmark.sim.core.hardware import gpu_spec
    from benchmark.sim.core.models import model_spec

    g = gpu_spec(SC.base.node.gpu)
    for d, m in zip(fp.model_demands(SC.base, HEADLINE), SC.base.models):
        wl = [w for w in SC.base.workloads if w.model == m.name][0]
        rate = wl.arrival.rate * HEADLINE
        thr, ctx = fp.profiled_throughput(
            model_spec(m.model), g, m, wl.input.expected_mean(), wl.output.expected_mean()
        )
        assert d.rate_met and thr(d.batch) >= rate > thr(d.batch - 1)
        assert d.kv_base == pytest.approx(d.batch * ctx * d.kv_bytes_per_token)
        assert d.footprint == pytest.approx(d.weights + d.activations + d.kv_base)


def test_placement_goes_through_the_shared_policy(monkeypatch):
    """The simulator's Alg. 1 is memory_ext.policy.placement.place_models (the router's), fed by model_demand."""
    import benchmark.sim.core.fineserve_policy as sim
    import memory_ext.policy.placement as pol

    calls = []
    real = pol.place_models

    def spy(models, gpus, mu_fn=None):
        calls.append((list(models), list(gpus)))
        return real(models, gpus, mu_fn)

    monkeypatch.setattr(pol, "place_models", spy)
    got = fp.fineserve_placement(SC.base, HEADLINE)
    assert len(calls) == 1
    models, gpus = calls[0]
    ds = fp.model_demands(SC.base, HEADLINE)
    assert models == [sim.model_demand(d.name, d.weights, d.kv_bytes_per_token, d.kv_tokens, d.activations) for d in ds]
    assert [g.total_memory for g in gpus] == [fp._budget(SC.base)] * SC.base.node.count
    assert got == {n: int(g) for n, g in real(models, gpus).assignment.items()}


def test_shared_placement_function_agrees_with_the_router(tmp_path):
    """serve/placement.py builds F_M = weights + kv_reserve_tokens x KV/token and mu = 1/(KV/token):
    model_demand + place_with_pins give the router's decision, pins included."""
    pytest.importorskip("sglang_memx.serve.placement")
    from benchmark.sim.core.fineserve_policy import model_demand, place_with_pins
    from memory_ext.policy.placement import GpuCandidate
    from sglang_memx.serve.config import parse_config
    from sglang_memx.serve.placement import GIB, ModelSize, plan_placement
    from support.fake_checkpoint import fake_model

    spec = {"a": (0.5, 1000, 300, None), "b": (0.4, 100, 50, "d1"), "c": (0.3, 500, 100, None), "e": (0.2, 40, 0, None)}
    models = []
    for n, (_, _, reserve, dev) in spec.items():
        fake_model(tmp_path, n)
        m = {"name": n, "path": n, "kv_reserve_tokens": reserve}
        if dev:
            m["device"] = dev
        models.append(m)
    cfg = parse_config({"models": models, "devices": [{"name": "d0", "memory_gb": 1}, {"name": "d1", "memory_gb": 1}]},
                       base_dir=tmp_path)  # fmt: skip
    sizes = {n: ModelSize(int(w * GIB), kv, 2, 2, 16, 2) for n, (w, kv, _, _) in spec.items()}
    router = plan_placement(cfg, sizes)
    demands = [
        model_demand(n, sizes[n].weight_bytes, sizes[n].kv_bytes_per_token, r) for n, (_, _, r, _) in spec.items()
    ]
    shared = place_with_pins(demands, [GpuCandidate("d0", GIB), GpuCandidate("d1", GIB)], {"b": "d1"})
    assert {n: pm.device for n, pm in router.models.items()} == shared.assignment
    assert router.alg1 == shared.alg1


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
    cap_static = static.sim.instances[a].kv.capacity
    assert sp.max_held[a] * sp.bps[a] > cap_static  # borrowed the idle neighbour's memory
    assert cap_static == int(st.partition[a] // st.block_bytes[a])  # never grew
    sp.check()
    st.check()


def test_static_partition_follows_the_paper():
    """Static* (FineServe 7.1): GPU memory in proportion to F_M; weights and activations come out of
    each model's share; the rest is a private pool in the model's own block size (no slabs)."""
    from benchmark.sim.core.fineserve_policy import static_partition

    r = run_spec(replace(VARIANTS["static"], duration_s=2.0, drain_s=30), None, 2.0)
    usable = fp._budget(VARIANTS["static"])
    for g, pool in r.sim._fineserve_pools.items():
        assert pool.mode == "static" and pool.table is None and pool.total_slabs == 0
        insts = [i for i in r.sim.instances if i.cfg.gpu == g]
        fm = {str(i.idx): i.scheduler.footprint for i in insts}
        share = static_partition(usable, fm)
        for i in insts:
            fixed = i.cfg.model.weight_bytes(i.cfg.weight_dtype) + i.cfg.act_blocks * i.cfg.kv_block_bytes
            # the runner's memory plan rounds every KV pool down to whole blocks
            assert pool.partition[i.idx] == pytest.approx(share[str(i.idx)] - fixed, abs=64 << 20)
            assert i.kv.capacity == int(pool.partition[i.idx] // i.cfg.kv_block_bytes)
    # GPU 0: fp8 8B (1 MiB blocks) and bf16-KV 32B (4 MiB blocks) in separate partitions
    assert {i.cfg.kv_block_bytes for i in r.sim.instances if i.cfg.gpu == 0} == {1 << 20, 4 << 20}


def test_slab_fragmentation_is_modelled():
    """Blocks live in slabs: a slab returns to the pool only when all its blocks are free, so a model
    holds free blocks in partly used slabs that its neighbour cannot use."""
    r = _short("fineserve", scale=8.0, duration=6.0)
    for pool in r.sim._fineserve_pools.values():
        pool.check()
        for i in pool.insts:
            held = pool.table.held_slabs(i.idx)
            assert held * pool.bps[i.idx] == i.kv.capacity
            assert held >= -(-pool.table.used_blocks(i.idx) // pool.bps[i.idx])
    gauges = {m["instance"]: m["gauges"] for inst in r.summary["instances"].values() for m in inst["mechanisms"]}
    # partly used slabs strand memory at some point (perfect compaction would keep it below one slab)
    assert any(gg["stranded_bytes_max"] > gg["slab_bytes"] for gg in gauges.values())
    assert all(gg["block_tail_bytes_mean"] > 0 for gg in gauges.values())


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
