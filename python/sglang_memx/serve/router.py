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
* Replicas: a model with several engines sends each request to one of its awake replicas,
  the least loaded, ties by round-robin (``router_engines.py``); prefix routes pick a
  replica the same way (no stickiness: a prefix cached on one replica is not sought on another).
* ``GET /health`` (200 when every model has an awake engine, else 503), ``GET /memx/serve``
  (placement, engines and their state, admission counters, router measurements),
  ``GET /metrics`` (Prometheus, ``memx_router_*``; ``serve/metrics.py``).

Parts (``Router``): ``engines`` (states, load, replica choice, status documents;
``router_engines.py``), ``admission`` (the gate kept told of the engines, each request's
slot; ``router_admission.py``), ``forwarder`` (a request to an engine, its retry;
``router_forward.py``) and streaming (the answer relayed; ``router_stream.py``); refusals
and the API key are ``router_errors.py``.

Invariants (each enforced by the part named):

* Generation requests pass the admission gate and hold their slot until the last byte of
  the response; responses stream through chunk by chunk, never buffered whole; the router
  waits for the engine's first chunk before it answers (its TTFT), so a failed engine can
  still be retried (forwarder, streaming).
* A refusal is an OpenAI-style error with ``Retry-After`` (429 queue full / hopeless
  deadline, 503 engine down or restarting); a request never hangs on a dead engine (the
  connection breaks at once; the monitor sees the engine's state within
  ``monitor_interval_s``) (admission, forwarder).
* Engine failure of an in-flight request: before any byte was sent it is retried once after
  the restart; after bytes were sent an SSE stream ends with an error event and any other
  body is cut (forwarder, streaming).
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
import json
import time
from collections.abc import Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .activity import ActivityPublisher
from .admission import AdmissionGate
from .metrics import CONTENT_TYPE, RouterMetrics
from .router_admission import Admission
from .router_engines import AWAKE, DEAD, ENGINE_STATES, EngineRoute, Engines
from .router_errors import ApiKeyGate, error_response
from .router_forward import Forwarder

__all__ = ["EngineRoute", "Router", "build_app", "error_response", "ENGINE_STATES"]


class Router:
    """The router over ``routes`` (model name -> its engines) and its FastAPI ``app``; see
    ``build_app`` for the parameters."""

    def __init__(self, routes: dict[str, EngineRoute], gate: AdmissionGate, *, state_of: Callable[[str], str],
                 info_of: Callable[[str], dict], api_key: str | None, request_timeout_s: float,
                 monitor_interval_s: float, failure_detect_s: float, status: Callable[[], dict] | None,
                 client_kwargs: dict | None, activity_interval_s: float | None, activity_refresh_s: float,
                 activity_ttl_s: float):  # fmt: skip
        self.routes = routes
        self.gate = gate
        self.created = int(time.time())
        self._by_length = sorted(routes, key=len, reverse=True)
        self._status = status
        self._request_timeout_s = request_timeout_s
        self._monitor_interval_s = monitor_interval_s
        self._client_kwargs = client_kwargs or {}
        self.metrics = RouterMetrics(routes)
        self.engines = Engines(routes, state_of, info_of)
        self.admission = Admission(gate, self.engines, self.metrics, failure_detect_s)
        self.forwarder = Forwarder(self.engines, self.admission, self.metrics, api_key=api_key,
                                   request_timeout_s=request_timeout_s)  # fmt: skip
        self.publisher = None
        if activity_interval_s is not None:
            self.publisher = ActivityPublisher(routes, gate.activity, self.engines.live_urls, api_key=api_key,
                                               interval_s=activity_interval_s, refresh_s=activity_refresh_s,
                                               ttl_s=activity_ttl_s)  # fmt: skip
        self.app = self._build_app(api_key)

    def _build_app(self, api_key: str | None) -> FastAPI:
        app = FastAPI(title="sglang-memx router", lifespan=self._lifespan, docs_url=None, redoc_url=None)
        app.state.activity_publisher = self.publisher
        if api_key:
            app.add_middleware(ApiKeyGate, api_key=api_key)
        app.get("/v1/models")(self.list_models)
        app.get("/v1/models/{name:path}")(self.get_model)
        app.post("/v1/{rest:path}")(self.openai_route)
        app.api_route("/models/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])(self.native_route)
        app.get("/health")(self.health)
        app.get("/memx/serve")(self.serve_status)
        app.get("/metrics")(self.prometheus)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        """The engines' HTTP client, the admission monitor and the activity publisher, for the app's life."""
        timeout = httpx.Timeout(self._request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, **self._client_kwargs) as client:
            self.forwarder.client = client
            tasks = [asyncio.create_task(self.admission.monitor(self._monitor_interval_s))]
            if self.publisher is not None:
                tasks.append(asyncio.create_task(self.publisher.run(client)))
                app.state.activity_task = tasks[-1]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()

    # ------------------------------------------------------------------ models
    def model_card(self, name: str) -> dict:
        r = self.routes[name]
        return {"id": name, "object": "model", "created": self.created, "owned_by": "sglang-memx", "root": r.path}

    async def list_models(self):
        return {"object": "list", "data": [self.model_card(n) for n in self.routes]}

    async def get_model(self, name: str):
        if name not in self.routes:
            return error_response(404, f"the model {name!r} does not exist", code="model_not_found", param="model")
        return self.model_card(name)

    # ------------------------------------------------------------------ forwarded routes
    async def openai_route(self, rest: str, request: Request):
        body = await request.body()
        try:
            doc = json.loads(body or b"null")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return error_response(400, "the request body is not valid JSON")
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, str) or not model:
            return error_response(400, "the request needs a 'model' field naming a served model", param="model")
        if model not in self.routes:
            known_models = ", ".join(self.routes)
            return error_response(404, f"the model {model!r} does not exist (served: {known_models})",
                                  code="model_not_found", param="model")  # fmt: skip
        return await self.forwarder.forward(model, "POST", "/v1/" + rest, request, body)

    async def native_route(self, rest: str, request: Request):
        for name in self._by_length:
            if rest == name or rest.startswith(name + "/"):
                sub = rest[len(name) :] or "/"
                return await self.forwarder.forward(name, request.method, sub, request, await request.body())
        known_models = ", ".join(self.routes)
        return error_response(404, f"no served model prefixes /models/{rest} (served: {known_models})",
                              code="model_not_found")  # fmt: skip

    # ------------------------------------------------------------------ health and status
    async def health(self):
        models = {}
        for n in self.routes:
            st = self.engines.model_state(n)
            models[n] = "up" if st == AWAKE else st
        ok = all(v == "up" for v in models.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "models": models}, status_code=200 if ok else 503)

    async def serve_status(self):
        info_of, engines = self.engines.info_of, self.engines
        doc = {"models": {n: {"url": r.url, "device": r.device, "path": r.path, "state": engines.shown_state(n),
                              "sleep": info_of(r.engines[0][0]).get("sleep"), "replicas": engines.replicas_doc(n)}
                          for n, r in self.routes.items()},
               "admission": self.gate.policy.snapshot(), "router": self.metrics.snapshot(),
               "activity": None if self.publisher is None else self.publisher.status()}  # fmt: skip
        if self._status is not None:
            doc.update(self._status())
        return doc

    async def prometheus(self):
        text = self.metrics.render(self.gate.policy.snapshot(), self.engines.engines_doc(), ENGINE_STATES)
        return Response(text, media_type=CONTENT_TYPE)


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
    router = Router(
        routes, gate, state_of=engine_state or (lambda name: AWAKE if alive(name) else DEAD),
        info_of=engine_info or (lambda name: {}), api_key=api_key, request_timeout_s=request_timeout_s,
        monitor_interval_s=monitor_interval_s, failure_detect_s=failure_detect_s, status=status,
        client_kwargs=client_kwargs, activity_interval_s=activity_interval_s, activity_refresh_s=activity_refresh_s,
        activity_ttl_s=activity_ttl_s,
    )  # fmt: skip
    return router.app
