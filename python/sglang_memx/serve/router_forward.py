"""The router's forwarding part: one request, through admission, to one of its model's engines and back.

Invariants:

* Generation requests (``POST /v1/...`` and ``POST /models/<name>/generate`` or
  ``/v1/...``) pass the admission gate before reaching the engine and hold their slot
  until the last byte of the response; other native calls pass straight through (and are
  refused with 503 while the model is not awake).
* Headers go as raw bytes (a non-ASCII value passes through as sent), hop-by-hop ones
  dropped; the path is re-quoted (a decoded NUL, '?' or '#' stays in the path instead of
  breaking or reshaping the engine's URL); with an API key the client's ``Authorization``
  is replaced by the router's.
* Engine failure before any byte was sent: a generation is retried once, after the engine
  restarted (it waits in the admission queue like a new request, within the same horizon,
  else 503 ``engine_restarting``); a native call that is not a generation ends with 503; a
  connection broken while the engine stays ``awake`` for ``failure_detect_s`` is 502, an
  engine silent for ``request_timeout_s`` 504. A request never hangs on a dead engine.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable

import httpx
from fastapi import Request
from fastapi.responses import Response

from .activity import estimate_tokens
from .admission import Rejected
from .metrics import RouterMetrics
from .router_admission import Admission, Slot
from .router_engines import AWAKE, DEAD, Engines
from .router_errors import error_response, rejected_response
from .router_stream import HOP_BY_HOP, EngineReply, open_reply, relay

__all__ = ["Forwarder", "is_generation"]

_RETRY = object()  # an attempt's outcome: try once more


def is_generation(method: str, sub: str) -> bool:
    """Whether a call of ``sub`` on a model's engine passes the admission gate."""
    return method == "POST" and (sub == "/generate" or sub.startswith("/v1/"))


class Forwarder:
    """Sends requests to the engines over ``client`` (set by the app's lifespan)."""

    def __init__(self, engines: Engines, admission: Admission, metrics: RouterMetrics, *, api_key: str | None,
                 request_timeout_s: float):  # fmt: skip
        self.engines = engines
        self.admission = admission
        self.metrics = metrics
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.client: httpx.AsyncClient | None = None

    async def forward(self, name: str, method: str, sub: str, request: Request, body: bytes) -> Response:
        """``method sub`` on one of ``name``'s engines; the engine's streamed answer or a refusal."""
        arrival = time.monotonic()
        admitted = is_generation(method, sub)
        st = self.admission.sync(name)
        if st == DEAD:
            return self.admission.unavailable(name, st, f"model {name!r} is unavailable: its engine is down")
        if st != AWAKE and not admitted:
            return self.admission.unavailable(name, st, f"model {name!r} is unavailable: its engine is {st}")
        headers = self._engine_headers(request)
        client = self.client
        quoted = urllib.parse.quote(sub, safe="/:@!$&'()*+,;=")
        try:  # the same path on every replica: checked once, built per replica below
            client.build_request(method, self.engines.routes[name].url + quoted, content=body, headers=headers,
                                 params=request.query_params)  # fmt: skip
        except httpx.InvalidURL as exc:
            return error_response(400, f"cannot forward this request to model {name!r}: {exc}", code="invalid_url")

        def build(url: str) -> httpx.Request:
            return client.build_request(method, url + quoted, content=body, headers=headers,
                                        params=request.query_params)  # fmt: skip

        slot = self.admission.slot()
        outcome = await self._attempt(name, admitted, slot, build, estimate_tokens(body), retry=False)
        if outcome is _RETRY:
            outcome = await self._attempt(name, admitted, slot, build, estimate_tokens(body), retry=True)
            if isinstance(outcome, EngineReply):
                self.metrics.retry(name, "ok")
        if not isinstance(outcome, EngineReply):
            return outcome
        t_first = time.monotonic()
        status = outcome.response.status_code
        ok = status < 400
        if admitted and ok:
            self.metrics.observe_ttft(name, t_first - arrival, self.admission.gate.policy.models[name].ttft_slo_s)
        self.metrics.response(name, status)
        return relay(name, outcome, t_first, measure_tpot=admitted and ok,
                     tpot_slo_s=self.engines.routes[name].tpot_slo_s, metrics=self.metrics,
                     release=slot.release)  # fmt: skip

    def _engine_headers(self, request: Request) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in request.headers.raw if k.lower().decode("latin-1") not in HOP_BY_HOP]
        if self.api_key:
            headers = [(k, v) for k, v in headers if k.lower() != b"authorization"]
            headers.append((b"Authorization", f"Bearer {self.api_key}".encode()))
        return headers

    async def _attempt(self, name: str, admitted: bool, slot: Slot, build: Callable[[str], httpx.Request],
                       tokens: int, *, retry: bool):  # fmt: skip
        """One try: admission (generations), a replica, the engine's first chunk. Returns the
        ``EngineReply``, a refusal (``Response``), or ``_RETRY`` (only when not ``retry``)."""
        if admitted:
            try:
                await slot.enter(name, tokens)
            except Rejected as exc:
                if retry:
                    self.metrics.retry(name, "shed")
                return self.admission.refuse(name, rejected_response(exc), exc.reason)
        target = self.engines.pick(name)
        if target is None:  # every replica left awake since the check above
            slot.release()
            st = self.admission.sync(name)
            if not retry and admitted and st != DEAD:
                return _RETRY  # wait in the queue for one to be back, like a retry
            return self.admission.unavailable(name, st, f"model {name!r} is unavailable: its engine is {st}")
        key, url = target
        slot.hold(key)
        try:
            return await open_reply(self.client, build(url))
        except httpx.HTTPError as exc:
            slot.release()
            self.metrics.engine_failure(name, streamed=False)
            if isinstance(exc, httpx.TimeoutException):
                msg = f"model {name!r}: the engine did not answer within {self.request_timeout_s:g} s"
                return self.admission.refuse(name, error_response(504, msg, code="engine_timeout"), "engine_timeout")
            died = await self.admission.engine_failed(name, key)
            if not retry and died and admitted:
                return _RETRY  # nothing reached the client: once more, after the restart
            if retry:
                self.metrics.retry(name, "failed")
            if died:
                st = self.admission.sync(name)
                msg = f"model {name!r}: its engine failed during the request ({type(exc).__name__}); it is {st}"
                return self.admission.unavailable(name, st, msg)
            msg = f"model {name!r}: the engine broke the connection ({type(exc).__name__})"
            return self.admission.refuse(name, error_response(502, msg, code="engine_error"), "engine_error")
