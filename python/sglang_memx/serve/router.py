"""The OpenAI-compatible front of ``sglang-memx serve`` (FastAPI + httpx).

Routes:

* ``GET /v1/models`` (and ``/v1/models/<name>``): every served model.
* ``POST /v1/<anything>`` (chat/completions, completions, ...): routed by the body's
  ``model`` field to that model's engine, same path. Unknown model: 404, OpenAI-style error.
* ``/models/<name>/<path>`` (any method): ``<path>`` on ``<name>``'s engine, so native
  ``/generate`` and the frontend language reach one model:
  ``RuntimeEndpoint("http://router/models/<name>")`` calls ``get_model_info``,
  ``generate``, ``flush_cache``, ``server_info``... under that prefix. Model names may hold
  ``/``; the longest served name that prefixes the path wins.
* Replicas: a model with several engines (``EngineRoute.replicas``) sends each request to
  one of its awake replicas, the least loaded (requests the router has handed to it and
  not finished: in flight or queued at the engine), ties by round-robin; a replica that is
  restarting, dead or sleeping is skipped while another is awake (a sleeping one is chosen
  when none is awake: the request wakes it). The model's admission cap is the per-engine
  ``max_inflight`` x its awake replicas (at least one); the model is awake while any
  replica is, ``dead`` only when all are. Prefix routes pick a replica the same way (no
  stickiness: a prefix cached on one replica is not sought on another).
* ``GET /health`` (200 when every model has an awake engine, else 503), ``GET /memx/serve``
  (placement, engines and their state, admission counters, router measurements),
  ``GET /metrics`` (Prometheus, ``memx_router_*``; ``serve/metrics.py``).

Invariants:

* Generation requests (``POST /v1/...`` and ``POST /models/<name>/generate`` or
  ``/v1/...``) pass the admission gate before reaching the engine and hold their slot
  until the last byte of the response; other native calls pass straight through.
* Responses stream through chunk by chunk (SSE included) with the engine's status and
  content type; nothing is buffered whole. The router waits for the engine's first chunk
  before it answers (that instant is the TTFT it measures), so until then nothing has
  reached the client and a failed engine can still be retried.
* A refusal is an OpenAI-style error with ``Retry-After`` (429 queue full / hopeless
  deadline, 503 engine down or restarting); a request never hangs on a dead engine (the
  connection breaks at once; the monitor sees the engine's state within
  ``monitor_interval_s``).
* Engine failure of an in-flight request: before any byte was sent it is retried once,
  after the engine restarted (it waits in the admission queue like a new request, within
  the same horizon, else 503 ``engine_restarting``); a native call that is not a
  generation ends with 503. After bytes were sent an SSE stream ends with a
  ``data: {"error": ...}`` event and any other body is cut (the connection is aborted, the
  client sees an incomplete response rather than a truncated one that looks whole).
* The router's activity per model (queued, in flight, arrival rate, queued tokens) is pushed to
  the model's engines (``POST /memx/activity``, ``serve/activity.py``) on change and every
  second while non-zero, so an engine whose requests wait here does not look idle to itself.
* With an API key every route but ``/health`` needs ``Authorization: Bearer <key>`` (401,
  OpenAI-style error, otherwise); the router sends the key to the engines (started with
  upstream's ``--api-key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .activity import ActivityPublisher, estimate_tokens
from .admission import AdmissionGate, Rejected
from .metrics import CONTENT_TYPE, RouterMetrics

__all__ = ["EngineRoute", "build_app", "error_response", "ENGINE_STATES"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "upgrade", "te",
        "trailer", "proxy-authenticate", "proxy-authorization", "host"}  # fmt: skip
_ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               429: "rate_limit_exceeded", 502: "engine_error", 503: "service_unavailable",
               504: "engine_error"}  # fmt: skip

# The launcher's engine states (``launcher.ENGINE_STATES``; not imported: the router runs without it).
AWAKE, DEAD, SLEEPING = "awake", "dead", "sleeping"
ENGINE_STATES = ("starting", "awake", "sleeping", "waking", "restarting", "dead")


@dataclass(frozen=True)
class EngineRoute:
    name: str
    url: str  # the engine's base URL
    path: str  # the model's checkpoint directory (shown in /v1/models)
    device: str | None = None
    tpot_slo_s: float | None = None  # the model's TPOT SLO (metrics; admission uses the TTFT SLO)
    replicas: tuple[tuple[str, str], ...] = ()  # (engine key, base URL) of each replica; () = ((name, url),)

    @property
    def engines(self) -> tuple[tuple[str, str], ...]:
        """(engine key, URL) of every replica; ``engine_state`` / ``engine_info`` take the key."""
        return self.replicas or ((self.name, self.url),)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None, headers: dict | None = None) -> JSONResponse:  # fmt: skip
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "error"), "param": param,
                      "code": code or str(status)}}  # fmt: skip
    return JSONResponse(body, status_code=status, headers=headers)


def _rejected(exc: Rejected) -> JSONResponse:
    text = {
        "queue_full": f"model {exc.model!r} is overloaded: its queue is full",
        "deadline": f"model {exc.model!r} is overloaded: the request waited far past its TTFT SLO",
        "engine_down": f"model {exc.model!r} is unavailable: its engine is down",
        "engine_restarting": f"model {exc.model!r} is unavailable: its engine is restarting",
    }.get(exc.reason, exc.reason)
    return error_response(exc.status, text, code=exc.reason, retry_after_s=exc.retry_after_s)


def _admitted(method: str, sub: str) -> bool:
    return method == "POST" and (sub == "/generate" or sub.startswith("/v1/"))


def _sse_events(chunk: bytes) -> int:
    """SSE data events in ``chunk`` that carry output (``[DONE]`` excluded); approximate when an
    event straddles two chunks (it then counts in the chunk holding its ``data:``)."""
    return chunk.count(b"data:") - chunk.count(b"data: [DONE]")


class _ApiKeyGate:
    """ASGI middleware: every HTTP route but /health needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                why = "no API key given" if not got else "incorrect API key"
                resp = error_response(401, f"{why}: send 'Authorization: Bearer <key>' (the router's api_key)",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _EngineFailedMidBody(Exception):
    """Raised inside a non-SSE body after bytes were sent: the server aborts the connection."""


def build_app(
    routes: dict[str, EngineRoute],
    gate: AdmissionGate,
    alive: Callable[[str], bool] = lambda name: True,
    *,
    engine_state: Callable[[str], str] | None = None,
    engine_info: Callable[[str], dict] | None = None,
    api_key: str | None = None,
    request_timeout_s: float = 600.0,
    monitor_interval_s: float = 0.25,
    failure_detect_s: float = 2.0,
    status: Callable[[], dict] | None = None,
    client_kwargs: dict | None = None,
    activity_interval_s: float | None = None,
    activity_refresh_s: float = 1.0,
    activity_ttl_s: float = 5.0,
) -> FastAPI:
    """The router app over ``routes`` (model name -> its engines).

    ``engine_state(key)`` / ``engine_info(key)`` take an engine key (``EngineRoute.engines``;
    the model's name when it has one engine). ``engine_state(key)`` (one of
    ``ENGINE_STATES``; default: ``awake`` / ``dead`` from ``alive(key)``) is polled by a
    monitor and before each request; ``engine_info(key)`` (restarts, ...) feeds ``/metrics``;
    ``failure_detect_s``: how long a request whose engine connection broke waits to see the
    engine leave ``awake`` before it is retried (else it ends with 502); ``client_kwargs`` go
    to ``httpx.AsyncClient`` (tests pass in-process transports); ``activity_*``: the activity
    publisher's period, refresh and TTL (default None: no publisher; ``sglang-memx serve``
    runs it every 0.2 s)."""
    created = int(time.time())
    by_length = sorted(routes, key=len, reverse=True)
    state_of = engine_state or (lambda name: AWAKE if alive(name) else DEAD)
    info_of = engine_info or (lambda name: {})
    known: dict[str, str] = {}  # the engine state the gate was last told
    metrics = RouterMetrics(routes)
    state: dict = {}
    per_engine_cap = {n: gate.policy.models[n].max_inflight for n in routes}  # the config's, per replica engine
    caps = dict(per_engine_cap)  # the model's cap the gate was last given
    load = {key: 0 for r in routes.values() for key, _ in r.engines}  # handed to the engine, not finished
    turn = dict.fromkeys(routes, 0)  # round-robin start among equally loaded replicas
    publisher = None
    if activity_interval_s is not None:
        publisher = ActivityPublisher(routes, gate.activity,
                                      lambda n: [u for k, u in routes[n].engines if state_of(k) != DEAD],
                                      api_key=api_key, interval_s=activity_interval_s, refresh_s=activity_refresh_s,
                                      ttl_s=activity_ttl_s)  # fmt: skip

    def expected_ready_s(name: str) -> float:
        ready = [info_of(k).get("expected_ready_s") for k, _ in routes[name].engines if state_of(k) != DEAD]
        return float(min([r for r in ready if r] or [5.0]))

    def sleeping(key: str) -> bool:
        return (info_of(key).get("sleep") or {}).get("state") == SLEEPING

    def model_state(name: str) -> str:
        """Awake while any replica is awake, dead when all are; else the first replica's other state."""
        states = [state_of(k) for k, _ in routes[name].engines]
        if AWAKE in states:
            return AWAKE
        return next((st for st in states if st != DEAD), DEAD)

    def pick(name: str) -> tuple[str, str] | None:
        """The replica for the next request: awake and not sleeping, else awake (a sleeping one
        wakes on the request); the least loaded of those, ties by round-robin. None: none awake."""
        engines = routes[name].engines
        awake = [(k, u) for k, u in engines if state_of(k) == AWAKE]
        pool = [(k, u) for k, u in awake if not sleeping(k)] or awake
        if not pool:
            return None
        start = turn[name] % len(engines)
        order = {k: (i - start) % len(engines) for i, (k, _) in enumerate(engines)}
        turn[name] += 1
        return min(pool, key=lambda ku: (load[ku[0]], order[ku[0]]))

    def sync(name: str) -> str:
        """Tell the gate the model's current state (when it changed) and its cap (awake
        replicas x the per-engine cap, when it has several); returns the state."""
        st = model_state(name)
        if len(routes[name].engines) > 1:
            awake = sum(state_of(k) == AWAKE for k, _ in routes[name].engines)
            cap = per_engine_cap[name] * max(1, awake)
            if caps[name] != cap:
                caps[name] = cap
                gate.set_max_inflight(name, cap)
        if known.get(name) != st:
            known[name] = st
            if st == AWAKE:
                gate.engine_up(name)
            elif st == DEAD:
                gate.engine_down(name)
            else:  # starting / restarting / sleeping / waking: requests wait for it
                gate.engine_restarting(name, expected_ready_s(name))
        return st

    async def monitor():
        while True:
            for name in routes:
                sync(name)
            gate.expire()
            await asyncio.sleep(monitor_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, **(client_kwargs or {})) as client:
            state["client"] = client
            tasks = [asyncio.create_task(monitor())]
            if publisher is not None:
                tasks.append(asyncio.create_task(publisher.run(client)))
                app.state.activity_task = tasks[-1]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()

    app = FastAPI(title="sglang-memx router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.activity_publisher = publisher
    if api_key:
        app.add_middleware(_ApiKeyGate, api_key=api_key)

    def refuse(name: str, resp: JSONResponse, reason: str) -> JSONResponse:
        metrics.shed_one(name, reason)
        metrics.response(name, resp.status_code)
        return resp

    async def engine_failed(name: str, key: str) -> bool:
        """True when the engine ``key`` of ``name`` left ``awake`` (died) within ``failure_detect_s``."""
        deadline = time.monotonic() + failure_detect_s
        while True:
            sync(name)
            if state_of(key) != AWAKE:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def forward(name: str, method: str, sub: str, request: Request, body: bytes) -> Response:
        arrival = time.monotonic()
        route = routes[name]
        admitted = _admitted(method, sub)
        st = sync(name)
        if st == DEAD:
            return refuse(name, error_response(503, f"model {name!r} is unavailable: its engine is down",
                                               code="engine_down", retry_after_s=gate.retry_after_s(name)),
                          "engine_down")  # fmt: skip
        if st != AWAKE and not admitted:
            return refuse(name, error_response(503, f"model {name!r} is unavailable: its engine is {st}",
                                               code="engine_restarting", retry_after_s=gate.retry_after_s(name)),
                          "engine_restarting")  # fmt: skip
        # Raw header bytes (a non-ASCII value passes through as sent); the path re-quoted (a decoded
        # NUL, '?' or '#' stays in the path instead of breaking or reshaping the engine's URL).
        headers = [(k, v) for k, v in request.headers.raw if k.lower().decode("latin-1") not in _HOP]
        if api_key:
            headers = [(k, v) for k, v in headers if k.lower() != b"authorization"]
            headers.append((b"Authorization", f"Bearer {api_key}".encode()))
        client: httpx.AsyncClient = state["client"]
        quoted = urllib.parse.quote(sub, safe="/:@!$&'()*+,;=")
        try:  # the same path on every replica: checked once, built per replica below
            client.build_request(method, route.url + quoted, content=body, headers=headers,
                                 params=request.query_params)  # fmt: skip
        except httpx.InvalidURL as exc:
            return error_response(400, f"cannot forward this request to model {name!r}: {exc}", code="invalid_url")
        rid = key = None

        def release():
            nonlocal rid, key
            if rid is not None:
                gate.leave(rid)
                rid = None
            if key is not None:
                load[key] -= 1
                key = None

        for attempt in (0, 1):
            if admitted:
                try:
                    rid = await gate.enter(name, tokens=estimate_tokens(body))
                except Rejected as exc:
                    if attempt:
                        metrics.retry(name, "shed")
                    return refuse(name, _rejected(exc), exc.reason)
            upstream = None
            target = pick(name)
            if target is None:  # every replica left awake since the check above
                release()
                st = sync(name)
                if attempt == 0 and admitted and st != DEAD:
                    continue  # wait in the queue for one to be back, like a retry
                code = "engine_down" if st == DEAD else "engine_restarting"
                msg = f"model {name!r} is unavailable: its engine is {st}"
                return refuse(name, error_response(503, msg, code=code, retry_after_s=gate.retry_after_s(name)), code)
            key, url = target
            load[key] += 1
            try:
                engine_request = client.build_request(method, url + quoted, content=body, headers=headers,
                                                      params=request.query_params)  # fmt: skip
                upstream = await client.send(engine_request, stream=True)
                body_iter = upstream.aiter_raw()
                try:
                    first = await body_iter.__anext__()
                except StopAsyncIteration:
                    first = b""
                break
            except httpx.HTTPError as exc:
                if upstream is not None:
                    await upstream.aclose()
                release()
                metrics.engine_failure(name, streamed=False)
                if isinstance(exc, httpx.TimeoutException):
                    return refuse(name, error_response(504, f"model {name!r}: the engine did not answer within "
                                                            f"{request_timeout_s:g} s", code="engine_timeout"),
                                  "engine_timeout")  # fmt: skip
                died = await engine_failed(name, target[0])
                if attempt == 0 and died and admitted:
                    continue  # nothing reached the client: once more, after the restart
                if attempt:
                    metrics.retry(name, "failed")
                if died:
                    st = sync(name)
                    code = "engine_down" if st == DEAD else "engine_restarting"
                    msg = f"model {name!r}: its engine failed during the request ({type(exc).__name__}); it is {st}"
                    return refuse(name, error_response(503, msg, code=code, retry_after_s=gate.retry_after_s(name)),
                                  code)  # fmt: skip
                msg = f"model {name!r}: the engine broke the connection ({type(exc).__name__})"
                return refuse(name, error_response(502, msg, code="engine_error"), "engine_error")
        if attempt:
            metrics.retry(name, "ok")
        t_first = time.monotonic()
        ok = upstream.status_code < 400
        if admitted and ok:
            metrics.observe_ttft(name, t_first - arrival, gate.policy.models[name].ttft_slo_s)
        metrics.response(name, upstream.status_code)
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def chunks():
            events, t_last = _sse_events(first), t_first
            try:
                if first:
                    yield first
                async for chunk in body_iter:
                    n = _sse_events(chunk)
                    if n:
                        events, t_last = events + n, time.monotonic()
                    yield chunk
            except httpx.HTTPError as exc:  # the engine died mid-response
                metrics.engine_failure(name, streamed=True)
                metrics.shed_one(name, "engine_failed_mid_response")
                if not sse:
                    raise _EngineFailedMidBody(f"engine of {name!r} failed mid-response: {type(exc).__name__}") from exc
                err = {"error": {"message": f"engine of {name!r} failed mid-stream: {type(exc).__name__}",
                                 "type": "engine_error", "param": None, "code": "engine_down"}}  # fmt: skip
                yield f"data: {json.dumps(err)}\n\n".encode()
            else:
                if sse and admitted and ok and events > 1:
                    metrics.observe_tpot(name, (t_last - t_first) / (events - 1), route.tpot_slo_s)
            finally:
                await upstream.aclose()
                release()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(release))  # fmt: skip

    def model_card(name: str) -> dict:
        r = routes[name]
        return {"id": name, "object": "model", "created": created, "owned_by": "sglang-memx", "root": r.path}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in routes]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        if name not in routes:
            return error_response(404, f"the model {name!r} does not exist", code="model_not_found", param="model")
        return model_card(name)

    @app.post("/v1/{rest:path}")
    async def openai_route(rest: str, request: Request):
        body = await request.body()
        try:
            doc = json.loads(body or b"null")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return error_response(400, "the request body is not valid JSON")
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, str) or not model:
            return error_response(400, "the request needs a 'model' field naming a served model", param="model")
        if model not in routes:
            known_models = ", ".join(routes)
            return error_response(404, f"the model {model!r} does not exist (served: {known_models})",
                                  code="model_not_found", param="model")  # fmt: skip
        return await forward(model, "POST", "/v1/" + rest, request, body)

    @app.api_route("/models/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def native_route(rest: str, request: Request):
        for name in by_length:
            if rest == name or rest.startswith(name + "/"):
                sub = rest[len(name) :] or "/"
                return await forward(name, request.method, sub, request, await request.body())
        known_models = ", ".join(routes)
        return error_response(404, f"no served model prefixes /models/{rest} (served: {known_models})",
                              code="model_not_found")  # fmt: skip

    @app.get("/health")
    async def health():
        models = {}
        for n in routes:
            st = model_state(n)
            models[n] = "up" if st == AWAKE else st
        ok = all(v == "up" for v in models.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "models": models}, status_code=200 if ok else 503)

    def engine_shown_state(key: str) -> str:
        """The supervisor's state, with an awake engine's own sleep state (``--memx-sleep-after-s``):
        a sleeping engine still takes requests (the first one wakes it)."""
        state = state_of(key)
        return SLEEPING if state == AWAKE and sleeping(key) else state

    def shown_state(name: str) -> str:
        """The model's state: sleeping when it is awake only through sleeping replicas."""
        st = model_state(name)
        keys = [k for k, _ in routes[name].engines if state_of(k) == AWAKE]
        return SLEEPING if st == AWAKE and all(sleeping(k) for k in keys) else st

    def replicas_doc(name: str) -> list[dict]:
        r = routes[name]
        out = []
        for i, (k, url) in enumerate(r.engines):
            info = info_of(k)
            out.append({"device": info.get("device") or r.device, **info, "url": url, "engine": k, "replica": i,
                        "state": engine_shown_state(k), "router_inflight": load[k]})  # fmt: skip
        return out

    def engines_doc() -> dict:
        return {n: replicas_doc(n) for n in routes}

    @app.get("/memx/serve")
    async def serve_status():
        doc = {"models": {n: {"url": r.url, "device": r.device, "path": r.path, "state": shown_state(n),
                              "sleep": info_of(r.engines[0][0]).get("sleep"), "replicas": replicas_doc(n)}
                          for n, r in routes.items()},
               "admission": gate.policy.snapshot(), "router": metrics.snapshot(),
               "activity": None if publisher is None else publisher.status()}  # fmt: skip
        if status is not None:
            doc.update(status())
        return doc

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(gate.policy.snapshot(), engines_doc(), ENGINE_STATES)
        return Response(text, media_type=CONTENT_TYPE)

    return app
