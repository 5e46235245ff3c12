"""The HTTP endpoints memx adds to upstream's server: ``GET <--memx-status-path>`` (JSON,
``sglang_memx.status``), ``GET /memx/metrics`` (Prometheus text, ``sglang_memx.metrics``),
``POST /memx/activity`` (a router's activity for this server's model, ``sglang_memx.router_activity``)
and ``POST /memx/slo`` (the TPOT SLO, ``sglang_memx.slo_update``).

The GET handlers ask every scheduler for its internal state (upstream's own request/response
pair, now carrying a ``memx`` section, see ``hooks.scheduler``) and combine the answers.

The status routes are read-only and GET-only (any other method: 405; any other ``/memx/`` path:
404; query strings and request bodies are ignored). Two routes change state. ``POST /memx/activity``
changes only advisory state: what the router holds for this model, which can make the server keep
memory and stay awake, never give up more (a malformed body: 400 naming the field; accepted: 202,
the schedulers get the latest message, older ones still on their way are superseded, never
queued). ``POST /memx/slo`` sets the TPOT SLO the governor keeps (``sglang_memx.slo_update``:
400 / 409 naming the field, 200 once every scheduler holds it).

Keys: upstream's ``--api-key`` / ``--admin-api-key`` middleware covers the whole app.
``POST /memx/slo`` carries the auth level of upstream's own ``/set_internal_state`` (admin
optional: with ``--admin-api-key`` it needs that key). The other memx routes carry no auth
level, so upstream treats them as it treats its own read-only ``/server_info``: with
``--api-key`` they need ``Authorization: Bearer <api key>``, with only ``--admin-api-key`` they
are open. (Upstream's ``/metrics`` is exempt by its path;
``/memx/metrics`` is not: a scraper sends the API key.) ``test/unit/test_memx_http.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import Request

from memory_ext.policy.router_activity import ActivityError, parse_activity
from sglang_memx import router_activity, slo_update
from sglang_memx.config import MemxConfig
from sglang_memx.metrics import CONTENT_TYPE, METRICS_PATH, render_prometheus
from sglang_memx.status import status_document
from sglang_memx.upstream import http as up_http

logger = logging.getLogger("sglang_memx")


def make_status_handler(config: MemxConfig):
    async def memx_status():
        return status_document(config, await up_http.scheduler_states())

    return memx_status


def make_metrics_handler(config: MemxConfig):
    status = make_status_handler(config)

    async def memx_metrics():
        from fastapi.responses import Response

        return Response(render_prometheus(await status()), media_type=CONTENT_TYPE)

    return memx_metrics


ACTIVITY_PATH = "/memx/activity"


class _ActivitySender:
    """Hands the latest accepted activity to the schedulers, one send at a time: a message that
    arrives while one is on its way replaces any still waiting (the newest one wins)."""

    def __init__(self):
        self.pending: dict | None = None
        self.task: asyncio.Task | None = None
        self.sent = self.failed = 0

    def offer(self, numbers: dict) -> None:
        self.pending = numbers
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.pending is not None:
            numbers, self.pending = self.pending, None
            try:
                await up_http.set_scheduler_numbers(numbers)
                self.sent += 1
            except Exception:  # a scheduler that cannot take it now: the router sends again within ~1 s
                self.failed += 1
                logger.exception("memx: could not pass the router activity to the scheduler")


def make_activity_handler():
    from fastapi.responses import JSONResponse

    sender = _ActivitySender()

    async def memx_activity(request: Request):
        raw = await request.body()
        try:
            doc = json.loads(raw or b"null")
        except ValueError:
            return JSONResponse({"error": {"field": "body", "message": "body: not valid JSON"}}, status_code=400)
        try:
            act = parse_activity(doc, time.monotonic())
        except ActivityError as exc:
            return JSONResponse({"error": {"field": exc.field, "message": str(exc)}}, status_code=400)
        sender.offer(router_activity.to_wire(act))
        return JSONResponse({"accepted": True}, status_code=202)

    memx_activity.sender = sender
    return memx_activity


def make_slo_handler(config: MemxConfig):
    """``POST /memx/slo``: 200 with the SLO in force once every scheduler holds it; 400 / 409 naming
    the field (``slo_update.parse``); 503 when a scheduler did not take it."""
    from fastapi.responses import JSONResponse

    def error(field: str, message: str, status: int):
        return JSONResponse({"error": {"field": field, "message": message}}, status_code=status)

    async def memx_slo(request: Request):
        raw = await request.body()
        try:
            tpot_ms = slo_update.parse(json.loads(raw or b"null"), config)
        except slo_update.SloUpdateError as exc:
            return error(exc.field, exc.message, exc.status)
        except ValueError:
            return error("body", "body: not valid JSON", 400)
        updated = await up_http.set_scheduler_numbers(slo_update.to_wire(tpot_ms))
        if not updated or not all(updated):
            return error(slo_update.FIELD, f"{slo_update.FIELD}: a scheduler did not take it ({updated}); "
                         "GET the status for the SLO in force", 503)  # fmt: skip
        logger.info("memx: TPOT SLO set to %s ms by %s", tpot_ms, slo_update.SOURCE)
        return JSONResponse({slo_update.FIELD: tpot_ms, "source": slo_update.SOURCE}, status_code=200)

    # the level of upstream's own /set_internal_state: with --admin-api-key, only the admin key
    return up_http.admin_optional(memx_slo)


def add_status_routes(app, config: MemxConfig) -> bool:
    """Add the status (and metrics) routes to ``app`` once; returns whether they were added."""
    if config.disabled or up_http.has_route(app, config.status_path):
        return False
    app.add_api_route(config.status_path, make_status_handler(config), methods=["GET"], name="memx_status",
                      include_in_schema=True)  # fmt: skip
    if METRICS_PATH != config.status_path and not up_http.has_route(app, METRICS_PATH):
        app.add_api_route(METRICS_PATH, make_metrics_handler(config), methods=["GET"], name="memx_metrics",
                          include_in_schema=True)  # fmt: skip
    if not up_http.has_route(app, ACTIVITY_PATH):
        app.add_api_route(ACTIVITY_PATH, make_activity_handler(), methods=["POST"], name="memx_activity",
                          include_in_schema=True)  # fmt: skip
    if not up_http.has_route(app, slo_update.SLO_PATH):
        app.add_api_route(slo_update.SLO_PATH, make_slo_handler(config), methods=["POST"], name="memx_slo",
                          include_in_schema=True)  # fmt: skip
    logger.info("memx: serving GET %s, GET %s, POST %s and POST %s", config.status_path, METRICS_PATH,
                ACTIVITY_PATH, slo_update.SLO_PATH)  # fmt: skip
    return True
