"""Select-N / FlexGen-like offloading hooks in the simulator (benchmark/sim/mechanisms/select_n.py)
and the layer pipeline that times them (benchmark/sim/core/pipeline.py)."""

import copy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.core.pipeline import pipeline_seconds  # noqa: E402
from benchmark.sim.core.stats import summarize  # noqa: E402
from benchmark.sim.mechanisms.select_n import (  # noqa: E402
    FlexGenStaticHook,
    SelectNHook,
    decode_layer_time,
    profile_from_roofline,
)
from benchmark.sim.runner import build_simulation, run_spec  # noqa: E402
from benchmark.sim.scenario import load_scenario, parse_scenario  # noqa: E402
from memory_ext.policy.interval_manager import IntervalManager  # noqa: E402
from memory_ext.policy.layer_profile import LayerProfile  # noqa: E402
from memory_ext.policy.oneiros import uniform_interval_layers  # noqa: E402
from memory_ext.policy.select_n import LayerTiming, iteration_latency  # noqa: E402

BASE = {
    "name": "t",
    "duration_s": 1,
    "drain_s": 300,
    "node": {"gpu": "A10"},
    "models": [
        {"name": "m", "model": "OPT-6.7B", "max_running": 128, "max_batched_tokens": 8192, "prefix_caching": False}
    ],
    "workloads": [
        {
            "model": "m",
            "arrival": {"kind": "batch", "count": 128},
            "input": {"kind": "fixed", "value": 64},
            "output": {"kind": "fixed", "value": 24},
        }
    ],
}


def _spec(hook=None):
    d = copy.deepcopy(BASE)
    if hook:
        d["models"][0]["hooks"] = [hook]
    return parse_scenario(d)


def _inst():
    return build_simulation(_spec()).instances[0]


# ---------------------------------------------------------------- layer pipeline (the execution model)


def test_pipeline_nothing_streamed_and_lower_bounds():
    assert pipeline_seconds(8, (), 1.0, 3.0) == 8.0
    for slots in (1, 2):
        t = pipeline_seconds(8, tuple(range(8)), 1.0, 3.0, slots)
        assert t >= 8 * 3.0 and t >= 8.0
    # one slot, everything streamed: no overlap at all (Fig. 7 read literally)
    assert pipeline_seconds(8, tuple(range(8)), 1.0, 3.0, 1) == pytest.approx(32.0)
    with pytest.raises(ValueError):
        pipeline_seconds(8, (8,), 1.0, 1.0)


@pytest.mark.parametrize("interval", [2, 4, 8])
def test_pipeline_one_slot_equals_select_n_fig7_when_the_interval_divides(interval):
    layers = tuple(k * interval - 1 for k in range(1, 8 // interval + 1))
    assert pipeline_seconds(8, layers, 1.0, 3.0, 1) == pytest.approx(iteration_latency(8, interval, LayerTiming(1, 3)))


def test_pipeline_tail_layers_hide_the_wrap_around_load():
    # interval 3 of 8 (layers 3, 6): Fig. 7 gives 10; the two tail layers overlap the next load
    assert pipeline_seconds(8, (2, 5), 1.0, 3.0, 1) == pytest.approx(9.0)


def test_pipeline_two_slots_is_eq5_and_finer_than_eq4():
    assert pipeline_seconds(40, uniform_interval_layers(40, 12), 1.0, 3.2, 2) == pytest.approx(40.0)
    assert pipeline_seconds(40, uniform_interval_layers(40, 13), 1.0, 3.2, 2) == pytest.approx(41.6)
    # Eq. 4 (alpha 8, m 9) holds on average, but gaps of 4 layers leave 3 < 3.2 of compute: stalls
    assert pipeline_seconds(40, uniform_interval_layers(40, 9), 1.0, 3.2, 1) > 40.0


# ---------------------------------------------------------------- the record and the decision


def test_profile_from_roofline_is_a_layer_profile(tmp_path):
    inst = _inst()
    p = profile_from_roofline(inst, 64)
    assert p.n_layers == 32 and p.seq_len == 64 and p.device == "sim:A10"
    assert p.decode_layer_seconds(128) == pytest.approx(decode_layer_time(inst.roofline, 128, 64))
    assert p.layer_transfer_s == pytest.approx(inst.cfg.model.layer_weight_bytes() / 32e9)
    path = tmp_path / "opt.json"
    p.save(path)
    assert LayerProfile.load(path) == p


def test_interval_is_the_interval_managers_answer():
    inst = _inst()
    for slo in (0.2, 0.5):
        h = SelectNHook(inst, slo_slowdown=slo, set_tpot_slo=False)
        want = IntervalManager(profile_from_roofline(inst, 64), h.tpot_slo_s, 1, h.fixed_s).decide(128)
        assert (h.record_interval, h.interval, h.n_off) == (want.interval, want.interval, want.layers)
        assert h.streamed == tuple(k * want.interval - 1 for k in range(1, want.layers + 1))
    # a looser SLO never needs a larger interval
    d = SelectNHook(inst, set_tpot_slo=False).interval_table()["decode b=128 s=64"]
    assert d["0.2"] >= d["0.3"] >= d["0.4"] >= d["0.5"]


def test_a_loaded_profile_drives_the_decision(tmp_path):
    inst = _inst()
    slow = profile_from_roofline(inst, 64, link_bytes_per_s=8e9)  # a slower link measured elsewhere
    path = tmp_path / "slow.json"
    slow.save(path)
    h = SelectNHook(inst, profile=str(path), set_tpot_slo=False)
    fast = SelectNHook(inst, set_tpot_slo=False)
    assert h.profile == slow and h.n_off < fast.n_off
    other = LayerProfile.from_json({**slow.to_json(), "n_layers": 40})
    other.save(path)
    with pytest.raises(ValueError, match="do not match"):
        SelectNHook(inst, profile=str(path), set_tpot_slo=False)


# ---------------------------------------------------------------- execution against the SLO


def test_hook_grows_kv_and_streams_layers():
    sim = build_simulation(_spec({"kind": "select_n", "options": {"slo_slowdown": 0.5}}))
    inst = sim.instances[0]
    h = inst.hooks[0]
    sim.run()
    sim.check()
    assert h.n_off > 0
    assert inst.kv.capacity == inst.cfg.kv_blocks + h.gained_blocks
    assert h.gained_blocks == int((h.n_off - 1) * h.layer_bytes // inst.cfg.kv_block_bytes)
    link = sim.links["h2d:0"]
    assert link.bytes_done == pytest.approx(inst.iterations * h.n_off * h.layer_bytes, rel=1e-9)


def test_select_n_meets_slo_in_the_pipeline_and_interval_one_does_not():
    ok = run_spec(_spec({"kind": "select_n", "options": {"slo_slowdown": 0.5}}))
    assert ok.summary["instances"]["m"]["slo"]["attainment"] >= 0.95
    # DeepSpeed-like interval 1 (every layer on the host) must violate the same SLO
    bad = run_spec(_spec({"kind": "select_n", "options": {"slo_slowdown": 0.5, "interval": 1}}))
    assert bad.summary["instances"]["m"]["slo"]["attainment"] < 0.5
    # the next smaller interval than the policy's misses too: the choice is tight, not lucky
    h = build_simulation(_spec({"kind": "select_n", "options": {"slo_slowdown": 0.5}})).instances[0].hooks[0]
    tight = run_spec(_spec({"kind": "select_n", "options": {"slo_slowdown": 0.5, "interval": h.interval - 1}}))
    assert tight.summary["instances"]["m"]["tpot_s"]["p50"] > h.tpot_slo_s


def test_flexgen_static_split():
    inst = _inst()
    f1 = FlexGenStaticHook(inst, slo_slowdown=0.5, set_tpot_slo=False)
    f2 = FlexGenStaticHook(inst, slo_slowdown=0.5, bus_share=2, set_tpot_slo=False)
    assert 0 < f1.fraction < 1
    assert f2.fraction == pytest.approx(f1.fraction / 2)
    s = SelectNHook(inst, slo_slowdown=0.5, set_tpot_slo=False)
    assert s.host_bytes > f2.host_bytes  # Select-N beats the worst-case-bus static split
    r = run_spec(_spec({"kind": "flexgen_static", "options": {"slo_slowdown": 0.5}}))
    assert r.summary["instances"]["m"]["slo"]["attainment"] >= 0.95


# ---------------------------------------------------------------- several GPUs on one link


def _bus_spec(coordinate: bool, rate: float = 6.0):
    d = {
        "name": "bus",
        "duration_s": 20,
        "drain_s": 60,
        "seed": 3,
        "node": {"gpu": "A10", "count": 2},
        "models": [
            {"name": f"g{g}", "model": "OPT-6.7B", "gpu": g, "prefix_caching": False, "max_batched_tokens": 256}
            for g in (0, 1)
        ],
        "workloads": [
            {
                "model": f"g{g}",
                "arrival": {"kind": "poisson", "rate": rate},
                "input": {"kind": "fixed", "value": 64},
                "output": {"kind": "fixed", "value": 128},
            }
            for g in (0, 1)
        ],
    }
    opts = {"tpot_slo_s": 0.1, "batch": 32, "bus": "pcie0", "coordinate": coordinate}
    for m in d["models"]:
        m["hooks"] = [{"kind": "select_n", "options": opts}]
    return parse_scenario(d)


def test_uncoordinated_gpus_contend_on_the_shared_link():
    sim = build_simulation(_bus_spec(False)).run()
    sim.check()
    assert "bus:pcie0" in sim.links and sim.links["bus:pcie0"].bytes_done > 0
    hooks = [i.hooks[0] for i in sim.instances]
    assert all(h.n_off > 0 and h.link == "bus:pcie0" for h in hooks)
    # both stream as if alone: the shared link stretches their iterations past the SLO
    assert summarize(sim)["overall"]["tpot_s"]["p50"] > 0.1


def test_coordinator_keeps_the_link_within_bandwidth_and_memory_follows_intervals():
    sim = build_simulation(_bus_spec(True)).run()
    sim.check()
    hooks = [i.hooks[0] for i in sim.instances]
    bus = hooks[0]._bus
    assert bus is hooks[1]._bus and bus.decisions > 100
    for h in hooks:
        kv = h.inst.kv
        assert kv.capacity == h.base_blocks + h.gained_blocks
        assert h.gained_blocks <= h._gain(h.n_off)  # never more KV than the weights freed
    s = summarize(sim)["overall"]
    assert s["tpot_s"]["p50"] <= 0.1
    st = hooks[0].stats()
    assert st["counters"]["bus_decisions"] == bus.decisions


def test_coordinated_mode_needs_a_bus_and_no_arbiter():
    with pytest.raises(ValueError, match="bus"):
        SelectNHook(_inst(), coordinate=True)
    with pytest.raises(ValueError, match="interval"):
        SelectNHook(_inst(), interval=0)


def test_shipped_select_n_scenarios_load():
    sc = load_scenario(REPO / "benchmark" / "sim" / "scenarios" / "select_n_intervals.yaml")
    assert {h for _, s in sc.variants for m in s.models for h, _ in m.hooks} == {"select_n", "flexgen_static"}
    sc = load_scenario(REPO / "benchmark" / "sim" / "scenarios" / "select_n_shared_link.yaml")
    v = dict(sc.variants)
    assert v["select-n-coordinated"].models[0].hooks[0][1]["coordinate"] is True
    assert {m.gpu for m in v["stock"].models} == {0, 1}
