"""``sglang-memx serve`` with a model at tensor parallel size > 1 (``--tp N`` in its ``server_args``,
``serve.tensor_parallel``): on a CPU device its share of the cores is split into one group per rank
and upstream stays on gloo; refused, naming the field, where it cannot run (fewer cores than ranks,
a CUDA device, with sleep, a bad value)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_memx.serve.config import ServeConfigError, parse_config
from sglang_memx.serve.engine_specs import engine_specs
from sglang_memx.serve.placement import plan_placement
from sglang_memx.serve.tensor_parallel import NO_NCCL, rank_core_env, tensor_parallel_size
from support.fake_checkpoint import fake_model


def _specs(tmp_path, models, devices):
    for m in models:
        fake_model(tmp_path, m["path"], weight_bytes=1 << 20)
    cfg = parse_config({"models": models, "devices": devices}, base_dir=tmp_path)
    return engine_specs(cfg, plan_placement(cfg), run_id="7", python="py", log_dir=str(tmp_path))


@pytest.mark.parametrize(
    "args,size",
    [([], 1), (["--tp", "2"], 2), (["--tp=4"], 4), (["--tp-size", "2"], 2), (["--tensor-parallel-size=2"], 2),
     (["--tp", "2", "--chunked-prefill-size", "64", "--tp", "1"], 1)],
)  # fmt: skip
def test_the_size_is_read_with_upstreams_spellings(args, size):
    assert tensor_parallel_size("models[0].server_args", args) == size


@pytest.mark.parametrize("args,field", [(["--tp", "two"], "models[0].server_args[0]"),
                                        (["--dtype", "float32", "--tp=0"], "models[0].server_args[2]"),
                                        (["--tp"], "models[0].server_args[0]")])  # fmt: skip
def test_a_bad_size_names_the_field(args, field):
    with pytest.raises(ServeConfigError) as info:
        tensor_parallel_size("models[0].server_args", args)
    assert str(info.value).startswith(field + ":")


def test_a_tp2_model_gets_a_core_group_per_rank_and_gloo_and_its_device_no_lending(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_NCCL_SO_PATH", raising=False)
    a, b = _specs(tmp_path, [{"name": "a", "path": "a", "server_args": ["--tp", "2"]}, {"name": "b", "path": "b"}],
                  [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1, 2, 3, 4]}])  # fmt: skip
    assert a.env["SGLANG_CPU_OMP_THREADS_BIND"] == "0,1|2" and a.env["OMP_NUM_THREADS"] == "1"
    assert a.env["SGLANG_NCCL_SO_PATH"] == NO_NCCL and "--tp" in a.argv  # the user's flag reaches upstream
    assert b.env["SGLANG_CPU_OMP_THREADS_BIND"] == "3,4" and "SGLANG_NCCL_SO_PATH" not in b.env
    assert "MEMX_COMPUTE_BOARD" not in a.env and "MEMX_COMPUTE_BOARD" not in b.env  # a rank's cores are its own
    assert "--memx-pool" in a.argv  # the device's shared pool: every rank a client of its arbiter


def test_the_users_nccl_path_wins():
    env = rank_core_env("models[0].server_args", "cpu0", [4, 5, 6, 7], 2, {"SGLANG_NCCL_SO_PATH": "x"})
    assert env == {"SGLANG_CPU_OMP_THREADS_BIND": "4,5|6,7", "OMP_NUM_THREADS": "2"}


def test_fewer_cores_than_ranks_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ServeConfigError) as info:
        _specs(tmp_path, [{"name": "a", "path": "a"}, {"name": "b", "path": "b", "server_args": ["--tp", "2"]}],
               [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1]}])  # fmt: skip
    msg = str(info.value)
    assert msg.startswith("models[1].server_args: --tp 2 runs a rank on cores of its own") and "'cpu0' is 1 core" in msg


def test_a_cuda_device_and_sleep_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ServeConfigError, match=r"^models\[0\].server_args: --tp 2 needs 2 GPUs"):
        _specs(tmp_path, [{"name": "a", "path": "a", "server_args": ["--tp", "2"]}],
               [{"name": "gpu0", "kind": "cuda", "memory_gb": 0.5}])  # fmt: skip
    with pytest.raises(ServeConfigError, match=r"^models\[0\].sleep_after_s: memx does not run sleep at --tp 2"):
        _specs(tmp_path, [{"name": "a", "path": "a", "server_args": ["--tp", "2"], "sleep_after_s": 30}],
               [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1]}])  # fmt: skip


def test_serve_exits_2_naming_the_field_before_starting_anything(tmp_path):
    fake_model(tmp_path, "a")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: a, server_args: [--tp, '4']}\n"
                   "devices:\n  - {name: c, memory_gb: 1, cores: [0, 1]}\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "sglang_memx.serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("sglang-memx serve: error: models[0].server_args: --tp 4")
    assert not (tmp_path / "sglang-memx-serve-logs").exists()  # nothing started


def test_emit_refuses_a_tensor_parallel_model_naming_the_field(tmp_path):
    from sglang_memx.serve import emit

    fake_model(tmp_path, "a", weight_bytes=1 << 20)
    doc = {"models": [{"name": "a", "path": "a", "server_args": ["--tp", "2"]}],
           "devices": [{"name": "cpu0", "memory_gb": 0.5, "cores": [0, 1]}]}  # fmt: skip
    cfg = parse_config(doc, base_dir=tmp_path)
    with pytest.raises(ServeConfigError, match=r"^models\[0\].server_args: --tp 2: --emit does not write"):
        emit.model_units(cfg, plan_placement(cfg), emit.EmitOptions())
