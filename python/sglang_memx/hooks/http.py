"""Upstream subsystem: HTTP server (``sglang.srt.entrypoints.http_server``).

* ``launch_server`` (before): adds ``GET <--memx-status-path>`` (default
  ``/memx/status``) to upstream's FastAPI app. The handler asks every
  scheduler for its internal state (upstream's own request/response pair, now
  carrying a ``memx`` section, see hooks/scheduler.py) and returns the
  combined status document; and ``GET /memx/metrics``, the same numbers in
  Prometheus text format (``sglang_memx.metrics``).
"""

from __future__ import annotations

import logging

from sglang_memx.config import MemxConfig
from sglang_memx.hooks import HookSpec
from sglang_memx.metrics import CONTENT_TYPE, METRICS_PATH, render_prometheus
from sglang_memx.runtime import config_of
from sglang_memx.status import status_document

logger = logging.getLogger("sglang_memx")


def make_status_handler(config: MemxConfig):
    async def memx_status():
        from sglang.srt.entrypoints import http_server

        manager = http_server.get_global_state().tokenizer_manager
        rank_states = await manager.get_internal_state()
        return status_document(config, rank_states)

    memx_status.__name__ = "memx_status"
    return memx_status


def make_metrics_handler(config: MemxConfig):
    status = make_status_handler(config)

    async def memx_metrics():
        from fastapi.responses import Response

        return Response(render_prometheus(await status()), media_type=CONTENT_TYPE)

    return memx_metrics


def add_status_route(app, config: MemxConfig) -> bool:
    """Add the status route to ``app`` once; returns whether it was added."""
    if config.disabled:
        return False
    if any(getattr(r, "path", None) == config.status_path for r in app.router.routes):
        return False
    app.add_api_route(
        config.status_path, make_status_handler(config), methods=["GET"], name="memx_status", include_in_schema=True
    )
    if METRICS_PATH != config.status_path and not any(
        getattr(r, "path", None) == METRICS_PATH for r in app.router.routes
    ):
        app.add_api_route(
            METRICS_PATH, make_metrics_handler(config), methods=["GET"], name="memx_metrics", include_in_schema=True
        )
    logger.info("memx: serving GET %s and GET %s", config.status_path, METRICS_PATH)
    return True


def before_launch_server(server_args, *args, **kwargs):
    from sglang.srt.entrypoints import http_server

    add_status_route(http_server.app, config_of(server_args))
    return None


HOOKS = (
    HookSpec(
        "sglang.srt.entrypoints.http_server.launch_server",
        "before",
        before_launch_server,
        expects=("server_args",),
        why="serve the memx status endpoint",
    ),
)
