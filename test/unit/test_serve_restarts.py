"""Restarts in ``sglang-memx serve`` without SGLang: the restart policy and budget, the
supervisor bringing back (or giving up on) a killed engine (tiny HTTP processes stand in for
engines), and the API key on the engines' command lines and never in ``--dry-run``'s output.
The router's side of a dead engine is ``test_serve_health.py``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from functools import partial

import pytest

from sglang_memx.serve.launcher import (
    AWAKE,
    DEAD,
    RESTARTING,
    Launcher,
    RestartBudget,
    RestartPolicy,
    describe_exit,
    engine_specs,
)
from support.fake_engine import fake_engine_spec
from support.waiting import wait_until

# ------------------------------------------------------------------ restart policy


def test_restart_budget_backs_off_exponentially_and_gives_up_within_the_window():
    b = RestartBudget(RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, backoff_max_s=3.0))
    delays = []
    for now in (0.0, 1.0, 2.0):
        delays.append(b.next_delay(now))
        b.record(now)
    assert delays == [1.0, 2.0, 3.0]  # 1, 2, then capped at backoff_max_s
    assert b.next_delay(50.0) is None  # three attempts within the window: dead
    assert b.next_delay(101.5) == 2.0  # two attempts left the window: one remains counted
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay(0.0) is None


def test_restart_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="backoff_s"):
        RestartPolicy(backoff_s=-0.5)


def test_describe_exit():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with status 3"


# ------------------------------------------------------------------ supervisor with fake engines


def fake_launcher(tmp_path, env=None) -> tuple[Launcher, list[str]]:
    """One fake engine "m" (GET /health; with $FAKE_MARKER, every start after the first exits 3)."""
    logs: list[str] = []
    return Launcher([fake_engine_spec(tmp_path, "m", env)], log=logs.append), logs


wait_for = partial(wait_until, timeout=20.0, interval=0.05)


def test_supervisor_restarts_a_killed_engine_on_the_same_port(tmp_path):
    launcher, logs = fake_launcher(tmp_path)
    try:
        launcher.start_all(20)
        e = launcher.engines["m"]
        assert e.state == AWAKE
        port, pid = e.port, e.pid
        launcher.supervise(RestartPolicy(backoff_s=0.2), startup_timeout_s=20, interval_s=0.05)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: e.state == RESTARTING)
        wait_for(lambda: e.state == AWAKE and e.restarts == 1)
        assert e.port == port and e.pid != pid and e.healthy()
        info = e.info()
        assert info["last_exit"] == "killed by SIGKILL" and info["restart_failures"] == 0
        assert 0.2 <= info["last_restart_s"] < 15 and info["restart_seconds_total"] == info["last_restart_s"]
        text = "\n".join(logs)
        assert "killed by SIGKILL" in text and "restarting m in 0.2 s" in text and "m restarted at" in text
        assert "restart of m" in (tmp_path / "m.log").read_text()  # the log is appended, not truncated
    finally:
        launcher.stop_all()
    assert not launcher.engines["m"].alive()


def test_a_restarted_engine_whose_health_takes_over_a_second_becomes_awake(tmp_path):
    """Upstream's /health sleeps a second before it answers: the supervisor's readiness probe
    must wait longer than that (it used a 1-second timeout, and a restarted engine stayed
    'restarting' for good), and must not stall the supervisor meanwhile."""
    launcher, logs = fake_launcher(tmp_path, env={"FAKE_HEALTH_DELAY_S": "1.2"})
    try:
        launcher.start_all(20)
        e = launcher.engines["m"]
        launcher.configure_restarts(RestartPolicy(backoff_s=0.05), startup_timeout_s=30)  # ticks driven here
        os.kill(e.pid, signal.SIGKILL)
        e.proc.wait(5)
        t0 = time.monotonic()
        while e.state != AWAKE or e.restarts == 0:
            tick0 = time.monotonic()
            launcher.tick(time.monotonic())  # as the supervisor thread runs it: never waits on a probe
            assert time.monotonic() - tick0 < 0.5 and e.state in (AWAKE, RESTARTING), e.info()
            assert time.monotonic() - t0 < 15, e.info()
            time.sleep(0.05)
        assert e.state == AWAKE and e.restarts == 1 and e.restart_failures == 0, e.info()
        assert 1.2 <= e.last_restart_s < 10
    finally:
        launcher.stop_all()


def test_supervisor_gives_up_after_max_restarts(tmp_path):
    launcher, logs = fake_launcher(tmp_path, env={"FAKE_MARKER": str(tmp_path / "started")})
    try:
        launcher.start_all(20)
        e = launcher.engines["m"]
        launcher.supervise(RestartPolicy(max_restarts=2, backoff_s=0.05), startup_timeout_s=20, interval_s=0.05)
        os.kill(e.pid, signal.SIGKILL)
        wait_for(lambda: e.state == DEAD)
        assert e.restarts == 0 and e.restart_failures == 2 and not e.alive()
        text = "\n".join(logs)
        assert text.count("failed (exited with status 3)") == 2 and "m is dead: 2 restart attempt(s)" in text
        time.sleep(0.3)
        assert e.state == DEAD and e.proc is None  # no further attempt
    finally:
        launcher.stop_all()


def test_api_key_reaches_every_engine_command_line(tmp_path):
    from sglang_memx.serve.config import parse_config
    from sglang_memx.serve.placement import plan_placement

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "torch_dtype": "float32", "head_dim": 16}))  # fmt: skip
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    doc = {"models": [{"name": "m", "path": str(model)}], "devices": [{"name": "cpu0", "memory_gb": 1}],
           "router": {"api_key": "sk-test"}}  # fmt: skip
    config = parse_config(doc)
    assert config.router.api_key == "sk-test" and config.router.host == "127.0.0.1"  # loopback by default
    [spec] = engine_specs(config, plan_placement(config), "t", api_key=config.router.api_key)
    argv = list(spec.argv)
    assert argv[argv.index("--api-key") + 1] == "sk-test"
    from sglang_memx.serve.config import ServeConfigError

    bad = dict(doc, models=[{"name": "m", "path": str(model), "server_args": ["--api-key", "x"]}])
    with pytest.raises(ServeConfigError, match=r"models\[0\].server_args\[0\]"):
        parse_config(bad)
    with pytest.raises(ServeConfigError, match="launch.max_restarts"):
        parse_config(dict(doc, launch={"max_restarts": -1}))


# ------------------------------------------------------------------ the API key on the command line


def test_dry_run_never_prints_the_api_key(tmp_path):
    import subprocess

    from support.fake_checkpoint import fake_model

    fake_model(tmp_path, "a")
    cfg = tmp_path / "models.yaml"
    cfg.write_text(
        "models:\n  - {name: a, path: a}\ndevices:\n  - {name: c, memory_gb: 1}\nrouter: {api_key: sk-file}\n"
    )
    for extra, key in (([], "sk-file"), (["--api-key", "sk-flag"], "sk-flag")):
        r = subprocess.run([sys.executable, "-m", "sglang_memx.serve", "--config", str(cfg), "--dry-run", *extra],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
        argv = json.loads(r.stdout)["argv"]
        assert argv[argv.index("--api-key") + 1] == "***" and key not in r.stdout + r.stderr
