"""Simulator: strict scenario loader (errors name file and field) and CLI."""

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark.sim.cli import main  # noqa: E402
from benchmark.sim.runner import build_simulation  # noqa: E402
from benchmark.sim.scenario import ScenarioError, load_scenario  # noqa: E402

GOOD = {
    "name": "ok",
    "duration_s": 10,
    "node": {"gpu": "H100-SXM", "count": 2},
    "models": [
        {"name": "a", "model": "Llama-3.1-8B", "gpu": 0},
        {"name": "b", "model": "Qwen2.5-7B", "gpu": 1, "scheduler": {"kind": "ellm"}},
    ],
    "workloads": [{"model": "a", "arrival": {"kind": "poisson", "rate": 1}, "input": "alpaca_input"}],
    "variants": [{"name": "v", "set": {"models[*].block_size": 32}}],
}


def _write(tmp_path, data, name="s.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def _bad(tmp_path, mutate):
    d = copy.deepcopy(GOOD)
    mutate(d)
    p = _write(tmp_path, d)
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    assert str(p) in str(e.value)
    return str(e.value)


def test_good_file_loads_with_variants(tmp_path):
    sc = load_scenario(_write(tmp_path, GOOD))
    assert sc.base.models[1].scheduler == "ellm"
    assert [n for n, _ in sc.variants] == ["v"]
    assert all(m.block_size == 32 for m in sc.variants[0][1].models)
    assert sc.base.models[0].block_size == 16


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda d: d["models"][1].__setitem__("gpu", "x"), "models[1].gpu: expected int >= 0 and <= 1, got 'x'"),
        (lambda d: d["models"][1].__setitem__("gpu", 2), "models[1].gpu: expected int >= 0 and <= 1, got 2"),
        (lambda d: d["models"][0].__setitem__("colour", 1), "models[0].colour: unknown field"),
        (lambda d: d.__delitem__("duration_s"), "duration_s: required field is missing"),
        (lambda d: d.__setitem__("duration_s", -5), "duration_s: expected finite number > 0, got -5"),
        (lambda d: d["node"].__setitem__("gpu", "V100"), "node.gpu: expected one of"),
        (lambda d: d["models"][0].__setitem__("model", "GPT-5"), "models[0].model: expected one of"),
        (
            lambda d: d["models"][0].__setitem__("prefix_caching", "yes"),
            "models[0].prefix_caching: expected true or false",
        ),
        (
            lambda d: d["workloads"][0]["arrival"].__setitem__("kind", "zipf"),
            "workloads[0].arrival.kind: expected one of",
        ),
        (lambda d: d["workloads"][0].__setitem__("model", "c"), "workloads[0].model: expected one of a, b, got 'c'"),
        (
            lambda d: d["workloads"][0].__setitem__("input", "wiki"),
            "workloads[0].input: expected one of sharegpt_input",
        ),
        (lambda d: d["workloads"][0].__setitem__("input", {"kind": "fixed"}), "workloads[0].input.value: required"),
        (lambda d: d["workloads"][0].__setitem__("idle", [[5, 1]]), "workloads[0].idle[0]: expected [start_s, end_s]"),
        (lambda d: d["models"][1].__setitem__("name", "a"), "models[1].name: expected a unique name"),
        (
            lambda d: d["models"][0].__setitem__("scheduler", {"kind": "magic"}),
            "models[0].scheduler.kind: expected one of",
        ),
        (lambda d: d.__setitem__("models", []), "models: expected a non-empty list"),
        (
            lambda d: d["variants"][0]["set"].__setitem__("models[9].gpu", 0),
            "cannot set this path (index 9 out of range",
        ),
        (lambda d: d["variants"][0]["set"].__setitem__("models[*].gpu", "z"), "models[0].gpu: expected int"),
        (lambda d: d.__setitem__("sweep", {"rate_scale": [1, 0]}), "sweep.rate_scale[1]: expected number > 0"),
        (lambda d: d.__setitem__("arbiter", {"share_kv": 1}), "arbiter.share_kv: expected true or false"),
        (lambda d: d.__setitem__("arbiter", {"floor_fraction": 2}), "arbiter.floor_fraction: expected finite number"),
        (
            lambda d: d.__setitem__("arbiter", {"low_watermark_frac": 0.5, "high_watermark_frac": 0.1}),
            "arbiter.high_watermark_frac: expected number >= low_watermark_frac",
        ),
        (lambda d: d.__setitem__("arbiter", {"budget": 1}), "arbiter.budget: unknown field"),
        (lambda d: d.__setitem__("arbiter", True), "arbiter: expected a mapping"),
    ],
)
def test_malformed_fields_name_file_and_path(tmp_path, mutate, expect):
    assert expect in _bad(tmp_path, mutate)


def test_bad_json_yaml_and_missing_file(tmp_path):
    with pytest.raises(ScenarioError, match="not valid JSON"):
        load_scenario(_write(tmp_path, "{", "x.json"))
    with pytest.raises(ScenarioError, match="file not found"):
        load_scenario(tmp_path / "nope.json")
    with pytest.raises(ScenarioError, match="expected a .json"):
        load_scenario(_write(tmp_path, "a", "x.txt"))
    pytest.importorskip("yaml")
    with pytest.raises(ScenarioError, match=r"x.yaml: models\[0\].gpu: expected int"):
        load_scenario(
            _write(
                tmp_path,
                "name: y\nduration_s: 1\nnode: {gpu: A10}\nmodels:\n  - {name: a, model: Mistral-7B, gpu: x}\n",
                "x.yaml",
            )
        )


def test_model_that_does_not_fit_is_a_scenario_error(tmp_path):
    d = copy.deepcopy(GOOD)
    d["node"]["gpu"] = "A10"
    d["models"][0]["model"] = "Llama-2-13B"  # 26 GB of weights on a 24 GB card
    sc = load_scenario(_write(tmp_path, d))
    with pytest.raises(ScenarioError, match=r"models\[0\]: Llama-2-13B does not fit on gpu 0"):
        build_simulation(sc.base)


def test_cli_prints_error_and_exits_2(tmp_path, capsys):
    d = copy.deepcopy(GOOD)
    d["models"][0]["gpu"] = -1
    p = _write(tmp_path, d)
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}: models[0].gpu: expected int >= 0" in err


def test_cli_run_writes_json_and_png(tmp_path):
    d = copy.deepcopy(GOOD)
    d.pop("variants")
    out = tmp_path / "res"
    assert main(["run", str(_write(tmp_path, d)), "--out", str(out)]) == 0
    obj = json.loads(out.with_suffix(".json").read_text())
    assert obj["command"].startswith("python -m benchmark.sim run")
    assert obj["results"]["ok"][0]["overall"]["finished"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000


def test_arbiter_key_and_variants(tmp_path):
    d = copy.deepcopy(GOOD)
    d["arbiter"] = {"share_kv": False}
    d["variants"].append({"name": "free", "set": {"arbiter": None}})
    sc = load_scenario(_write(tmp_path, d))
    assert sc.base.arbiter is not None and not sc.base.arbiter.share_kv
    assert sc.base.arbiter.floor_fraction == 0.25
    v = dict(sc.variants)
    assert v["v"].arbiter == sc.base.arbiter and v["free"].arbiter is None
    sim = build_simulation(sc.base)
    assert sim.arbiter is not None and build_simulation(v["free"]).arbiter is None
    sim.run()
    sim.check()


def test_shipped_scenarios_load():
    files = sorted((REPO / "benchmark" / "sim" / "scenarios").glob("*.*"))
    assert files
    for f in files:
        if f.suffix in (".json", ".yaml", ".yml"):
            sc = load_scenario(f)
            assert sc.variants and sc.paper.get("figure")


def test_simulator_imports_neither_torch_nor_sglang():
    import ast

    bad = []
    for path in (REPO / "benchmark" / "sim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            )
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("torch", "sglang", "sglang_memx")]
    assert bad == []
