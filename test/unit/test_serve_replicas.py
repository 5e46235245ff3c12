"""Replicas of one model behind the router: balancing, per-replica slots, a dead or sleeping
replica skipped, 503 only when all are dead; status, metrics and top per replica; the
supervisor restarting one SIGKILLed replica (tiny HTTP processes) while the other serves."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
from fastapi import FastAPI, Request

from memory_ext.policy.edf_admission import EdfAdmission, ModelLimits
from sglang_memx.serve.admission import AdmissionGate
from sglang_memx.serve.launcher import AWAKE, DEAD, RESTARTING, Launcher, RestartPolicy
from sglang_memx.serve.router import EngineRoute, build_app
from sglang_memx.top import render
from support.fake_engine import fake_engine_spec

KEYS = ("m", "m#1")


def engine_app(tag: str, block: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        if body.get("block"):
            await block.wait()
        return {"engine": tag, "text": body["text"]}

    @app.get("/get_model_info")
    async def info():
        return {"engine": tag}

    return app


class Transport(httpx.AsyncBaseTransport):
    """One replica engine: ``ok`` answers through its app, ``refuse`` breaks the connection
    before any byte (a killed engine) and runs ``on_fail``."""

    def __init__(self, app):
        self.inner = httpx.ASGITransport(app=app)
        self.mode = "ok"
        self.on_fail = None
        self.seen = 0

    async def handle_async_request(self, request):
        self.seen += 1
        if self.mode == "refuse":
            if self.on_fail:
                self.on_fail()
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return await self.inner.handle_async_request(request)


def run(scenario, states=None, sleep=None, per_engine=2, queued=8):
    """Model ``m`` with replicas ``m`` and ``m#1`` (fake engines), model ``solo`` with one."""
    states = states if states is not None else dict.fromkeys((*KEYS, "solo"), AWAKE)
    sleep = sleep if sleep is not None else {}
    block = asyncio.Event()
    engines = {k: Transport(engine_app(k, block)) for k in (*KEYS, "solo")}
    urls = {k: f"http://engine-{i}" for i, k in enumerate(engines)}
    routes = {"m": EngineRoute("m", urls["m"], "/models/m", "cpu0", replicas=tuple((k, urls[k]) for k in KEYS)),
              "solo": EngineRoute("solo", urls["solo"], "/models/solo", "cpu0")}  # fmt: skip
    limits = {n: ModelLimits(1.0, max_inflight=per_engine, max_queued=queued) for n in routes}
    gate = AdmissionGate(EdfAdmission(limits, max_queued_total=64))

    def info(k):
        return {"restarts": 0, "pid": 100 + len(k), "sleep": {"state": "sleeping"} if sleep.get(k) else None}

    mounts = {urls[k]: t for k, t in engines.items()}
    app = build_app(routes, gate, engine_state=lambda k: states[k], engine_info=info, monitor_interval_s=0.01,
                    failure_detect_s=0.5, client_kwargs={"mounts": mounts})  # fmt: skip

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
                return await scenario(c, engines, states, block, gate)

    return asyncio.run(main())


async def gen(c, **kw):
    r = await c.post("/models/m/generate", json={"text": "hi", **kw})
    return r.status_code, (r.json().get("engine") if r.status_code == 200 else r.json()["error"]["code"])


async def settle(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_idle_replicas_take_turns():
    async def s(c, engines, states, block, gate):
        seq = [(await gen(c))[1] for _ in range(4)]
        return seq, engines["m"].seen, engines["m#1"].seen, engines["solo"].seen

    seq, a, b, solo = run(s)
    assert seq == ["m", "m#1", "m", "m#1"]  # equal load (none): round-robin
    assert (a, b, solo) == (2, 2, 0)


def test_least_loaded_replica_and_k_times_the_per_engine_slots():
    async def s(c, engines, states, block, gate):
        held = [asyncio.create_task(gen(c, block=True)) for _ in range(5)]
        await settle(lambda: engines["m"].seen + engines["m#1"].seen == 4)
        await asyncio.sleep(0.05)
        # 2 replicas x max_inflight 2: four handed out, two per replica, the fifth waits in the router
        assert (engines["m"].seen, engines["m#1"].seen) == (2, 2)
        snap = gate.policy.snapshot()["m"]
        assert (snap["inflight"], snap["queued"]) == (4, 1) and gate.policy.models["m"].max_inflight == 4
        metrics = (await c.get("/metrics")).text
        assert 'memx_router_replica_inflight{model="m",replica="0"} 2' in metrics
        assert 'memx_router_replica_inflight{model="m",replica="1"} 2' in metrics
        block.set()
        out = await asyncio.gather(*held)
        assert all(code == 200 for code, _ in out)
        return sorted(e for _, e in out)

    out = run(s)  # the fifth went to whichever replica freed a slot first
    assert len(out) == 5 and out.count("m") >= 2 and out.count("m#1") >= 2


def test_a_replica_that_dies_is_skipped_and_its_request_retried_on_the_other():
    async def s(c, engines, states, block, gate):
        engines["m"].mode = "refuse"
        engines["m"].on_fail = lambda: states.__setitem__("m", RESTARTING)
        first = await gen(c)  # broke on replica 0 before any byte: retried at once on replica 1
        assert engines["m"].seen == 1 and first == (200, "m#1")
        await settle(lambda: gate.policy.models["m"].max_inflight == 2)  # one awake replica: 1 x the cap
        rest = [await gen(c) for _ in range(3)]
        health = (await c.get("/health")).json()
        doc = (await c.get("/memx/serve")).json()["models"]["m"]
        states["m"], engines["m"].mode = AWAKE, "ok"  # back from its restart
        await settle(lambda: gate.policy.models["m"].max_inflight == 4)
        back = [(await gen(c))[1] for _ in range(2)]
        return rest, health, doc, back

    rest, health, doc, back = run(s)
    assert rest == [(200, "m#1")] * 3
    assert health == {"status": "ok", "models": {"m": "up", "solo": "up"}}  # the model still serves
    assert doc["state"] == "awake" and [(r["engine"], r["state"]) for r in doc["replicas"]] == [
        ("m", "restarting"),
        ("m#1", "awake"),
    ]
    assert sorted(back) == ["m", "m#1"]


def test_only_when_every_replica_is_dead_the_model_is_down():
    async def s(c, engines, states, block, gate):
        states["m"] = DEAD
        await asyncio.sleep(0.05)
        one = await gen(c)
        states["m#1"] = RESTARTING  # dead + restarting: requests wait for the restart
        await settle(lambda: gate.state("m") == "restarting")
        waiting = asyncio.create_task(gen(c))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        states["m#1"] = AWAKE
        queued = await waiting
        states["m#1"] = DEAD
        await settle(lambda: gate.state("m") == "down")
        down = await gen(c)
        solo = await c.post("/models/solo/generate", json={"text": "x"})
        health = await c.get("/health")
        return one, queued, down, solo.status_code, health.status_code, health.json()["models"]

    one, queued, down, solo, health, models = run(s)
    assert one == (200, "m#1") and queued == (200, "m#1")
    assert down == (503, "engine_down") and solo == 200
    assert health == 503 and models == {"m": "dead", "solo": "up"}


def test_sleeping_replica_is_skipped_while_another_is_awake_and_chosen_when_alone():
    sleep = {"m": True}

    async def s(c, engines, states, block, gate):
        first = [(await gen(c))[1] for _ in range(3)]
        state = (await c.get("/memx/serve")).json()["models"]["m"]["state"]
        states["m#1"] = RESTARTING
        await asyncio.sleep(0.05)
        alone = (await gen(c))[1]  # the sleeping replica wakes on the request
        sleep["m#1"] = True
        states["m#1"] = AWAKE
        await asyncio.sleep(0.05)
        both = (await c.get("/memx/serve")).json()["models"]["m"]["state"]
        return first, state, alone, both

    first, state, alone, both = run(s, sleep=sleep)
    assert first == ["m#1"] * 3 and state == "awake" and alone == "m" and both == "sleeping"


def test_prefix_native_calls_pick_a_replica_and_status_lists_each():
    async def s(c, engines, states, block, gate):
        infos = [(await c.get("/models/m/get_model_info")).json()["engine"] for _ in range(2)]
        doc = (await c.get("/memx/serve")).json()
        metrics = (await c.get("/metrics")).text
        return infos, doc, metrics

    infos, doc, metrics = run(s)
    assert sorted(infos) == ["m", "m#1"]
    reps = doc["models"]["m"]["replicas"]
    assert [(r["replica"], r["engine"], r["url"], r["state"]) for r in reps] == [
        (0, "m", "http://engine-0", "awake"),
        (1, "m#1", "http://engine-1", "awake"),
    ]
    assert [r["engine"] for r in doc["models"]["solo"]["replicas"]] == ["solo"]
    assert 'memx_router_engine_state{model="m",replica="1",state="awake"} 1' in metrics
    assert 'memx_router_model_info{device="cpu0",model="m",replica="1",url="http://engine-1"} 1' in metrics
    assert 'memx_router_engine_up{model="solo",replica="0"} 1' in metrics
    frame = render({"time": time.time(), "pools": [], "servers": [],
                    "routers": [{"url": "http://r", "serve": doc}]})  # fmt: skip
    lines = frame.splitlines()
    [m] = [x for x in lines if x.strip().startswith("m ")]
    assert "2 repl" in m and "2 replicas" in m
    assert any(x.strip().startswith("#0") and "http://engine-0" in x for x in lines)
    assert any(x.strip().startswith("#1") and "http://engine-1" in x for x in lines)


# ---------------------------------------------------- supervisor + router with real processes


def test_sigkilled_replica_restarts_while_the_other_serves(tmp_path):
    # fake engine processes: GET /health, POST /generate answering with its port
    specs = [fake_engine_spec(tmp_path, "m", {"FAKE_ANSWER": "port"}, r, log_name=f"m{r}") for r in (0, 1)]
    logs: list[str] = []
    launcher = Launcher(specs, log=logs.append)
    try:
        launcher.start_all(20)
        assert list(launcher.engines) == ["m", "m#1"]
        launcher.supervise(RestartPolicy(backoff_s=0.5), startup_timeout_s=20, interval_s=0.05)
        e0, e1 = launcher.engines["m"], launcher.engines["m#1"]
        route = EngineRoute("m", e0.url, "/models/m", "cpu0", replicas=((e0.spec.key, e0.url), (e1.spec.key, e1.url)))
        gate = AdmissionGate(EdfAdmission({"m": ModelLimits(1.0, max_inflight=1, max_queued=8)}))
        app = build_app({"m": route}, gate, engine_state=lambda k: launcher.engines[k].state,
                        engine_info=lambda k: launcher.engines[k].info(), monitor_interval_s=0.02)  # fmt: skip

        async def main():
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:

                    async def port_of():
                        r = await c.post("/models/m/generate", json={"text": "x"})
                        assert r.status_code == 200, r.text
                        return r.json()["port"]

                    before = {await port_of() for _ in range(4)}
                    old_pid = e0.pid
                    os.kill(old_pid, signal.SIGKILL)
                    while e0.state == AWAKE:
                        await asyncio.sleep(0.02)
                    during = []
                    while e0.state != AWAKE:  # restarting: every request answered by replica 1
                        during.append(await port_of())
                        await asyncio.sleep(0.02)
                    after = {await port_of() for _ in range(4)}
                    doc = (await c.get("/memx/serve")).json()["models"]["m"]["replicas"]
                    return before, during, after, old_pid, doc

        before, during, after, old_pid, doc = asyncio.run(main())
        assert before == {e0.port, e1.port}
        assert during and set(during) == {e1.port}
        assert after == {e0.port, e1.port} and e0.pid != old_pid and e0.restarts == 1 and e1.restarts == 0
        assert [(r["engine"], r["port"], r["restarts"], r["last_exit"]) for r in doc] == [
            ("m", e0.port, 1, "killed by SIGKILL"),
            ("m#1", e1.port, 0, None),
        ]
        assert any("m (pid" in line and "killed by SIGKILL" in line for line in logs)
    finally:
        launcher.stop_all()
    assert not any(e.alive() for e in launcher.engines.values())
