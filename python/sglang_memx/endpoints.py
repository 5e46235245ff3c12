"""The HTTP endpoints memx adds to upstream's server: ``GET <--memx-status-path>`` (JSON,
``sglang_memx.status``) and ``GET /memx/metrics`` (Prometheus text, ``sglang_memx.metrics``).

The handlers ask every scheduler for its internal state (upstream's own request/response
pair, now carrying a ``memx`` section, see ``hooks.scheduler``) and combine the answers.

Both routes are read-only and GET-only (any other method: 405; any other ``/memx/`` path:
404; query strings and request bodies are ignored), and memx adds no state-changing route.
Keys: upstream's ``--api-key`` / ``--admin-api-key`` middleware covers the whole app; the
memx routes carry no auth level, so upstream treats them as it treats its own read-only
``/server_info``: with ``--api-key`` they need ``Authorization: Bearer <api key>``, with
only ``--admin-api-key`` they are open. (Upstream's ``/metrics`` is exempt by its path;
``/memx/metrics`` is not: a scraper sends the API key.) ``test/unit/test_memx_http.py``.
"""

from __future__ import annotations

import logging

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


def add_status_routes(app, config: MemxConfig) -> bool:
    """Add the status (and metrics) routes to ``app`` once; returns whether they were added."""
    if config.disabled or up_http.has_route(app, config.status_path):
        return False
    app.add_api_route(config.status_path, make_status_handler(config), methods=["GET"], name="memx_status",
                      include_in_schema=True)  # fmt: skip
    if METRICS_PATH != config.status_path and not up_http.has_route(app, METRICS_PATH):
        app.add_api_route(METRICS_PATH, make_metrics_handler(config), methods=["GET"], name="memx_metrics",
                          include_in_schema=True)  # fmt: skip
    logger.info("memx: serving GET %s and GET %s", config.status_path, METRICS_PATH)
    return True
