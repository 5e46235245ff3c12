"""The router's streaming part: an engine's answer relayed to the client chunk by chunk.

Invariants:

* ``open_reply`` returns only once the engine's first chunk arrived (that instant is the TTFT
  the router measures); until then nothing has reached the client, so a failed engine can
  still be retried. On a failure it closes what it opened.
* ``relay`` passes the engine's status, headers (hop-by-hop ones dropped) and chunks (SSE
  included) through as they come; nothing is buffered whole.
* After bytes were sent, an engine failure ends an SSE stream with a ``data: {"error": ...}``
  event and cuts any other body (``EngineFailedMidBody``: the server aborts the connection,
  so the client sees an incomplete response rather than a truncated one that looks whole).
* The engine's response is closed and the request's ``release`` called whichever way the
  body ends (``release`` must be idempotent: the response's background task calls it too).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from .metrics import RouterMetrics

__all__ = ["EngineReply", "EngineFailedMidBody", "HOP_BY_HOP", "open_reply", "relay", "sse_events"]

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "upgrade",
              "te", "trailer", "proxy-authenticate", "proxy-authorization", "host"}  # fmt: skip


class EngineFailedMidBody(Exception):
    """Raised inside a non-SSE body after bytes were sent: the server aborts the connection."""


def sse_events(chunk: bytes) -> int:
    """SSE data events in ``chunk`` that carry output (``[DONE]`` excluded); approximate when an
    event straddles two chunks (it then counts in the chunk holding its ``data:``)."""
    return chunk.count(b"data:") - chunk.count(b"data: [DONE]")


@dataclass
class EngineReply:
    """An engine's streamed response whose first chunk (``b""`` for an empty body) has arrived."""

    response: httpx.Response
    body: AsyncIterator[bytes]
    first: bytes


async def open_reply(client: httpx.AsyncClient, request: httpx.Request) -> EngineReply:
    """Send ``request`` and wait for the first chunk of the answer; raises ``httpx.HTTPError``."""
    upstream = None
    try:
        upstream = await client.send(request, stream=True)
        body = upstream.aiter_raw()
        try:
            first = await body.__anext__()
        except StopAsyncIteration:
            first = b""
        return EngineReply(upstream, body, first)
    except httpx.HTTPError:
        if upstream is not None:
            await upstream.aclose()
        raise


def relay(name: str, reply: EngineReply, t_first: float, *, measure_tpot: bool, tpot_slo_s: float | None,
          metrics: RouterMetrics, release: Callable[[], None]) -> StreamingResponse:  # fmt: skip
    """The client's response: ``reply`` relayed; with ``measure_tpot`` an SSE stream's time per
    output token (its events after the first) is observed for ``name``."""
    upstream = reply.response
    sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks():
        events, t_last = sse_events(reply.first), t_first
        try:
            if reply.first:
                yield reply.first
            async for chunk in reply.body:
                n = sse_events(chunk)
                if n:
                    events, t_last = events + n, time.monotonic()
                yield chunk
        except httpx.HTTPError as exc:  # the engine died mid-response
            metrics.engine_failure(name, streamed=True)
            metrics.shed_one(name, "engine_failed_mid_response")
            if not sse:
                raise EngineFailedMidBody(f"engine of {name!r} failed mid-response: {type(exc).__name__}") from exc
            err = {"error": {"message": f"engine of {name!r} failed mid-stream: {type(exc).__name__}",
                             "type": "engine_error", "param": None, "code": "engine_down"}}  # fmt: skip
            yield f"data: {json.dumps(err)}\n\n".encode()
        else:
            if sse and measure_tpot and events > 1:
                metrics.observe_tpot(name, (t_last - t_first) / (events - 1), tpot_slo_s)
        finally:
            await upstream.aclose()
            release()

    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=out_headers,
                             background=BackgroundTask(release))  # fmt: skip
