"""Health of ``sglang-memx serve`` without SGLang: restart policy and supervisor (tiny HTTP
processes stand in for engines), the router's behaviour when an engine dies, its
Prometheus metrics, the API key, and the router section of ``sglang-memx top``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from functools import partial

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from memory_ext.policy.edf_admission import ENGINE_RESTARTING, EdfAdmission, ModelLimits
from sglang_memx.serve.admission import AdmissionGate
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
from sglang_memx.serve.metrics import Histogram, RouterMetrics
from sglang_memx.serve.router import ENGINE_STATES, EngineRoute, build_app
from sglang_memx.top import render
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


# ------------------------------------------------------------------ the router when an engine dies


class FailingStream(httpx.AsyncByteStream):
    """A response body that yields ``chunks`` (``gap_s`` apart) and then breaks like a killed
    engine's connection (or ends normally with ``fail=False``)."""

    def __init__(self, chunks, gap_s=0.0, fail=True):
        self.chunks, self.gap_s, self.fail = chunks, gap_s, fail

    async def __aiter__(self):
        for c in self.chunks:
            yield c
            await asyncio.sleep(self.gap_s)
        if self.fail:
            raise httpx.ReadError("connection reset by peer")

    async def aclose(self):
        pass


class EngineTransport(httpx.AsyncBaseTransport):
    """An engine: ``mode`` ok (answers through ``app``), refuse (dies before any byte: the
    connection breaks and ``on_fail`` runs), midstream (SSE: two events, then breaks),
    midbody (JSON: half a body, then breaks), sse (four events 20 ms apart, then [DONE])."""

    def __init__(self, app, on_fail=None):
        self.inner = httpx.ASGITransport(app=app)
        self.mode = "ok"
        self.on_fail = on_fail
        self.seen: list[httpx.Request] = []

    async def handle_async_request(self, request):
        self.seen.append(request)
        if self.mode == "refuse":
            if self.on_fail:
                self.on_fail()
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if self.mode == "midstream":
            events = [b'data: {"i": 0}\n\n', b'data: {"i": 1}\n\n']
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=FailingStream(events))
        if self.mode == "sse":
            events = [f"data: {json.dumps({'i': i})}\n\n".encode() for i in range(4)] + [b"data: [DONE]\n\n"]
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=FailingStream(events, gap_s=0.02, fail=False))  # fmt: skip
        if self.mode == "midbody":
            return httpx.Response(200, headers={"content-type": "application/json"},
                                  stream=FailingStream([b'{"text": "hal']))  # fmt: skip
        return await self.inner.handle_async_request(request)


def engine_app(tag: str) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        return {"text": f"{tag}:{body['text']}", "auth": request.headers.get("authorization")}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("stream"):

            async def events():
                for i in range(4):
                    await asyncio.sleep(0.01)
                    yield f"data: {json.dumps({'i': i})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"engine": tag}

    @app.get("/get_model_info")
    async def info():
        return {"model_path": tag}

    return app


def run(scenario, states=None, limits=None, api_key=None, info=None, hopeless=4.0):
    states = states if states is not None else {"a": AWAKE, "b": AWAKE}
    engines = {n: EngineTransport(engine_app(n.upper())) for n in ("a", "b")}
    routes = {n: EngineRoute(n, f"http://engine-{n}", f"/models/{n}", device="cpu0", tpot_slo_s=0.005)
              for n in engines}  # fmt: skip
    mounts = {f"http://engine-{n}": t for n, t in engines.items()}
    limits = limits or {n: ModelLimits(1.0, max_inflight=4, max_queued=4) for n in engines}
    gate = AdmissionGate(EdfAdmission(limits, hopeless_after_slo_x=hopeless))
    app = build_app(routes, gate, engine_state=lambda n: states[n], engine_info=info, api_key=api_key,
                    monitor_interval_s=0.01, failure_detect_s=0.5, client_kwargs={"mounts": mounts})  # fmt: skip

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
                return await scenario(c, engines, states)

    return asyncio.run(main())


def restart_later(states, engines, name, after_s):
    """The engine dies (state restarting) and is back, answering, ``after_s`` later."""

    def died():
        states[name] = RESTARTING

        def back():
            engines[name].mode = "ok"
            states[name] = AWAKE

        asyncio.get_running_loop().call_later(after_s, back)

    return died


def test_engine_death_before_any_byte_is_retried_once_on_the_restarted_engine():
    async def s(c, engines, states):
        engines["a"].mode = "refuse"
        engines["a"].on_fail = restart_later(states, engines, "a", 0.2)
        r = await c.post("/models/a/generate", json={"text": "hi"})
        assert r.status_code == 200 and r.json()["text"] == "A:hi"
        assert len(engines["a"].seen) == 2  # the failed attempt and the retry
        return (await c.get("/metrics")).text

    text = run(s)
    assert 'memx_router_retries_total{model="a",result="ok"} 1' in text
    assert 'memx_router_engine_failures_total{model="a",streamed="false"} 1' in text
    assert 'memx_router_requests_total{code="200",model="a"} 1' in text


def test_engine_not_back_in_time_ends_with_503_and_retry_after():
    limits = {n: ModelLimits(0.05, max_inflight=4, max_queued=4) for n in ("a", "b")}

    async def s(c, engines, states):
        engines["a"].mode = "refuse"
        engines["a"].on_fail = lambda: states.__setitem__("a", RESTARTING)  # never back
        t0 = time.monotonic()
        r = await c.post("/v1/chat/completions", json={"model": "a"})
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == ENGINE_RESTARTING
        assert int(r.headers["retry-after"]) >= 1 and took < 2.0  # shed at the horizon, no hang
        ok = await c.post("/v1/chat/completions", json={"model": "b"})  # the other model is untouched
        assert ok.status_code == 200 and ok.json() == {"engine": "B"}
        return (await c.get("/metrics")).text

    text = run(s, limits=limits, hopeless=1.0)
    assert 'memx_router_retries_total{model="a",result="shed"} 1' in text
    assert 'memx_router_shed_total{model="a",reason="engine_restarting"} 1' in text


def test_requests_queue_during_a_restart_and_start_when_the_engine_is_back():
    async def s(c, engines, states):
        states["a"] = RESTARTING
        await asyncio.sleep(0.05)
        pending = asyncio.create_task(c.post("/models/a/generate", json={"text": "q"}))
        await asyncio.sleep(0.1)
        assert not pending.done()
        snap = (await c.get("/memx/serve")).json()
        assert snap["admission"]["a"]["queued"] == 1 and snap["models"]["a"]["state"] == RESTARTING
        info = await c.get("/models/a/get_model_info")  # not a generation: refused at once
        assert info.status_code == 503 and "retry-after" in info.headers
        health = await c.get("/health")
        assert health.status_code == 503 and health.json()["models"] == {"a": RESTARTING, "b": "up"}
        states["a"] = AWAKE
        r = await pending
        assert r.status_code == 200 and r.json()["text"] == "A:q"

    run(s)


def test_dead_engine_refuses_at_once_and_sheds_its_queue():
    async def s(c, engines, states):
        states["a"] = RESTARTING
        await asyncio.sleep(0.05)
        pending = asyncio.create_task(c.post("/models/a/generate", json={"text": "q"}))
        await asyncio.sleep(0.05)
        states["a"] = DEAD
        r = await pending
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
        r2 = await c.post("/v1/chat/completions", json={"model": "a"})
        assert r2.status_code == 503 and r2.headers["retry-after"] == "5"

    run(s)


def test_death_mid_stream_ends_sse_with_an_error_event_and_cuts_other_bodies():
    async def s(c, engines, states):
        engines["a"].mode = "midstream"
        r = await c.post("/v1/chat/completions", json={"model": "a", "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert r.status_code == 200 and [json.loads(e[6:]).get("i") for e in events[:2]] == [0, 1]
        err = json.loads(events[-1][6:])["error"]
        assert err["code"] == "engine_down" and "mid-stream" in err["message"]
        engines["a"].mode = "midbody"
        with pytest.raises(Exception, match="failed mid-response"):  # aborted: never a body that looks whole
            await c.post("/models/a/generate", json={"text": "x"})
        snap = (await c.get("/memx/serve")).json()["admission"]["a"]
        assert snap["inflight"] == 0  # both slots were given back
        return (await c.get("/metrics")).text

    text = run(s)
    assert 'memx_router_engine_failures_total{model="a",streamed="true"} 2' in text


# ------------------------------------------------------------------ metrics


def test_histogram_is_cumulative_with_inf_sum_and_count():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    assert h.lines("x", {"model": "a"}) == [
        'x_bucket{le="0.1",model="a"} 1',
        'x_bucket{le="1",model="a"} 3',
        'x_bucket{le="+Inf",model="a"} 4',
        'x_sum{model="a"} 4.0499999999999998',
        'x_count{model="a"} 4',
    ]


def test_router_metrics_render_every_family_once_with_model_labels():
    m = RouterMetrics(["a", "b"])
    m.observe_ttft("a", 0.3, 1.0)
    m.observe_ttft("a", 2.0, 1.0)
    m.observe_tpot("a", 0.02, 0.05)
    m.response("a", 200)
    m.shed_one("b", "queue_full")
    m.engine_failure("a", streamed=True)
    adm = {"a": {"queued": 3, "inflight": 2}, "b": {"queued": 0, "inflight": 0}}
    engines = {"a": {"state": "restarting", "restarts": 1, "restart_failures": 0, "restart_seconds_total": 12.5,
                     "last_restart_s": 12.5, "device": "cpu0", "url": "http://e"}}  # fmt: skip
    text = m.render(adm, engines, ENGINE_STATES)
    assert 'memx_router_queue_length{model="a"} 3' in text and 'memx_router_inflight{model="a"} 2' in text
    assert 'memx_router_slo_total{model="a",result="met",slo="ttft"} 1' in text
    assert 'memx_router_slo_total{model="a",result="missed",slo="ttft"} 1' in text
    assert 'memx_router_slo_total{model="a",result="met",slo="tpot"} 1' in text
    assert 'memx_router_ttft_seconds_bucket{le="0.5",model="a"} 1' in text
    assert 'memx_router_ttft_seconds_count{model="a"} 2' in text
    assert 'memx_router_shed_total{model="b",reason="queue_full"} 1' in text
    assert 'memx_router_engine_state{model="a",replica="0",state="restarting"} 1' in text
    assert 'memx_router_engine_state{model="a",replica="0",state="awake"} 0' in text
    assert 'memx_router_engine_up{model="a",replica="0"} 0' in text
    assert 'memx_router_engine_restarts_total{model="a",replica="0"} 1' in text
    assert 'memx_router_engine_restart_seconds_total{model="a",replica="0"} 12.5' in text
    assert 'memx_router_model_info{device="cpu0",model="a",replica="0",url="http://e"} 1' in text
    assert "# TYPE memx_router_ttft_seconds histogram" in text
    sample = re.compile(r"^memx_router_[a-z_]+\{[^}]*\} -?[0-9.e+-]+$")
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    snap = m.snapshot()["a"]
    assert snap["ttft_slo_attainment"] == 0.5 and snap["requests"] == {"200": 1}


def test_metrics_endpoint_measures_ttft_tpot_and_slo_through_the_router():
    info = {"a": {"restarts": 2, "restart_failures": 1, "restart_seconds_total": 3.0, "last_restart_s": 1.0}}

    async def s(c, engines, states):
        engines["a"].mode = "sse"
        r = await c.post("/v1/chat/completions", json={"model": "a", "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        r = await c.post("/v1/chat/completions", json={"model": "b"})
        assert r.status_code == 200
        m = await c.get("/metrics")
        assert m.headers["content-type"].startswith("text/plain; version=0.0.4")
        return m.text

    text = run(s, info=lambda n: info.get(n, {}))
    assert 'memx_router_ttft_seconds_count{model="a"} 1' in text
    assert 'memx_router_tpot_seconds_count{model="a"} 1' in text  # 4 events 20 ms apart
    assert 'memx_router_slo_total{model="a",result="missed",slo="tpot"} 1' in text  # TPOT SLO 5 ms
    assert 'memx_router_tpot_seconds_bucket{le="0.01",model="a"} 0' in text
    assert 'memx_router_tpot_seconds_bucket{le="0.05",model="a"} 1' in text
    assert 'memx_router_ttft_seconds_count{model="b"} 1' in text
    assert 'memx_router_tpot_seconds_count{model="b"} 0' in text  # not streamed
    assert 'memx_router_engine_restarts_total{model="a",replica="0"} 2' in text
    assert 'memx_router_engine_state{model="b",replica="0",state="awake"} 1' in text


# ------------------------------------------------------------------ API key


def test_api_key_guards_every_route_but_health_and_reaches_the_engines():
    async def s(c, engines, states):
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"model": "a"}),
                                   ("POST", "/models/a/generate", {"text": "x"}), ("GET", "/metrics", None),
                                   ("GET", "/memx/serve", None)):  # fmt: skip
            r = await c.request(method, path, json=body)
            assert r.status_code == 401, path
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            bad = await c.request(method, path, json=body, headers={"Authorization": "Bearer wrong"})
            assert bad.status_code == 401 and "incorrect" in bad.json()["error"]["message"]
        assert (await c.get("/health")).status_code == 200
        good = {"Authorization": "Bearer sk-1"}
        assert (await c.get("/v1/models", headers=good)).status_code == 200
        r = await c.post("/models/a/generate", json={"text": "x"}, headers=good)
        assert r.status_code == 200 and r.json()["auth"] == "Bearer sk-1"  # the engine got the key
        assert all(req.headers.get("authorization") == "Bearer sk-1" for req in engines["a"].seen)
        assert len(engines["a"].seen) == 1  # nothing unauthenticated reached an engine

    run(s, api_key="sk-1")


def test_without_api_key_everything_is_open():
    async def s(c, engines, states):
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.post("/models/b/generate", json={"text": "x"})).status_code == 200

    run(s)


# ------------------------------------------------------------------ top


def test_top_shows_the_routers_models_placement_and_state():
    serve = {
        "models": {"tiny-a": {"url": "http://127.0.0.1:4001", "device": "cpu0", "state": "restarting"},
                   "tiny-b": {"url": "http://127.0.0.1:4002", "device": "cpu0", "state": "awake"}},
        "engines": {"tiny-a": {"pid": 11, "restarts": 1, "last_exit": "killed by SIGKILL", "state": "restarting"},
                    "tiny-b": {"pid": 12, "restarts": 0, "state": "awake"}},
        "admission": {"tiny-a": {"queued": 2, "inflight": 0}, "tiny-b": {"queued": 0, "inflight": 1}},
        "router": {"tiny-b": {"ttft_mean_s": 0.25, "ttft_slo_attainment": 0.9}},
    }  # fmt: skip
    snap = {"time": time.time(), "pools": [], "servers": [],
            "routers": [{"url": "http://127.0.0.1:30000", "serve": serve},
                        {"url": "http://127.0.0.1:30001", "error": "refused"}]}  # fmt: skip
    frame = render(snap)
    assert "MODELS (sglang-memx serve)" in frame
    [a] = [line for line in frame.splitlines() if "tiny-a" in line]
    assert "cpu0" in a and "restarting" in a and "killed by SIGKILL" in a
    [b] = [line for line in frame.splitlines() if "tiny-b" in line]
    assert "awake" in b and "250 ms" in b and "90%" in b
    assert "http://127.0.0.1:30001" in frame and "unreachable" in frame
    assert "MODELS" not in render({"time": time.time(), "pools": [], "servers": []})


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
