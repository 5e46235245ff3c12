"""An arbiter started under ``sglang-memx serve`` ends with it (``--owner-pid``): a SIGKILLed
``serve`` (its engines die with it by PR_SET_PDEATHSIG) leaves no pool holding memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memory_ext.pool.arbiter_client import ArbiterClient, ArbiterError, query_arbiter_status
from memory_ext.vmm import host_backend
from sglang_memx.config import POOL_OWNER_ENV, MemxConfigError, pool_owner_pid


def _arbiter(tmp: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "memory_ext.pool.arbiter", "--socket", str(tmp / "p.sock"), "--budget-chunks", "8",
           "--granularity-kib", "4", "--pid-file", str(tmp / "p.pid"), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_answering(sock: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            query_arbiter_status(sock)
            return
        except (OSError, ArbiterError):
            assert time.monotonic() - t0 < timeout, "arbiter did not answer"
            time.sleep(0.05)


def test_the_pool_ends_when_its_owner_is_killed_and_frees_what_clients_held(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    arb = _arbiter(tmp_path, "--owner-pid", str(owner.pid))
    backend = host_backend(4096, name="test-owner")
    client = None
    try:
        _wait_answering(tmp_path / "p.sock", arb)
        client = ArbiterClient(tmp_path / "p.sock", "survivor", backend)
        assert len(client.borrow(3)) == 3
        time.sleep(1.0)
        assert arb.poll() is None  # the owner is alive: the pool serves on
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        out, _ = arb.communicate(timeout=20)
        assert arb.returncode == 0, out
        assert f"owner pid {owner.pid} exited: stopping the pool" in out
        assert not (tmp_path / "p.pid").exists() and not (tmp_path / "p.sock").exists()
    finally:
        if client is not None:
            client.close()
        backend.close()
        for p in (owner, arb):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_owner_that_is_already_gone_stops_the_pool_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    arb = _arbiter(tmp_path, "--owner-pid", str(gone.pid))
    out, _ = arb.communicate(timeout=60)
    assert arb.returncode == 0 and f"owner pid {gone.pid} exited: stopping the pool" in out, out


def test_without_an_owner_the_pool_outlives_its_starter(tmp_path):
    arb = _arbiter(tmp_path)
    try:
        _wait_answering(tmp_path / "p.sock", arb)
        time.sleep(1.0)
        assert arb.poll() is None
    finally:
        arb.terminate()
        arb.wait(20)


def test_a_bad_owner_pid_is_refused_naming_the_option(tmp_path):
    arb = _arbiter(tmp_path, "--owner-pid", "0")
    out, _ = arb.communicate(timeout=60)
    assert arb.returncode == 2 and "--owner-pid" in out, out


@pytest.mark.parametrize("raw", ["abc", "-3", "0", "1.5"])
def test_the_owner_variable_is_a_positive_pid_or_named(raw):
    with pytest.raises(MemxConfigError) as e:
        pool_owner_pid({POOL_OWNER_ENV: raw})
    assert POOL_OWNER_ENV in str(e.value)


def test_the_owner_variable_unset_or_set():
    assert pool_owner_pid({}) is None and pool_owner_pid({POOL_OWNER_ENV: ""}) is None
    assert pool_owner_pid({POOL_OWNER_ENV: str(os.getpid())}) == os.getpid()


def test_serve_gives_its_engines_its_own_pid_as_the_pool_owner(tmp_path):
    from sglang_memx.serve.config import parse_config
    from sglang_memx.serve.launcher import engine_specs
    from sglang_memx.serve.placement import plan_placement
    from support.fake_checkpoint import fake_model

    fake_model(tmp_path, "a", weight_bytes=1 << 20)
    cfg = parse_config({"models": [{"name": "a", "path": "a"}], "devices": [{"name": "cpu0", "memory_gb": 0.5}],
                        "launch": {"pool_dir": str(tmp_path / "pools")}}, base_dir=tmp_path)  # fmt: skip
    [spec] = engine_specs(cfg, plan_placement(cfg), run_id="1", ports={"a": 1001}, python="py",
                          log_dir=str(tmp_path))  # fmt: skip
    assert spec.env[POOL_OWNER_ENV] == str(os.getpid())
