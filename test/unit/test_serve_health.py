"""Health of ``sglang-memx serve`` without SGLang, the router's side: its behaviour when an
engine dies (in-process fake engines), its Prometheus metrics, the API key, and the router
section of ``sglang-memx top``. Restarting the engines is ``test_serve_restarts.py``."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from memory_ext.policy.edf_admission import ENGINE_RESTARTING, EdfAdmission, ModelLimits
from sglang_memx.serve.admission import AdmissionGate
from sglang_memx.serve.launcher import AWAKE, DEAD, RESTARTING
from sglang_memx.serve.metrics import Histogram, RouterMetrics
from sglang_memx.serve.router import ENGINE_STATES, EngineRoute, build_app
from sglang_memx.top import render

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
