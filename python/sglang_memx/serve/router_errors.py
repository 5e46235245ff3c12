"""The router's refusals: OpenAI-style error bodies, and the API-key gate in front of every route.

Invariants: every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the
status's OpenAI error type; a ``Retry-After`` is a whole number of seconds, at least 1; with
an API key every HTTP route but ``/health`` needs ``Authorization: Bearer <key>`` (compared in
constant time) and answers 401 otherwise.
"""

from __future__ import annotations

import hmac
import math

from fastapi.responses import JSONResponse

from .admission import Rejected

__all__ = ["error_body", "error_response", "rejected_response", "ApiKeyGate"]

_ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               429: "rate_limit_exceeded", 502: "engine_error", 503: "service_unavailable",
               504: "engine_error"}  # fmt: skip


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI-style body of a refusal (also what ``serve`` answers while its engines start)."""
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "error"), "param": param,
                      "code": code or str(status)}}  # fmt: skip


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None, headers: dict | None = None) -> JSONResponse:  # fmt: skip
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def rejected_response(exc: Rejected) -> JSONResponse:
    """The admission gate's refusal (429 queue full / hopeless deadline, 503 engine down or restarting)."""
    text = {
        "queue_full": f"model {exc.model!r} is overloaded: its queue is full",
        "deadline": f"model {exc.model!r} is overloaded: the request waited far past its TTFT SLO",
        "engine_down": f"model {exc.model!r} is unavailable: its engine is down",
        "engine_restarting": f"model {exc.model!r} is unavailable: its engine is restarting",
    }.get(exc.reason, exc.reason)
    return error_response(exc.status, text, code=exc.reason, retry_after_s=exc.retry_after_s)


class ApiKeyGate:
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
