"""SwiftCache in the simulator: peer spill over NVLink, lending bounds, LSC capacity."""

from benchmark.sim import load_scenario
from benchmark.sim.runner import build_simulation

SC = "benchmark/sim/scenarios/swiftcache.yaml"


def _run(variant, duration=60.0, **options):
    from dataclasses import replace

    sc = load_scenario(SC)
    spec = dict(sc.variants)[variant]
    # a small master KV pool (24 GB = 46K tokens) so that prefixes spill within seconds
    master = replace(spec.models[0], kv_memory_gb=24.0)
    if options:  # hook option overrides (ablations)
        kind, opts = master.hooks[0]
        master = replace(master, hooks=((kind, {**opts, **options}),))
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


def test_peer_tier_is_exclusive_of_the_master_gpu_cache():
    # §3.2: the master's regular cache and the peers' offloaded prefix cache hold
    # different blocks; a block loaded back from a peer leaves the peer. The old
    # model kept inclusive copies, so its peer tier mostly duplicated the GPU.
    sim, hook, _ = _run("swiftcache")
    kv = sim.instances[0].kv
    peer = [t for t in hook.tiers if t.is_peer]
    assert sum(t.loaded for t in peer) > 0
    for t in peer:
        assert not any(k in kv.refs for k in t.keys)
        assert all(hook.where[k] is t for k in t.keys)


def test_peer_block_load_is_faster_than_host_per_block():
    sim_p, hook_p, _ = _run("swiftcache", duration=5.0)
    sim_h, hook_h, _ = _run("hicache-host", duration=5.0)
    bb = hook_p.block_bytes
    t_peer = max(bb / sim_p.links[t.load_link].bandwidth for t in hook_p.tiers)
    t_host = bb / sim_h.links[hook_h.tiers[0].load_link].bandwidth
    assert sim_p.links[hook_p.tiers[0].load_link].bandwidth == 200e9  # NVLink 400 GB/s bidirectional (§5)
    assert sim_h.links[hook_h.tiers[0].load_link].bandwidth == 32e9  # PCIe 4.0, shared by the GPUs (§5)
    assert t_peer * 6 < t_host


def test_lsc_stream_reads_peer_prefixes_in_place_and_releases_them():
    sim, hook, _ = _run("swiftcache-lsc-stream", duration=60.0)
    kv = sim.instances[0].kv
    peer = [t for t in hook.tiers if t.is_peer]
    assert sum(t.streamed for t in peer) > 0 and sum(t.loaded for t in peer) == 0
    assert hook.stream_prefix_bytes > 0 and hook.stream_exposed_s > 0
    readers = {}  # streamed refs == running requests holding the block: finished ones released theirs
    for r in sim.instances[0].running:
        for k in r.cached_keys:
            if k in kv.streamed:
                readers[k] = readers.get(k, 0) + 1
    assert readers == kv.streamed
    lsc = hook.lsc_prefix  # Eq. 4-5: the LSC buffer came out of the master's local KV
    assert kv.capacity == lsc.n_rc < hook.base_capacity


def test_bad_peer_access_names_the_field():
    import pytest

    sc = load_scenario(SC)
    spec = dict(sc.variants)["swiftcache"]
    from dataclasses import replace

    m = spec.models[0]
    kind, opts = m.hooks[0]
    bad = replace(m, hooks=((kind, {**opts, "peer_access": "teleport"}),))
    with pytest.raises(ValueError, match="peer_access"):
        build_simulation(replace(spec, models=(bad,) + spec.models[1:]))


def test_max_context_is_computed_from_model_dims_and_memory():
    # LWM (Llama-2-7B dims, fp16) on an H20: KV bytes/token = 2 * L * H_kv * D * 2;
    # local budget = 0.9 * 96 GB - weights - activations of an 8K chunk; idle
    # donors lend all their KV (Alg. 1 SCALEDOWN, empty window: no reserve)
    from benchmark.sim.core.models import MODELS
    from benchmark.sim.mechanisms.swiftcache import kv_geometry
    from memory_ext.policy.swiftcache import min_elastic_unit

    sc = load_scenario("benchmark/sim/scenarios/swiftcache_maxctx.yaml")
    sim = build_simulation(dict(sc.variants)["swiftcache-H20"])
    master = sim.instances[0]
    master.kv.capacity  # bind  # noqa: B018
    hook = master.hooks[0]
    lwm = MODELS["Llama-2-7B"]
    per_token = 2 * 32 * 32 * 128 * 2
    assert lwm.kv_bytes_per_token("fp16") == per_token == 524288  # Table 2: 0.50 MB
    budget = 0.9 * 96e9 - lwm.weight_bytes("fp16") - lwm.activation_bytes(8192, "fp16")
    base_blocks = int(budget // (16 * per_token))
    assert hook.base_capacity == base_blocks
    m_block = 2 * 16 * 32 * 128 * 2  # Eq. 1
    k_master = base_blocks * 32 * m_block // m_block  # Eq. 3
    lent = []
    for ws in hook.workers:
        w = ws.inst
        wm = w.cfg.model
        w_budget = 0.9 * 96e9 - wm.weight_bytes("fp16") - wm.activation_bytes(w.cfg.max_batched_tokens, "fp16")
        w_blocks = int(w_budget // (16 * wm.kv_bytes_per_token("fp16")))
        meu = min_elastic_unit(kv_geometry(master), kv_geometry(w)).meu_worker
        assert ws.policy.donated_blocks == w_blocks // meu * meu  # everything, in whole MEUs
        lent.append(ws.policy.donated_blocks * w.cfg.kv_block_bytes)
    k_workers = [int(c // (m_block * 32)) for c in lent]  # Eq. 2
    n_lsc = min(sum(k_workers), k_master)  # Eq. 4
    n_rc = max(0, (k_master - sum(k_workers)) // 32)  # Eq. 5
    assert hook.lsc.max_context_tokens == (n_lsc + n_rc) * 16
    assert hook.lsc.max_context_tokens > 2.5 * base_blocks * 16


def test_workers_that_lent_everything_still_serve_their_requests():
    # no reserve (Alg. 1 has none): an idle worker lends all its KV, and the
    # incoming request triggers SCALEUP (§3.5) before the engine checks that it
    # can fit -- before, every worker request was rejected at arrival
    sim, hook, _ = _run("swiftcache")
    assert hook.worker_reserve_tokens == 0
    assert all(ws.max_donated >= ws.original_blocks - ws.policy.meu_worker for ws in hook.workers)
    assert sum(ws.scale_ups for ws in hook.workers) > 0
    for ws in hook.workers:
        served = [r for r in sim.requests if r.model == ws.inst.idx and r.first_token_t is not None]
        assert served and not [rid for rid in sim.rejected if sim.requests[rid].model == ws.inst.idx]
