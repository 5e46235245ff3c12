"""SwiftCache in the simulator: peer spill over NVLink, lending bounds, LSC capacity."""

from benchmark.sim import load_scenario
from benchmark.sim.runner import build_simulation

SC = "benchmark/sim/scenarios/swiftcache.yaml"


def _run(variant, duration=60.0):
    from dataclasses import replace

    sc = load_scenario(SC)
    spec = dict(sc.variants)[variant]
    # a small master KV pool (24 GB = 46K tokens) so that prefixes spill within seconds
    master = replace(spec.models[0], kv_memory_gb=24.0)
    spec = replace(spec, models=(master,) + spec.models[1:], duration_s=duration, drain_s=300.0)
    sim = build_simulation(spec)
    hook = sim.instances[0].hooks[0]
    checks = []

    def check(s, now):
        for ws in hook.workers:  # lent memory == memory taken out of the worker's pool, never more
            assert ws.inst.kv.capacity + ws.policy.donated_blocks == ws.original_blocks
            assert ws.inst.kv.used <= ws.inst.kv.capacity
            if ws.tier is not None:
                assert len(ws.tier.keys) <= ws.tier.capacity == ws.donated_units * ws.meu_m
        checks.append(now)

    sim.periodic.append((1.0, check))
    sim.run()
    sim.check()
    return sim, hook, checks


def test_peer_spill_travels_over_nvlink_and_is_hit_later():
    sim, hook, checks = _run("swiftcache")
    assert checks
    links = sim.links.summary()
    peer = [t for t in hook.tiers if t.name.startswith("peer")]
    assert peer and sum(t.stored for t in peer) > 0 and sum(t.loaded for t in peer) > 0
    assert hook.tier_hit_blocks > 0
    assert links["nvlink_sc:0"]["bytes"] > 0  # stores: master egress
    assert links["nvlink_sc:1"]["bytes"] + links["nvlink_sc:2"]["bytes"] > 0  # loads: worker egress
    assert all(l["bytes"] == 0 for n, l in links.items() if n.startswith("host_shared"))  # no PCIe at all
    for n in ("h2d:0", "d2h:0"):
        assert links[n]["bytes"] == 0


def test_host_baseline_uses_pcie_only_and_lends_nothing_to_a_tier():
    sim, hook, _ = _run("hicache-host")
    links = sim.links.summary()
    assert [t.name for t in hook.tiers] == ["host"]
    assert links["host_shared_h2d"]["bytes"] > 0 and links["host_shared_d2h"]["bytes"] > 0
    assert links.get("nvlink_sc:0", {"bytes": 0})["bytes"] == 0


def test_worker_scale_up_reclaims_whole_meus_within_the_donation():
    sim, hook, _ = _run("swiftcache", duration=20.0)
    ws = hook.workers[0]
    before = ws.policy.donated_blocks
    # a burst of demand on the worker: SCALEUP must take back whole MEUs
    cap_before = ws.inst.kv.capacity
    demand_tokens = (cap_before + 3 * ws.policy.meu_worker) * ws.inst.kv.block_size
    ws.last_demand = -1
    dec = ws.policy.on_request(sim.loop.now + 1, demand_tokens)
    assert dec.changed and dec.worker_blocks % ws.policy.meu_worker == 0
    assert ws.policy.donated_blocks == before - dec.worker_blocks >= 0


def test_layer_stream_cache_extends_max_context():
    sc = load_scenario("benchmark/sim/scenarios/swiftcache_maxctx.yaml")
    v = dict(sc.variants)
    base = build_simulation(v["chunked-8k-H20"])
    sim = build_simulation(v["swiftcache-H20"])
    hook = sim.instances[0].hooks[0]
    cap = sim.instances[0].kv.capacity  # binds: SCALEDOWN lends, plan_lsc sizes LSC + RC
    lsc = hook.lsc
    assert cap == lsc.n_lsc + lsc.n_rc
    assert lsc.n_lsc == min(sum(lsc.k_workers), lsc.k_master)
    assert cap > 2 * base.instances[0].kv.capacity
    for ws, k in zip(hook.workers, lsc.k_workers):
        assert k * lsc.num_layers * lsc.m_block_bytes <= ws.policy.donated_blocks * ws.inst.cfg.kv_block_bytes
        assert ws.inst.kv.capacity + ws.policy.donated_blocks == ws.original_blocks
