"""`python -m sglang.launch_server` with --memx-* flags, as a user types them.

Argument parsing happens before any model is loaded, so no server comes up.
Importing upstream costs ~25 s of CPU, so the launcher runs are started
concurrently once per module, and the per-case checks run in one process
through the same calls launch_server makes (load_plugins, prepare_server_args).
"""

import json
import os
import subprocess
import sys

import pytest

from support.server import plugins_without_memx

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

BAD_CASES = [
    (["--memx-status-path", "relative"], "--memx-status-path", "absolute URL path"),
    (["--memx-status-path", "/generate"], "--memx-status-path", "upstream SGLang route"),
    (["--memx-disable", "--memx-status-path", "/x"], "--memx-disable", "contradicts --memx-status-path"),
    (["--memx-no-such-flag", "1"], None, "unrecognized arguments: --memx-no-such-flag"),
    (["--memx-pool", "gpu0"], "--memx-pool", "needs --memx-elastic-kv"),
    (["--memx-elastic-kv", "--memx-chunk-kb", "6"], "--memx-chunk-kb", "power of two"),
    (["--memx-elastic-kv", "--memx-pool-budget-gb", "-1"], "--memx-pool-budget-gb", "positive number"),
    (["--memx-host-buffer-gb", "1"], "--memx-host-buffer-gb", "needs --memx-elastic-kv"),
    (["--memx-torch-activations"], "--memx-torch-activations", "needs --memx-elastic-kv"),
    (
        ["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--memx-tpot-slo-ms", "50"],
        "--memx-ttft-slo-ms",
        "together with --memx-tpot-slo-ms",
    ),
    (["--memx-elastic-kv", "--memx-tpot-slo-scale", "10"], "--memx-tpot-slo-scale", "needs --memx-governor"),
    (
        ["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--disable-radix-cache"],
        "--memx-host-buffer-gb",
        "needs the radix cache",
    ),
    (
        ["--device", "cuda", "--memx-elastic-kv", "--memx-pool-budget-gb", "1", "--memx-weights", "remap"],
        "--memx-weights",
        "cannot run with CUDA graphs",
    ),
]
DEFAULTS = {
    "disabled": False,
    "status_path": "/memx/status",
    "elastic_kv": False,
    "pool": None,
    "pool_budget_gb": None,
    "pool_dir": None,
    "chunk_kb": 64,
    "torch_activations": False,
    "host_buffer_gb": None,
    "ttft_slo_ms": None,
    "tpot_slo_ms": None,
    "governor": False,
    "tpot_slo_scale": 20.0,
    "weights": "off",
    "weights_streamed": None,
    "prefetch_depth": None,
    "tbt_slo_ms": None,
    "weights_profile": None,
    "weights_idle_after_s": 30.0,
    "sleep_after_s": None,
    "peer_kv": "off",
    "peer_donate_max_gb": None,
    "peer_layer_stream": False,
}

PARSE_SCRIPT = r"""
import contextlib, io, json, pickle, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_memx.upstream.server_args import config_of
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            sa = prepare_server_args(["--model-path", "unused", *argv])
        clone = pickle.loads(pickle.dumps(sa))
        results.append({"code": 0, "config": config_of(clone).to_dict(), "stderr": err.getvalue()})
    except SystemExit as exc:
        results.append({"code": exc.code, "stderr": err.getvalue()})
print("RESULTS" + json.dumps(results))
"""


def _env(**extra):
    return dict(os.environ, SGLANG_USE_CPU_ENGINE="1", **extra)


@pytest.fixture(scope="module")
def runs():
    cases = [argv for argv, _, _ in BAD_CASES] + [["--memx-status-path", "/ops/memx"], []]
    procs = {
        "help": subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        ),
        "help_stock": subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(SGLANG_PLUGINS=plugins_without_memx()),
        ),
        "bad": subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", "unused", "--memx-status-path", "relative"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        ),
        "parse": subprocess.Popen(
            [sys.executable, "-c", PARSE_SCRIPT, json.dumps(cases)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        ),
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=360)
        out[name] = (p.returncode, stdout, stderr)
    rc, stdout, stderr = out["parse"]
    assert rc == 0, stderr[-3000:]
    out["cases"] = json.loads(stdout.split("RESULTS", 1)[1])
    return out


def test_help_shows_the_memx_group(runs):
    rc, stdout, _ = runs["help"]
    assert rc == 0
    assert "sglang-memx (integrated memory subsystem)" in stdout
    assert "--memx-status-path" in stdout and "--memx-disable" in stdout


def test_launcher_exits_2_naming_the_flag(runs):
    rc, _, stderr = runs["bad"]
    assert rc == 2, stderr[-2000:]
    assert "error: argument --memx-status-path: must be an absolute URL path" in stderr


@pytest.mark.parametrize("index", range(len(BAD_CASES)))
def test_bad_memx_values_exit_2_naming_the_flag(runs, index):
    _, flag, fragment = BAD_CASES[index]
    result = runs["cases"][index]
    assert result["code"] == 2, result["stderr"][-2000:]
    assert fragment in result["stderr"]
    if flag:
        assert f"error: argument {flag}: " in result["stderr"]


def test_config_reaches_server_args_and_survives_pickling(runs):
    good, default = runs["cases"][len(BAD_CASES) :]
    assert good["code"] == 0 and good["config"] == dict(DEFAULTS, status_path="/ops/memx")
    assert default["config"] == DEFAULTS
    assert "sglang-memx 0.1.0 active on sglang 0.5.23" in good["stderr"]


def test_filtering_the_plugin_out_removes_the_flags(runs):
    rc, stdout, _ = runs["help_stock"]
    assert rc == 0
    assert "--memx-" not in stdout and "--model-path" in stdout
