"""Oneiros remapping hook in the simulator (benchmark/sim/mechanisms/oneiros.py)."""

import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.mechanisms.oneiros import OneirosHook, ledger_of  # noqa: E402
from benchmark.sim.runner import build_simulation, run_spec  # noqa: E402
from benchmark.sim.scenario import load_scenario, parse_scenario  # noqa: E402
from memory_ext.policy.oneiros import model_limit  # noqa: E402

# one busy model with a small static KV, one idle model that can lend layers
BASE = {
    "name": "t",
    "duration_s": 20,
    "drain_s": 300,
    "seed": 1,
    "node": {"gpu": "GH200"},
    "models": [
        {"name": "busy", "model": "OPT-13B", "kv_memory_gb": 1.0, "prefix_caching": False},
        {"name": "idle", "model": "OPT-6.7B", "kv_memory_gb": 0.5, "prefix_caching": False},
    ],
    "workloads": [
        {
            "model": "busy",
            "arrival": {"kind": "poisson", "rate": 6.0},
            "input": {"kind": "fixed", "value": 200},
            "output": {"kind": "fixed", "value": 300},
        }
    ],
}


def _spec(hook: bool):
    d = copy.deepcopy(BASE)
    if hook:
        for m in d["models"]:
            m["hooks"] = [{"kind": "oneiros"}]
    return parse_scenario(d)


def test_remap_frees_kv_and_streams_over_host_link():
    sim = build_simulation(_spec(True))
    busy, idle = sim.instances
    base_cap = busy.cfg.kv_blocks
    sim.run()
    sim.check()
    led = ledger_of(busy)
    assert led.remaps > 0
    # the idle model lent layers (inactive first), the busy one borrowed KV
    assert led.max_alpha[idle.idx] > 0
    assert max(s.kv_capacity[0] for s in sim.samples) > base_cap
    # never a whole model, never above the cap
    assert all(a <= h.cap for a, h in ((led.max_alpha[i.idx], i.hooks[0]) for i in sim.instances))
    # idle model never ran, so it never streamed; the busy model did when it lent layers
    assert idle.iterations == 0
    assert (sim.links["h2d:0"].bytes_done > 0) == (led.max_alpha[busy.idx] > 0)


def test_borrowed_blocks_match_layer_bytes():
    sim = build_simulation(_spec(True))
    busy, idle = sim.instances
    sim.run()
    led = ledger_of(busy)
    per_layer = int(idle.cfg.model.layer_weight_bytes() // busy.cfg.kv_block_bytes)
    for lender, loans in led.loans.items():
        lb = sim.instances[lender].cfg.model.layer_weight_bytes()
        for borrower, blocks in loans:
            assert blocks == int(lb // borrower.cfg.kv_block_bytes)
    assert busy.kv.capacity == busy.cfg.kv_blocks + led.lent_blocks_to(busy)
    assert per_layer > 0


def test_every_lent_layer_comes_back_once_its_kv_is_empty():
    """Alg. 1 l. 6-12: after the traffic the borrowed blocks are vacant, so every
    layer is restored and every pool is back at its planned size."""
    sim = build_simulation(_spec(True))
    sim.run()
    led = ledger_of(sim.instances[0])
    assert led.remaps > 0 and led.restores == led.remaps
    assert all(a == 0 for a in led.alpha.values())
    assert [i.kv.capacity for i in sim.instances] == [i.cfg.kv_blocks for i in sim.instances]


def test_active_lender_limit_is_policy_limit():
    """The hook's model states give the policy's own limit (O4/O5 + cap)."""
    sim = build_simulation(_spec(True))
    sim.run()
    busy = sim.instances[0]
    h = busy.hooks[0]
    led = ledger_of(busy)
    st = h._state(led, busy)
    lim, _ = model_limit(st)
    assert lim <= h.cap and lim <= st.n_layers - 1


def test_oneiros_beats_static_on_small_case():
    base = run_spec(_spec(False)).summary["overall"]
    tech = run_spec(_spec(True)).summary["overall"]
    assert base["preemptions"] > 0
    assert tech["preemptions"] < base["preemptions"]
    assert tech["ttft_s"]["p99"] < 0.5 * base["ttft_s"]["p99"]
    assert tech["throughput_tokens_per_s"] >= base["throughput_tokens_per_s"] * 0.99


def test_hook_options_validated():
    import pytest

    sim = build_simulation(_spec(False))
    with pytest.raises(ValueError):
        OneirosHook(sim.instances[0], low_watermark_frac=0.5, high_watermark_frac=0.1)
    with pytest.raises(ValueError):
        OneirosHook(sim.instances[0], cap_fraction=1.0)


def test_shipped_oneiros_scenarios_load():
    for name in ("oneiros_c1.yaml", "oneiros_c2.yaml"):
        sc = load_scenario(REPO / "benchmark" / "sim" / "scenarios" / name)
        kinds = {n: [h for m in s.models for h, _ in m.hooks] for n, s in sc.variants}
        assert kinds["vllm-static"] == [] and set(kinds["oneiros"]) == {"oneiros"}
