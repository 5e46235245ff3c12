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
* ``GET /health`` (200 when every engine is up, else 503), ``GET /memx/serve`` (placement,
  engines, admission counters).

Invariants:

* Generation requests (``POST /v1/...`` and ``POST /models/<name>/generate`` or
  ``/v1/...``) pass the admission gate before reaching the engine and hold their slot
  until the last byte of the response; other native calls pass straight through.
* Responses stream through chunk by chunk (SSE included) with the engine's status and
  content type; nothing is buffered whole.
* A refusal is an OpenAI-style error with ``Retry-After`` (429 queue full / hopeless
  deadline, 503 engine down); a request never hangs on a dead engine (the monitor marks
  it down within ``monitor_interval_s``; a broken connection ends the response).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .admission import AdmissionGate, Rejected

__all__ = ["EngineRoute", "build_app", "error_response"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "upgrade", "te",
        "trailer", "proxy-authenticate", "proxy-authorization", "host"}  # fmt: skip
_ERROR_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_exceeded",
               502: "engine_error", 503: "service_unavailable"}  # fmt: skip


@dataclass(frozen=True)
class EngineRoute:
    name: str
    url: str  # the engine's base URL
    path: str  # the model's checkpoint directory (shown in /v1/models)
    device: str | None = None


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:  # fmt: skip
    headers = {} if retry_after_s is None else {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "error"), "param": param,
                      "code": code or str(status)}}  # fmt: skip
    return JSONResponse(body, status_code=status, headers=headers)


def _rejected(exc: Rejected) -> JSONResponse:
    text = {
        "queue_full": f"model {exc.model!r} is overloaded: its queue is full",
        "deadline": f"model {exc.model!r} is overloaded: the request waited far past its TTFT SLO",
        "engine_down": f"model {exc.model!r} is unavailable: its engine is down",
    }.get(exc.reason, exc.reason)
    return error_response(exc.status, text, code=exc.reason, retry_after_s=exc.retry_after_s)


def _admitted(method: str, sub: str) -> bool:
    return method == "POST" and (sub == "/generate" or sub.startswith("/v1/"))


def build_app(
    routes: dict[str, EngineRoute],
    gate: AdmissionGate,
    alive: Callable[[str], bool] = lambda name: True,
    *,
    request_timeout_s: float = 600.0,
    monitor_interval_s: float = 0.25,
    status: Callable[[], dict] | None = None,
    client_kwargs: dict | None = None,
) -> FastAPI:
    """The router app over ``routes`` (model name -> engine). ``alive(name)`` is polled by a
    monitor; ``client_kwargs`` go to ``httpx.AsyncClient`` (tests pass in-process transports)."""
    created = int(time.time())
    by_length = sorted(routes, key=len, reverse=True)
    state: dict = {"down": set()}

    async def monitor():
        while True:
            for name in routes:
                ok = alive(name)
                if not ok and name not in state["down"]:
                    state["down"].add(name)
                    gate.engine_down(name)
                elif ok and name in state["down"]:
                    state["down"].discard(name)
                    gate.engine_up(name)
            gate.expire()
            await asyncio.sleep(monitor_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        timeout = httpx.Timeout(request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, **(client_kwargs or {})) as client:
            state["client"] = client
            task = asyncio.create_task(monitor())
            try:
                yield
            finally:
                task.cancel()

    app = FastAPI(title="sglang-memx router", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def forward(name: str, method: str, sub: str, request: Request, body: bytes) -> Response:
        route = routes[name]
        if name in state["down"] or not alive(name):
            return error_response(503, f"model {name!r} is unavailable: its engine is down", code="engine_down",
                                  retry_after_s=gate.retry_after_s(name))  # fmt: skip
        rid = None
        if _admitted(method, sub):
            try:
                rid = await gate.enter(name)
            except Rejected as exc:
                return _rejected(exc)

        def release():
            if rid is not None:
                gate.leave(rid)

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        client: httpx.AsyncClient = state["client"]
        url = route.url + sub
        try:
            upstream = await client.send(
                client.build_request(method, url, content=body, headers=headers, params=request.query_params),
                stream=True,
            )
        except httpx.HTTPError as exc:
            release()
            return error_response(503, f"model {name!r}: engine unreachable ({type(exc).__name__})",
                                  code="engine_down", retry_after_s=gate.retry_after_s(name))  # fmt: skip
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the engine died mid-response
                if sse:
                    err = {"error": {"message": f"engine of {name!r} failed mid-stream: {type(exc).__name__}",
                                     "type": "engine_error", "code": "engine_down"}}  # fmt: skip
                    yield f"data: {json.dumps(err)}\n\n".encode()
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
        except ValueError:
            return error_response(400, "the request body is not valid JSON")
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, str) or not model:
            return error_response(400, "the request needs a 'model' field naming a served model", param="model")
        if model not in routes:
            known = ", ".join(routes)
            return error_response(404, f"the model {model!r} does not exist (served: {known})",
                                  code="model_not_found", param="model")  # fmt: skip
        return await forward(model, "POST", "/v1/" + rest, request, body)

    @app.api_route("/models/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def native_route(rest: str, request: Request):
        for name in by_length:
            if rest == name or rest.startswith(name + "/"):
                sub = rest[len(name) :] or "/"
                return await forward(name, request.method, sub, request, await request.body())
        known = ", ".join(routes)
        return error_response(404, f"no served model prefixes /models/{rest} (served: {known})",
                              code="model_not_found")  # fmt: skip

    @app.get("/health")
    async def health():
        models = {n: ("down" if n in state["down"] or not alive(n) else "up") for n in routes}
        ok = all(v == "up" for v in models.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "models": models}, status_code=200 if ok else 503)

    @app.get("/memx/serve")
    async def serve_status():
        doc = {"models": {n: {"url": r.url, "device": r.device, "path": r.path} for n, r in routes.items()},
               "admission": gate.policy.snapshot()}  # fmt: skip
        if status is not None:
            doc.update(status())
        return doc

    return app
