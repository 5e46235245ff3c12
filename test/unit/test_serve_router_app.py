"""The router app against in-process fake engines (no SGLang): routing, errors, admission."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from memory_ext.policy.edf_admission import EdfAdmission, ModelLimits
from sglang_memx.serve.admission import AdmissionGate
from sglang_memx.serve.router import EngineRoute, build_app


def fake_engine(tag: str, gate: asyncio.Event | None = None, record_activity: bool = True) -> FastAPI:
    app = FastAPI()
    app.state.activity = []  # (body, Authorization header) of every POST /memx/activity

    if record_activity:

        @app.post("/memx/activity")
        async def activity(request: Request):
            app.state.activity.append((await request.json(), request.headers.get("authorization")))
            return {"accepted": True}

    @app.get("/get_model_info")
    async def info():
        return {"model_path": f"/models/{tag}"}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        if gate is not None and body.get("block"):
            await gate.wait()
        return {"text": f"{tag}:{body['text']}"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("stream"):

            async def events():
                for i in range(3):
                    yield f"data: {json.dumps({'model': body['model'], 'i': i, 'engine': tag})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"engine": tag, "model": body["model"]}

    return app


def run(scenario, limits=None, alive=lambda n: True):
    block = asyncio.Event()
    engines = {"a": fake_engine("A", block), "org/b": fake_engine("B", block)}
    routes = {n: EngineRoute(n, f"http://engine-{i}", f"/models/{n}") for i, n in enumerate(engines)}
    mounts = {f"http://engine-{i}": httpx.ASGITransport(app=app) for i, app in enumerate(engines.values())}
    limits = limits or {n: ModelLimits(1.0, max_inflight=4, max_queued=4) for n in engines}
    gate = AdmissionGate(EdfAdmission(limits))
    app = build_app(routes, gate, alive, monitor_interval_s=0.01, client_kwargs={"mounts": mounts})

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
                return await scenario(c, block)

    return asyncio.run(main())


def test_models_listed_and_routed_by_model_field():
    async def s(c, _):
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["a", "org/b"] and models["object"] == "list"
        ra = await c.post("/v1/chat/completions", json={"model": "a", "messages": []})
        rb = await c.post("/v1/chat/completions", json={"model": "org/b", "messages": []})
        return ra.json(), rb.json()

    assert run(s) == ({"engine": "A", "model": "a"}, {"engine": "B", "model": "org/b"})


def test_unknown_or_missing_model_is_an_openai_error():
    async def s(c, _):
        r = await c.post("/v1/completions", json={"model": "zzz", "prompt": "x"})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "zzz" in err["message"]
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 400
        assert (await c.post("/models/nope/generate", json={"text": "x"})).status_code == 404
        assert (await c.get("/v1/models/zzz")).status_code == 404

    run(s)


def test_native_routes_by_longest_prefix_including_slashes():
    async def s(c, _):
        ga = await c.post("/models/a/generate", json={"text": "hi"})
        gb = await c.post("/models/org/b/generate", json={"text": "hi"})
        info = await c.get("/models/org/b/get_model_info")
        return ga.json()["text"], gb.json()["text"], info.json()["model_path"]

    assert run(s) == ("A:hi", "B:hi", "/models/B")


def test_streaming_passes_through_as_sse():
    async def s(c, _):
        r = await c.post("/v1/chat/completions", json={"model": "a", "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.text.split("\n\n") if line]

    events = run(s)
    assert events[-1] == "data: [DONE]" and [json.loads(e[6:])["i"] for e in events[:-1]] == [0, 1, 2]


def test_overload_gets_429_with_retry_after_and_slot_frees_after():
    limits = {"a": ModelLimits(1.0, max_inflight=1, max_queued=0), "org/b": ModelLimits(1.0)}

    async def s(c, block):
        first = asyncio.create_task(c.post("/models/a/generate", json={"text": "x", "block": True}))
        await asyncio.sleep(0.05)
        r = await c.post("/v1/chat/completions", json={"model": "a"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        assert (await c.post("/v1/chat/completions", json={"model": "org/b"})).status_code == 200  # untouched
        block.set()
        assert (await first).status_code == 200
        assert (await c.post("/v1/chat/completions", json={"model": "a"})).status_code == 200
        return (await c.get("/memx/serve")).json()["admission"]["a"]

    snap = run(s, limits)
    assert snap["queue_full"] == 1 and snap["inflight"] == 0 and snap["finished"] == 2


def test_dead_engine_answers_503_with_retry_after():
    async def s(c, _):
        await asyncio.sleep(0.05)  # the monitor marks it down
        r = await c.post("/v1/chat/completions", json={"model": "a"})
        assert r.status_code == 503 and "retry-after" in r.headers and r.json()["error"]["code"] == "engine_down"
        assert (await c.get("/health")).status_code == 503
        assert (await c.post("/v1/chat/completions", json={"model": "org/b"})).status_code == 200

    run(s, alive=lambda n: n != "a")


def test_a_sleeping_engine_shows_as_sleeping_and_still_takes_requests():
    engines = {"a": fake_engine("A", asyncio.Event())}
    routes = {"a": EngineRoute("a", "http://engine-0", "/models/a")}
    mounts = {"http://engine-0": httpx.ASGITransport(app=engines["a"])}
    gate = AdmissionGate(EdfAdmission({"a": ModelLimits(1.0, max_inflight=4, max_queued=4)}))
    sleep = {"state": "sleeping", "wakes": 0, "last_wake_s": None}
    app = build_app(routes, gate, lambda n: True, engine_info=lambda n: {"sleep": sleep}, monitor_interval_s=0.01,
                    client_kwargs={"mounts": mounts})  # fmt: skip

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                doc = (await c.get("/memx/serve")).json()
                answer = await c.post("/v1/chat/completions", json={"model": "a", "messages": []})
                return doc, answer

    doc, answer = asyncio.run(main())
    assert doc["models"]["a"]["state"] == "sleeping" and doc["models"]["a"]["sleep"] == sleep
    assert answer.status_code == 200 and answer.json()["engine"] == "A"  # the request is what wakes it


# ------------------------------------------------------------------ router activity -> engines
async def until(pred, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def activity_app(engine_apps: dict, limits, api_key=None, rate_window_s=10.0, ttl_s=0.5):
    routes = {n: EngineRoute(n, f"http://engine-{i}", f"/models/{n}") for i, n in enumerate(engine_apps)}
    mounts = {f"http://engine-{i}": httpx.ASGITransport(app=a) for i, a in enumerate(engine_apps.values())}
    gate = AdmissionGate(EdfAdmission(limits), rate_window_s=rate_window_s)
    return build_app(routes, gate, lambda n: True, monitor_interval_s=0.01, client_kwargs={"mounts": mounts},
                     api_key=api_key, activity_interval_s=0.02, activity_refresh_s=0.1,
                     activity_ttl_s=ttl_s)  # fmt: skip


def test_a_request_queued_behind_max_inflight_reaches_the_engine_as_activity():
    block = asyncio.Event()
    a, b = fake_engine("A", block), fake_engine("B", block)
    limits = {"a": ModelLimits(1.0, max_inflight=1, max_queued=4), "org/b": ModelLimits(1.0)}
    app = activity_app({"a": a, "org/b": b}, limits, rate_window_s=0.2)
    got = lambda: [m for m, _ in a.state.activity]  # noqa: E731
    queued_body = json.dumps({"text": "y" * 400}).encode()

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                first = asyncio.create_task(c.post("/models/a/generate", json={"text": "x", "block": True}))
                await until(lambda: any(m["inflight"] == 1 for m in got()))
                second = asyncio.create_task(c.post("/models/a/generate", content=queued_body))
                await until(lambda: any(m["queued"] == 1 for m in got()))
                n = len(got())
                await asyncio.sleep(0.35)  # unchanged but non-zero: refreshed about every 0.1 s
                refreshed = len(got()) - n
                serve = (await c.get("/memx/serve")).json()["activity"]
                block.set()
                assert (await first).status_code == 200 and (await second).status_code == 200
                await until(lambda: got()[-1]["queued"] == 0 and got()[-1]["inflight"] == 0)
                await asyncio.sleep(1.5)  # the rate decays (0.2 s window): the messages stop
                n = len(got())
                await asyncio.sleep(0.3)
                return refreshed, serve, len(got()) - n

    refreshed, serve, after_idle = asyncio.run(main())
    msg = next(m for m in got() if m["queued"] == 1)
    assert msg["model"] == "a" and msg["inflight"] == 1 and msg["ttl_s"] == 0.5
    assert msg["queued_tokens"] == -(-len(queued_body) // 4)  # body bytes / 4
    assert msg["arrival_rate"] > 0 and 0 <= msg["since_arrival_s"] < 1
    assert refreshed >= 2
    assert after_idle == 0
    assert serve["a"]["sent"] >= 3 and serve["a"]["failed"] == 0
    assert all(m["queued"] == 0 and m["inflight"] == 0 for m, _ in b.state.activity)  # b held nothing
    assert all(h is None for _, h in a.state.activity)


def test_activity_carries_the_routers_api_key():
    a = fake_engine("A")
    app = activity_app({"a": a}, {"a": ModelLimits(1.0)}, api_key="sekrit")

    async def main():
        async with app.router.lifespan_context(app):
            await until(lambda: a.state.activity)

    asyncio.run(main())
    assert a.state.activity[0][1] == "Bearer sekrit"


def test_an_engine_forgets_the_activity_of_a_router_that_stopped(monkeypatch):
    """Through the engine's real endpoint (``add_status_routes``) and its scheduler-side module: the
    queued request makes the engine hold memory and stay awake; when the router stops sending, the
    activity expires after its TTL and the engine decides alone again."""
    from sglang_memx import router_activity
    from sglang_memx.config import MemxConfig
    from sglang_memx.endpoints import add_status_routes
    from sglang_memx.upstream import http as up_http

    async def to_scheduler(numbers):
        router_activity.receive(numbers)
        return [True]

    monkeypatch.setattr(up_http, "set_scheduler_numbers", to_scheduler)
    router_activity.reset()
    block = asyncio.Event()
    engine = fake_engine("A", block, record_activity=False)
    assert add_status_routes(engine, MemxConfig())
    app = activity_app({"a": engine}, {"a": ModelLimits(1.0, max_inflight=1, max_queued=4)}, ttl_s=0.3)

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                first = asyncio.create_task(c.post("/models/a/generate", json={"text": "x", "block": True}))
                await asyncio.sleep(0.05)
                second = asyncio.create_task(c.post("/models/a/generate", json={"text": "y"}))
                await until(lambda: (router_activity.current() or SimpleNamespace(queued=0)).queued == 1)
                held = router_activity.holds_requests(), router_activity.may_sleep(30.0)
                app.state.activity_task.cancel()  # the router stops publishing (as if it died)
                await asyncio.sleep(0.45)
                gone = router_activity.holds_requests(), router_activity.may_sleep(30.0), router_activity.status()
                block.set()
                await first, await second
                return held, gone

    held, gone = asyncio.run(main())
    router_activity.reset()
    assert held == (True, False)
    assert gone[:2] == (False, True) and gone[2]["queued"] == 1 and gone[2]["live"] is False
