"""Upstream subsystem: HTTP server (``sglang.srt.entrypoints.http_server``).

* ``launch_server`` (before): adds ``GET <--memx-status-path>`` (default ``/memx/status``)
  and ``GET /memx/metrics`` to upstream's FastAPI app (``sglang_memx.endpoints``).
"""

from __future__ import annotations

from sglang_memx.endpoints import add_status_routes
from sglang_memx.upstream import http as up_http
from sglang_memx.upstream import server_args as up_args
from sglang_memx.upstream.registry import HookSpec


def before_launch_server(server_args, *args, **kwargs):
    add_status_routes(up_http.app(), up_args.config_of(server_args))


HOOKS = (
    HookSpec("sglang.srt.entrypoints.http_server.launch_server", "before", before_launch_server, "status_endpoint",
             "serve the memx status and metrics endpoints"),
)  # fmt: skip
