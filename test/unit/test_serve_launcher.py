"""Engine command lines from config + placement, and the command's config errors (nothing started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_memx.serve.config import ServeConfigError, parse_config
from sglang_memx.serve.cores import split_cores
from sglang_memx.serve.engine_specs import engine_specs, lending_omp_wait
from sglang_memx.serve.placement import GIB, plan_placement
from support.fake_checkpoint import fake_model


def _flag(argv, flag):
    return argv[argv.index(flag) + 1]


def test_models_on_one_device_share_its_pool_and_split_its_cores(tmp_path):
    for n in "ab":
        fake_model(tmp_path, n, weight_bytes=1 << 20)
    cfg = parse_config({
        "models": [{"name": "a", "path": "a", "dtype": "float32", "server_args": ["--attention-backend=sdpa"]},
                   {"name": "b", "path": "b", "server_args": ["--chunked-prefill-size", "64"]}],
        "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [2, 3, 4]}],
        "launch": {"pool_dir": str(tmp_path / "pools"), "memx_args": ["--memx-chunk-kb", "4"]},
    }, base_dir=tmp_path)  # fmt: skip
    p = plan_placement(cfg)
    a, b = engine_specs(cfg, p, run_id="7", ports={"a": 1001, "b": 1002}, python="py", log_dir=str(tmp_path))
    assert a.pool == b.pool == "serve-cpu0-7" and a.url == "http://127.0.0.1:1001"
    for s in (a, b):
        assert s.argv[:3] == ("py", "-m", "sglang.launch_server") and "--memx-elastic-kv" in s.argv
        assert _flag(s.argv, "--memx-pool") == "serve-cpu0-7" and _flag(s.argv, "--memx-pool-dir") == str(
            tmp_path / "pools"
        )
        assert abs(float(_flag(s.argv, "--memx-pool-budget-gb")) * GIB - p.devices["cpu0"].pool_budget_bytes) < 1
        assert _flag(s.argv, "--served-model-name") == s.model and s.env["SGLANG_USE_CPU_ENGINE"] == "1"
        assert _flag(s.argv, "--memx-chunk-kb") == "4"
    assert _flag(a.argv, "--dtype") == "float32" and "--dtype" not in b.argv
    assert "--attention-backend" not in a.argv and _flag(b.argv, "--attention-backend") == "torch_native"
    assert (a.env["SGLANG_CPU_OMP_THREADS_BIND"], b.env["SGLANG_CPU_OMP_THREADS_BIND"]) == ("2,3", "4")
    assert a.env["OMP_NUM_THREADS"] == "2"
    # the device's compute board: a busy engine computes on its idle sibling's cores too
    board = str(tmp_path / "pools" / "serve-cpu0-7.compute")
    assert (a.env["MEMX_COMPUTE_BOARD"], b.env["MEMX_COMPUTE_BOARD"]) == (board, board)
    assert (a.env["MEMX_COMPUTE_SLOT"], b.env["MEMX_COMPUTE_SLOT"]) == ("0", "1")
    assert a.env["MEMX_COMPUTE_SHARES"] == b.env["MEMX_COMPUTE_SHARES"] == "2,3;4"
    static = parse_config({
        "models": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
        "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [2, 3, 4], "lend_idle_cores": False}],
    }, base_dir=tmp_path)  # fmt: skip
    for s in engine_specs(static, plan_placement(static), run_id="8", python="py", log_dir=str(tmp_path)):
        assert "MEMX_COMPUTE_BOARD" not in s.env and s.env["OMP_NUM_THREADS"] in ("2", "1")
    alone = parse_config({"models": [{"name": "a", "path": "a"}], "devices": [{"name": "cpu0", "memory_gb": 0.5}]},
                         base_dir=tmp_path)  # fmt: skip
    (spec,) = engine_specs(alone, plan_placement(alone), run_id="9", python="py", log_dir=str(tmp_path))
    assert "MEMX_COMPUTE_BOARD" not in spec.env  # one engine on the device: nothing to lend


@pytest.mark.parametrize("environ,own_cores,hidden,expected", [
    ({}, 1, 32, {"OMP_WAIT_POLICY": "PASSIVE"}),  # ops too small to split: the second thread sleeps
    ({}, 1, 0, {"OMP_WAIT_POLICY": "PASSIVE"}),  # width unknown: as the narrow models
    ({}, 1, 255, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({}, 1, 256, {"GOMP_SPINCOUNT": "10000"}),  # a short spin, no futex wake-up per parallel region
    ({}, 1, 576, {"GOMP_SPINCOUNT": "10000"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 1, 32, {}),  # the user's choice stands
    ({"GOMP_SPINCOUNT": "300000"}, 1, 576, {}),
    ({"OMP_NUM_THREADS": "2"}, 1, 32, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({}, 2, 576, {}),  # a team on its own cores waits as stock's would
])  # fmt: skip
def test_lending_omp_wait_by_width_on_one_own_core_unless_the_user_set_it(environ, own_cores, hidden, expected):
    assert lending_omp_wait(environ, own_cores, hidden) == expected


def test_only_engines_that_may_borrow_cores_get_a_lending_omp_wait_by_their_width(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    fake_model(tmp_path, "a", weight_bytes=1 << 20, hidden=64)
    fake_model(tmp_path, "b", weight_bytes=1 << 20, hidden=576)
    doc = {"models": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}],
           "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1]}]}  # fmt: skip

    def specs(run_id: str):
        cfg = parse_config(doc, base_dir=tmp_path)
        return engine_specs(cfg, plan_placement(cfg), run_id=run_id, python="py", log_dir=str(tmp_path))

    narrow, wide = specs("1")
    assert narrow.env.get("OMP_WAIT_POLICY") == "PASSIVE" and "GOMP_SPINCOUNT" not in narrow.env
    assert wide.env.get("GOMP_SPINCOUNT") == "10000" and "OMP_WAIT_POLICY" not in wide.env
    doc["devices"][0]["lend_idle_cores"] = False
    assert all(not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(s.env) for s in specs("2"))  # stock's own cores
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    doc["devices"][0]["lend_idle_cores"] = True
    assert all(not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(s.env) for s in specs("3"))  # the user's instead
    monkeypatch.delenv("OMP_WAIT_POLICY")
    doc["devices"][0]["cores"] = [0, 1, 2, 3]
    two_each = specs("4")
    assert [s.env["OMP_NUM_THREADS"] for s in two_each] == ["2", "2"]
    assert all(not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(s.env) for s in two_each)  # libgomp's default


def test_split_cores():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0], 3) == [[0], [0], [0]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]


def _serve(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sglang_memx.serve", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)  # fmt: skip


def test_bad_config_exits_2_naming_the_field(tmp_path):
    fake_model(tmp_path, "a")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: a}\n  - {name: a, path: a}\ndevices:\n  - {name: c, memory_gb: 1}\n")
    r = _serve("--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "sglang-memx serve: error: models[1].name: duplicate 'a'"
    assert not (tmp_path / "sglang-memx-serve-logs").exists()  # nothing started


def test_dry_run_prints_the_plan(tmp_path):
    fake_model(tmp_path, "a")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: a}\ndevices:\n  - {name: c, memory_gb: 1}\n")
    r = _serve("--config", str(cfg), "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    [line] = r.stdout.splitlines()
    assert json.loads(line)["model"] == "a" and "c (cpu): a" in r.stderr


def test_a_sleeping_model_gets_remappable_weights_and_its_weights_count_in_the_pool(tmp_path):
    for n in "ab":
        fake_model(tmp_path, n, weight_bytes=1 << 20)
    doc = {"models": [{"name": "a", "path": "a"}, {"name": "b", "path": "b", "sleep_after_s": 30}],
           "devices": [{"name": "cpu0", "memory_gb": 0.5}]}  # fmt: skip
    cfg = parse_config(doc, base_dir=tmp_path)
    p = plan_placement(cfg)
    a, b = engine_specs(cfg, p, run_id="7", ports={"a": 1001, "b": 1002}, python="py", log_dir=str(tmp_path))
    assert "--memx-weights" not in a.argv and "--memx-sleep-after-s" not in a.argv
    assert _flag(b.argv, "--memx-weights") == "remap" and float(_flag(b.argv, "--memx-sleep-after-s")) == 30.0
    sizes = {n: p.models[n].size.weight_bytes for n in "ab"}
    assert p.devices["cpu0"].pool_budget_bytes == int(0.5 * GIB) - sizes["a"]  # b's weights live in the pool
    with pytest.raises(ServeConfigError, match=r"models\[1\]\.sleep_after_s"):
        parse_config({**doc, "models": [doc["models"][0], {**doc["models"][1], "sleep_after_s": -1}]},
                     base_dir=tmp_path)  # fmt: skip


def test_two_replicas_are_two_engines_on_distinct_ports_in_the_same_pool(tmp_path):
    for n in "ab":
        fake_model(tmp_path, n, weight_bytes=1 << 20)
    cfg = parse_config({
        "models": [{"name": "a", "path": "a", "min_replicas": 2}, {"name": "b", "path": "b"}],
        "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1, 2]}],
    }, base_dir=tmp_path)  # fmt: skip
    p = plan_placement(cfg)
    specs = engine_specs(cfg, p, run_id="7", python="py", log_dir=str(tmp_path))
    assert [(s.model, s.replica, s.key) for s in specs] == [("a", 0, "a"), ("a", 1, "a#1"), ("b", 0, "b")]
    a0, a1, b = specs
    assert len({s.port for s in specs}) == 3 and all(_flag(s.argv, "--port") == str(s.port) for s in specs)
    assert len({s.log_path for s in specs}) == 3 and a1.log_path.endswith("a.replica1.log")
    assert a0.pool == a1.pool == b.pool == "serve-cpu0-7"
    assert _flag(a0.argv, "--memx-pool-budget-gb") == _flag(a1.argv, "--memx-pool-budget-gb")
    assert _flag(a1.argv, "--served-model-name") == "a"  # a replica serves the model under its name
    binds = [s.env["SGLANG_CPU_OMP_THREADS_BIND"] for s in specs]
    assert sorted(binds) == ["0", "1", "2"]  # every engine on a core of its own
    pinned = engine_specs(cfg, p, run_id="7", ports={"a": 1001, "a#1": 1002}, python="py", log_dir=str(tmp_path))
    assert (pinned[0].port, pinned[1].port) == (1001, 1002)
    from sglang_memx.serve.launcher import Launcher

    assert list(Launcher(specs).engines) == ["a", "a#1", "b"]


def test_dry_run_prints_one_line_per_replica_and_refuses_replicas_that_do_not_fit(tmp_path):
    fake_model(tmp_path, "a", weight_bytes=1 << 20)
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: a, min_replicas: 2}\ndevices:\n  - {name: c, memory_gb: 1}\n")
    r = _serve("--config", str(cfg), "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["model"], x["engine"], x["replica"]) for x in lines] == [("a", "a", 0), ("a", "a#1", 1)]
    assert _flag(lines[0]["argv"], "--port") != _flag(lines[1]["argv"], "--port")
    cfg.write_text("models:\n  - {name: a, path: a, min_replicas: 2}\ndevices:\n  - {name: c, memory_gb: 0.0015}\n")
    r = _serve("--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2 and "models[0].min_replicas: replica 2 of 2" in r.stderr, r.stderr
    assert not (tmp_path / "sglang-memx-serve-logs").exists()  # nothing started


def test_a_models_tpot_slo_reaches_its_engines_and_no_slo_passes_nothing(tmp_path):
    for n in "ab":
        fake_model(tmp_path, n, weight_bytes=1 << 20)
    cfg = parse_config({
        "models": [{"name": "a", "path": "a"}, {"name": "b", "path": "b", "tpot_slo_ms": 80, "min_replicas": 2}],
        "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1, 2]}],
    }, base_dir=tmp_path, source=str(tmp_path / "serve.yaml"))  # fmt: skip
    a, b0, b1 = engine_specs(cfg, plan_placement(cfg), run_id="7", python="py", log_dir=str(tmp_path))
    # no SLO: neither the flag nor its source; the engine's governor is not registered (stock batching)
    assert "--memx-tpot-slo-ms" not in a.argv and "SGLANG_MEMX_TPOT_SLO_SOURCE" not in a.env
    for b in (b0, b1):  # every replica's engine gets the model's SLO and where it came from
        assert b.argv.count("--memx-tpot-slo-ms") == 1 and float(_flag(b.argv, "--memx-tpot-slo-ms")) == 80.0
        assert b.env["SGLANG_MEMX_TPOT_SLO_SOURCE"] == "serve.yaml: models[1].tpot_slo_ms"
        assert "--memx-elastic-kv" in b.argv  # the governor runs on elastic KV's coordinator
    import argparse

    from sglang_memx.config import MemxConfig, add_memx_arguments, tpot_slo_source

    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    for spec, want in ((a, None), (b0, 80.0)):  # what the engine's own flag parsing makes of its argv
        assert MemxConfig.from_namespace(parser.parse_known_args(list(spec.argv[3:]))[0]).tpot_slo_ms == want
    assert tpot_slo_source(b0.env) == "serve.yaml: models[1].tpot_slo_ms" and tpot_slo_source(a.env) == (
        "--memx-tpot-slo-ms"
    )
    nameless = parse_config({"models": [{"name": "b", "path": "b", "tpot_slo_ms": 0.5}],
                             "devices": [{"name": "cpu0", "memory_gb": 0.5}]}, base_dir=tmp_path)  # fmt: skip
    (spec,) = engine_specs(nameless, plan_placement(nameless), run_id="9", python="py", log_dir=str(tmp_path))
    assert spec.env["SGLANG_MEMX_TPOT_SLO_SOURCE"] == "models.yaml: models[0].tpot_slo_ms"
    assert _flag(spec.argv, "--memx-tpot-slo-ms") == "0.5"


def test_with_a_host_buffer_the_models_ttft_slo_reaches_the_governed_engine_too(tmp_path):
    """The host buffer's rule needs both SLOs: a governed engine with a host buffer gets the model's
    ``ttft_slo_ms`` as ``--memx-ttft-slo-ms`` (and its source), unless its args give one."""
    import argparse

    from sglang_memx.config import MemxConfig, add_memx_arguments, ttft_slo_source

    for n in "abc":
        fake_model(tmp_path, n, weight_bytes=1 << 20)
    cfg = parse_config({
        "models": [{"name": "a", "path": "a", "ttft_slo_ms": 700},  # no TPOT SLO: no governor, no flag
                   {"name": "b", "path": "b", "tpot_slo_ms": 80, "ttft_slo_ms": 700},
                   {"name": "c", "path": "c", "tpot_slo_ms": 80, "server_args": ["--memx-ttft-slo-ms", "900"]}],
        "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1, 2]}],
        "launch": {"memx_args": ["--memx-host-buffer-gb", "1"]},
    }, base_dir=tmp_path, source=str(tmp_path / "serve.yaml"))  # fmt: skip
    a, b, c = engine_specs(cfg, plan_placement(cfg), run_id="7", python="py", log_dir=str(tmp_path))
    assert "--memx-ttft-slo-ms" not in a.argv and "SGLANG_MEMX_TTFT_SLO_SOURCE" not in a.env
    assert b.argv.count("--memx-ttft-slo-ms") == 1 and float(_flag(b.argv, "--memx-ttft-slo-ms")) == 700.0
    assert ttft_slo_source(b.env) == "serve.yaml: models[1].ttft_slo_ms"
    assert c.argv.count("--memx-ttft-slo-ms") == 1 and _flag(c.argv, "--memx-ttft-slo-ms") == "900"
    assert ttft_slo_source(c.env) == "--memx-ttft-slo-ms"
    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    cfg_b = MemxConfig.from_namespace(parser.parse_known_args(list(b.argv[3:]))[0])
    cfg_b.validate()  # the engine accepts the pair it gets
    assert (cfg_b.ttft_slo_ms, cfg_b.tpot_slo_ms, cfg_b.host_buffer_gb) == (700.0, 80.0, 1.0)
