"""Simulator layout: no import cycles under benchmark/ (every import counts:
module level, inside functions, under ``if TYPE_CHECKING:``), an explicit
registry, and one statistics shape for every mechanism object."""

import ast
import copy
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim import registry  # noqa: E402
from benchmark.sim.core.stats import (  # noqa: E402
    MECHANISM_STATS_KEYS,
    check_mechanism_stats,
    collect_mechanism_stats,
    mechanism_objects,
)
from benchmark.sim.runner import build_simulation, run_spec  # noqa: E402
from benchmark.sim.scenario import ScenarioError, parse_scenario  # noqa: E402
from support.imports import find_cycle, import_graph, module_files  # noqa: E402


# ---------------------------------------------------------------------------- import graph
def test_cycle_finder_sees_type_checking_function_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.sub import b\nfrom .c import x\n")
    files = module_files(pkg, "pkg")
    g = import_graph(files)
    assert g["pkg.a"] == {"pkg.sub.b"} and g["pkg.sub.b"] == {"pkg.c"} and g["pkg.c"] == {"pkg.a"}
    assert g["pkg.d"] == {"pkg.sub.b", "pkg.c"}
    cyc = find_cycle(g)
    assert cyc is not None and cyc[0] == cyc[-1] and set(cyc) == {"pkg.a", "pkg.sub.b", "pkg.c"}
    (pkg / "c.py").write_text("")
    assert find_cycle(import_graph(module_files(pkg, "pkg"))) is None


def test_no_import_cycle_under_benchmark():
    files = module_files(REPO / "benchmark", "benchmark")
    files = {m: p for m, p in files.items() if not m.startswith("benchmark.results")}
    assert "benchmark.sim.core.engine" in files and "benchmark.sim.mechanisms.ellm" in files
    graph = import_graph(files)
    assert "benchmark.sim.core.plan" in graph["benchmark.sim.core.engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_does_not_import_mechanisms_or_the_top_level():
    files = module_files(REPO / "benchmark" / "sim", "benchmark.sim")
    graph = import_graph(files)
    for mod, edges in graph.items():
        if mod.startswith("benchmark.sim.core"):
            bad = sorted(e for e in edges if not e.startswith("benchmark.sim.core"))
            assert bad == [], f"{mod} imports {bad}"
        if mod.startswith("benchmark.sim.mechanisms"):
            bad = sorted(e for e in edges if not e.startswith(("benchmark.sim.core", "benchmark.sim.mechanisms")))
            assert bad == [], f"{mod} imports {bad}"


def test_package_init_only_reexports():
    """``benchmark/sim/__init__.py`` imports nothing for a side effect: every
    name it imports is in ``__all__``; the subpackages import nothing."""
    sim = REPO / "benchmark" / "sim"
    tree = ast.parse((sim / "__init__.py").read_text())
    exported = set(importlib.import_module("benchmark.sim").__all__)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            raise AssertionError(f"bare import of {[a.name for a in node.names]} in benchmark/sim/__init__.py")
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert (alias.asname or alias.name) in exported, f"{alias.name} imported but not re-exported"
    for sub in ("core", "mechanisms"):
        t = ast.parse((sim / sub / "__init__.py").read_text())
        assert not [n for n in ast.walk(t) if isinstance(n, (ast.Import, ast.ImportFrom))], sub


def test_registry_is_a_literal_table():
    src = (REPO / "benchmark" / "sim").rglob("*.py")
    assert not [p for p in src if "def register_" in p.read_text()]
    with pytest.raises(TypeError):
        registry.SCHEDULERS["x"] = None  # read-only
    assert {"continuous", "vllm_v0", "ellm", "ellm_elastic", "fineserve", "governed", "governed_ellm"} == set(
        registry.SCHEDULERS
    )
    assert {"layer_streaming", "oneiros", "select_n", "flexgen_static", "swiftcache"} == set(registry.HOOKS)


# ---------------------------------------------------------------------------- unknown kinds

GOOD = {
    "name": "k",
    "duration_s": 2,
    "node": {"gpu": "H100-SXM"},
    "models": [{"name": "a", "model": "Qwen2.5-7B"}],
    "workloads": [{"model": "a", "arrival": {"kind": "poisson", "rate": 2}}],
}


def test_unknown_kinds_name_the_field():
    d = copy.deepcopy(GOOD)
    d["models"][0]["scheduler"] = {"kind": "magic"}
    with pytest.raises(ScenarioError, match=r"<t>: models\[0\]\.scheduler\.kind: expected one of continuous, ellm"):
        parse_scenario(d, "<t>")
    d = copy.deepcopy(GOOD)
    d["models"][0]["hooks"] = [{"kind": "oneiros"}, {"kind": "magic"}]
    with pytest.raises(ScenarioError, match=r"<t>: models\[0\]\.hooks\[1\]\.kind: expected one of flexgen_static"):
        parse_scenario(d, "<t>")
    # a spec built by hand (not through the loader) fails at the same field when built
    from dataclasses import replace

    spec = parse_scenario(GOOD, "<t>")
    bad = replace(spec, models=(replace(spec.models[0], scheduler="magic"),))
    with pytest.raises(ScenarioError, match=r"models\[0\]\.scheduler\.kind: unknown scheduler kind 'magic'"):
        build_simulation(bad)
    bad = replace(spec, models=(replace(spec.models[0], hooks=(("magic", {}),)),))
    with pytest.raises(ScenarioError, match=r"models\[0\]\.hooks\[0\]\.kind: unknown hook kind 'magic'"):
        build_simulation(bad)


# ---------------------------------------------------------------------------- mechanism stats


def _mechanism_modules():
    import benchmark.sim.mechanisms as pkg

    return [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]


def _mechanism_classes(mod):
    """Classes defined in ``mod`` that are schedulers (``plan``) or hooks (``before_iteration`` +
    ``after_iteration``), and the node arbiter. A wrapper that delegates to the scheduler it
    wraps (``__getattr__``; ``core.stats.mechanism_objects`` unwraps it) is not one."""
    out = []
    for _, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ != mod.__name__:
            continue
        is_sched = callable(getattr(cls, "plan", None)) and "__getattr__" not in vars(cls)
        is_hook = callable(getattr(cls, "before_iteration", None)) and callable(getattr(cls, "after_iteration", None))
        if is_sched or is_hook or cls.__name__ == "SimArbiter":
            out.append(cls)
    return out


def test_every_mechanism_module_has_objects_with_stats():
    mods = _mechanism_modules()
    names = {m.__name__.rpartition(".")[2] for m in mods}
    assert {"oneiros", "select_n", "ellm", "fineserve", "swiftcache", "arbiter", "layer_streaming"} <= names
    for mod in mods:
        classes = _mechanism_classes(mod)
        assert classes, f"{mod.__name__} defines no scheduler or hook"
        for cls in classes:
            assert callable(getattr(cls, "stats", None)), f"{mod.__name__}.{cls.__name__} has no stats()"
    # every kind in the registry is built by such a class (or is a stock baseline of core.batching)
    classes = {c for m in mods for c in _mechanism_classes(m)}
    for kind, factory in {**registry.SCHEDULERS, **registry.HOOKS}.items():
        assert kind in BASELINES or factory in classes, kind
    assert callable(getattr(registry.SCHEDULERS["vllm_v0"], "stats", None))


BASELINES = {"continuous", "vllm_v0"}  # stock-engine schedulers (core/batching.py), not paper mechanisms

MECHS = {
    "name": "mechs",
    "duration_s": 6,
    "drain_s": 60,
    "node": {"gpu": "H100-SXM", "count": 3},
    "models": [
        {"name": "a", "model": "Qwen2.5-7B", "gpu": 0, "scheduler": {"kind": "ellm"}, "hooks": [{"kind": "oneiros"}]},
        {
            "name": "b",
            "model": "Mistral-7B",
            "gpu": 0,
            "prefix_caching": False,
            "kv_memory_gb": 2.0,
            "slo": {"ttft_s": 0.5, "tpot_s": 0.05},
            "scheduler": {"kind": "ellm_elastic", "options": {"cpu_buffer_gb": 4}},
            "hooks": [{"kind": "oneiros"}],
        },
        {
            "name": "c",
            "model": "Llama-3.1-8B",
            "gpu": 1,
            "kv_memory_gb": 2.0,
            "hooks": [{"kind": "swiftcache", "options": {"tiers": ["peer", "host"], "workers": ["d"]}}],
        },
        {"name": "d", "model": "Qwen3-14B", "gpu": 2, "hooks": [{"kind": "select_n"}]},
    ],
    "workloads": [
        {"model": "a", "arrival": {"kind": "poisson", "rate": 8}},
        {"model": "b", "arrival": {"kind": "poisson", "rate": 8}, "input": {"kind": "fixed", "value": 1024}},
        {"model": "c", "arrival": {"kind": "poisson", "rate": 2}, "system_prompt_tokens": 4000},
        {"model": "d", "arrival": {"kind": "poisson", "rate": 4}},
    ],
}

FINE = {
    "name": "fine",
    "duration_s": 4,
    "drain_s": 60,
    "node": {"gpu": "H100-SXM"},
    "models": [
        {
            "name": "f1",
            "model": "Llama-3.1-8B",
            "slo": {"ttft_s": 1.0},
            "scheduler": {"kind": "fineserve"},
            "hooks": [{"kind": "flexgen_static"}],
        },
        {
            "name": "f2",
            "model": "Qwen2.5-7B",
            "slo": {"ttft_s": 1.0},
            "scheduler": {"kind": "fineserve", "options": {"batching": "prism"}},
            "hooks": [{"kind": "layer_streaming", "options": {"layers": 2}}],
        },
    ],
    "workloads": [
        {"model": "f1", "arrival": {"kind": "poisson", "rate": 4}},
        {"model": "f2", "arrival": {"kind": "poisson", "rate": 4}},
    ],
}


V0 = {
    "name": "v0",
    "duration_s": 4,
    "drain_s": 60,
    "node": {"gpu": "H100-SXM"},
    "models": [{"name": "v", "model": "Llama-3.1-8B", "kv_memory_gb": 0.5, "scheduler": {"kind": "vllm_v0"}}],
    "workloads": [{"model": "v", "arrival": {"kind": "poisson", "rate": 4}}],
}


GOV = {
    "name": "gov",
    "duration_s": 4,
    "drain_s": 60,
    "node": {"gpu": "H100-SXM"},
    "models": [
        {"name": "g", "model": "Llama-3.1-8B", "slo": {"tpot_s": 0.02}, "scheduler": {"kind": "governed"}},
        {"name": "ge", "model": "Llama-3.1-8B", "slo": {"tpot_s": 0.02}, "scheduler": {"kind": "governed_ellm"}},
    ],
    "workloads": [
        {"model": "g", "arrival": {"kind": "poisson", "rate": 8}},
        {"model": "ge", "arrival": {"kind": "poisson", "rate": 8}},
    ],
}


@pytest.fixture(scope="module")
def mechanism_runs():
    arb = copy.deepcopy(MECHS)
    arb["arbiter"] = {}
    runs = (("mechs", MECHS), ("arbiter", arb), ("fine", FINE), ("v0", V0), ("gov", GOV))
    return [run_spec(parse_scenario(d, f"<{n}>")) for n, d in runs]


def test_every_kind_reports_the_common_stats_shape(mechanism_runs):
    seen_kinds, seen_classes = set(), set()
    for r in mechanism_runs:
        for inst in r.sim.instances:
            objs = mechanism_objects(inst)
            stats = collect_mechanism_stats(inst)
            assert len(stats) == len(objs)
            for o, st in zip(objs, stats):
                check_mechanism_stats(st)
                assert tuple(st) == MECHANISM_STATS_KEYS
                assert st["instance"] == inst.cfg.name
                seen_kinds.add(st["kind"])
                seen_classes.add(type(o))
            # the runner's JSON carries exactly these, the same way for every instance
            assert r.summary["instances"][inst.cfg.name]["mechanisms"] == stats
        if r.sim.arbiter is not None:
            st = r.summary["arbiter"]
            check_mechanism_stats(st)
            assert st["mechanism"] == "arbiter" and st["instance"] == "node"
            assert st == r.sim.arbiter.stats()
    assert (set(registry.SCHEDULERS) | set(registry.HOOKS)) - {"continuous"} <= seen_kinds
    assert "arbiter" in seen_kinds
    mech_classes = {c for m in _mechanism_modules() for c in _mechanism_classes(m)} - {
        importlib.import_module("benchmark.sim.mechanisms.arbiter").SimArbiter
    }
    assert mech_classes <= seen_classes, mech_classes - seen_classes


def test_stats_shape_is_enforced():
    from benchmark.sim.core.stats import mechanism_stats

    good = mechanism_stats("m", "k", "i", {"n": 1}, {"g": 0.5}, {"x": [1]})
    assert list(good) == list(MECHANISM_STATS_KEYS)
    for bad in (
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "gauges"},
        {**good, "counters": {"n": "1"}},
        {**good, "counters": {"n": -1}},
        {**good, "gauges": {"g": True}},
        {**good, "mechanism": ""},
    ):
        with pytest.raises(ValueError):
            check_mechanism_stats(bad)
