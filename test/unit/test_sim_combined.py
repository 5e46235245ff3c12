"""X1 combined scenario: every mechanism acts in the combined run."""

from dataclasses import replace

from benchmark.sim import load_scenario
from benchmark.sim.combined import AVAILABLE, mechanism_counters
from benchmark.sim.runner import build_simulation


def test_combined_run_uses_every_mechanism():
    sc = load_scenario("benchmark/sim/scenarios/combined_x1.yaml")
    v = dict(sc.variants)
    assert {"stock", "oneiros", "select_n", "ellm", "swiftcache", "combined"} <= set(v)
    spec = v["combined"]
    kinds = {k for m in spec.models for k, _ in m.hooks} | {m.scheduler for m in spec.models}
    assert {"oneiros", "select_n", "swiftcache", "ellm"} <= kinds
    sim = build_simulation(replace(spec, duration_s=40.0, drain_s=60.0)).run()
    sim.check()
    c = mechanism_counters(sim)
    assert c["swiftcache_lent_blocks_max"] > 0
    assert c["select_n_host_layers"] > 0
    assert all(AVAILABLE.values())


def test_stock_variant_uses_no_mechanism():
    sc = load_scenario("benchmark/sim/scenarios/combined_x1.yaml")
    sim = build_simulation(replace(dict(sc.variants)["stock"], duration_s=20.0, drain_s=30.0)).run()
    c = mechanism_counters(sim)
    assert all(v == 0 for v in c.values()), c
