"""Hung engines in ``sglang-memx serve`` without SGLang: small HTTP processes stand in for
engines; one is SIGSTOPped (alive, answering nothing) or answers its health probe slowly.

The supervisor probes every awake engine (``HealthProbe``); ``failures`` probes in a row
without a 200 make it hung: killed (SIGKILL to its group) and restarted on its port like a
dead engine, while a slow engine that answers within the timeout is left alone."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from functools import partial
from pathlib import Path

import httpx
import pytest

from memory_ext.policy.edf_admission import EdfAdmission, ModelLimits
from sglang_memx.serve.admission import AdmissionGate
from sglang_memx.serve.launcher import (
    AWAKE,
    RESTARTING,
    HealthProbe,
    Launcher,
    RestartPolicy,
    process_running,
)
from sglang_memx.serve.metrics import RouterMetrics
from sglang_memx.serve.router import ENGINE_STATES, EngineRoute, build_app
from support.fake_engine import fake_engine_spec
from support.waiting import wait_until


def fake_launcher(tmp_path, names=("a", "b"), delay_s=0.0, burn=False) -> tuple[Launcher, list[str]]:
    specs = []
    for n in names:
        env = {"FAKE_PROBES": str(tmp_path / f"{n}.probes"), "FAKE_PROBE_DELAY_S": str(delay_s)}
        if burn:
            env["FAKE_PROBE_BURN"] = "1"
        specs.append(fake_engine_spec(tmp_path, n, env))
    logs: list[str] = []
    return Launcher(specs, log=logs.append), logs


def probes_of(tmp_path, name: str, pid: int) -> int:
    p = Path(tmp_path / f"{name}.probes")
    return p.read_text().split().count(str(pid)) if p.exists() else 0


wait_for = partial(wait_until, timeout=20.0, interval=0.02)


def test_health_probe_rejects_bad_values():
    for bad in ({"interval_s": 0}, {"timeout_s": -1.0}, {"failures": 0}, {"failures": True}, {"path": "health"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HealthProbe(**bad)


def test_sigstopped_engine_is_found_hung_killed_and_restarted_on_its_port_other_untouched(tmp_path):
    launcher, logs = fake_launcher(tmp_path)
    h = HealthProbe(interval_s=0.2, timeout_s=0.5, failures=3)
    try:
        launcher.start_all(20)
        a, b = launcher.engines["a"], launcher.engines["b"]
        port, pid, b_pid = a.port, a.pid, b.pid
        launcher.supervise(RestartPolicy(backoff_s=0.1), startup_timeout_s=20, interval_s=0.02, health=h)
        wait_for(lambda: probes_of(tmp_path, "a", pid) >= 2)  # probed and answering
        assert a.hangs == 0 and a.state == AWAKE
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: a.hangs == 1)
        took = time.monotonic() - t0
        # three probes in a row without an answer: each waits out its timeout (the first may have
        # started just before the stop), with an interval between them
        assert 2 * h.timeout_s + 2 * h.interval_s - 0.05 <= took < 3 * (h.timeout_s + h.interval_s) + 3.0, took
        wait_for(lambda: not process_running(pid), timeout=5)  # SIGKILLed although stopped
        assert a.last_exit.startswith("hung: no /memx/status answer for ")
        text = "\n".join(logs)
        assert f"a (pid {pid}, port {port}) is hung: no /memx/status answer for" in text
        assert "3 probes in a row failed, last: no answer in 0.5 s" in text and "SIGKILL" in text
        wait_for(lambda: a.state == AWAKE and a.restarts == 1)
        assert a.port == port and a.pid != pid and a.healthy()
        new_pid = a.pid
        wait_for(lambda: probes_of(tmp_path, "a", new_pid) >= 3)  # the new process is probed, answers
        assert a.hangs == 1 and a.state == AWAKE and a.pid == new_pid and a.probe_failures == 0
        assert b.pid == b_pid and b.state == AWAKE and b.restarts == 0 and b.hangs == 0  # untouched
        assert probes_of(tmp_path, "b", b_pid) >= 5  # probed all along
        info = a.info()
        assert info["hangs"] == 1 and info["last_exit"] == a.last_exit
        metrics = RouterMetrics(["a", "b"]).render({}, {"a": info, "b": b.info()}, ENGINE_STATES)
        assert 'memx_router_engine_hangs_total{model="a",replica="0"} 1' in metrics
        assert 'memx_router_engine_hangs_total{model="b",replica="0"} 0' in metrics
        assert 'memx_router_engine_restarts_total{model="a",replica="0"} 1' in metrics
    finally:
        launcher.stop_all()
    assert not any(e.alive() for e in launcher.engines.values())


def test_slow_engine_answering_within_the_timeout_is_not_killed(tmp_path):
    launcher, logs = fake_launcher(tmp_path, names=("a",), delay_s=0.4)  # every probe takes 0.4 s
    try:
        launcher.start_all(20)
        a = launcher.engines["a"]
        pid = a.pid
        launcher.supervise(RestartPolicy(backoff_s=0.1), startup_timeout_s=20, interval_s=0.02,
                           health=HealthProbe(interval_s=0.05, timeout_s=1.0, failures=2))  # fmt: skip
        wait_for(lambda: probes_of(tmp_path, "a", pid) >= 6)
        assert a.hangs == 0 and a.state == AWAKE and a.pid == pid and a.restarts == 0
        assert a.probe_failures == 0 and not any("hung" in m for m in logs)
    finally:
        launcher.stop_all()
    # the same engine with a timeout below its answer time: hung, killed, restarted
    launcher, logs = fake_launcher(tmp_path, names=("a",), delay_s=0.4)
    try:
        launcher.start_all(20)
        a = launcher.engines["a"]
        pid = a.pid
        launcher.supervise(RestartPolicy(backoff_s=0.1), startup_timeout_s=20, interval_s=0.02,
                           health=HealthProbe(interval_s=0.05, timeout_s=0.2, failures=2))  # fmt: skip
        wait_for(lambda: a.hangs >= 1)
        assert "last: no answer in 0.2 s" in "\n".join(logs)
        wait_for(lambda: a.restarts >= 1 and a.pid != pid)
    finally:
        launcher.stop_all()


def test_engine_computing_through_its_probes_is_busy_not_hung(tmp_path):
    # each probe costs the engine 1.2 s of CPU (one long forward on a slow core) against a 0.3 s
    # timeout: every probe fails, but the process group computes meanwhile
    launcher, logs = fake_launcher(tmp_path, names=("a",), delay_s=1.2, burn=True)
    try:
        launcher.start_all(20)
        a = launcher.engines["a"]
        pid = a.pid
        launcher.supervise(RestartPolicy(backoff_s=0.1), startup_timeout_s=20, interval_s=0.02,
                           health=HealthProbe(interval_s=0.05, timeout_s=0.3, failures=2))  # fmt: skip
        wait_for(lambda: a.busy_probes >= 3)
        assert a.hangs == 0 and a.state == AWAKE and a.pid == pid and a.probe_failures == 0
        assert "busy:" in a.last_probe_error and not any("hung" in m for m in logs)
        os.kill(pid, signal.SIGSTOP)  # the same engine stopped: no CPU, hung
        wait_for(lambda: a.hangs == 1)
        wait_for(lambda: a.restarts == 1 and a.pid != pid)
    finally:
        launcher.stop_all()


def test_request_in_flight_on_a_hung_engine_is_retried_on_the_restarted_engine(tmp_path):
    launcher, logs = fake_launcher(tmp_path)
    try:
        launcher.start_all(20)
        launcher.supervise(RestartPolicy(backoff_s=0.1), startup_timeout_s=20, interval_s=0.02,
                           health=HealthProbe(interval_s=0.1, timeout_s=0.3, failures=2))  # fmt: skip
        a, b = launcher.engines["a"], launcher.engines["b"]
        pid = a.pid
        routes = {n: EngineRoute(n, e.url, f"/models/{n}", device="cpu0") for n, e in launcher.engines.items()}
        limits = {n: ModelLimits(5.0, max_inflight=4, max_queued=4) for n in routes}
        gate = AdmissionGate(EdfAdmission(limits, hopeless_after_slo_x=4.0))
        app = build_app(routes, gate, engine_state=lambda n: launcher.engines[n].state,
                        engine_info=lambda n: launcher.engines[n].info(), monitor_interval_s=0.02,
                        failure_detect_s=2.0)  # fmt: skip

        async def scenario():
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=60) as c:
                    first = await c.post("/models/a/generate", json={"text": "x"})
                    assert first.status_code == 200 and first.json() == {"pid": pid}
                    os.kill(pid, signal.SIGSTOP)
                    r = await c.post("/models/a/generate", json={"text": "y"})  # waits on the stopped engine
                    other = await c.post("/models/b/generate", json={"text": "z"})
                    return r, other, (await c.get("/metrics")).text

        r, other, text = asyncio.run(scenario())
        assert a.hangs == 1 and a.restarts == 1 and a.state in (AWAKE, RESTARTING)
        assert r.status_code == 200 and r.json() == {"pid": a.pid} and a.pid != pid  # answered by the new process
        assert other.status_code == 200 and other.json() == {"pid": b.pid}
        assert 'memx_router_retries_total{model="a",result="ok"} 1' in text
        assert 'memx_router_engine_failures_total{model="a",streamed="false"} 1' in text
        assert 'memx_router_engine_hangs_total{model="a",replica="0"} 1' in text
    finally:
        launcher.stop_all()
