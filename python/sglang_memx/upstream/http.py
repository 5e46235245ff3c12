"""Upstream's HTTP server (``sglang.srt.entrypoints.http_server``) as memx extends it."""

from __future__ import annotations

from sglang_memx.upstream.manifest import resolve


def app():
    """Upstream's FastAPI application."""
    return resolve("sglang.srt.entrypoints.http_server.app")


def has_route(application, path: str) -> bool:
    return any(vars(route).get("path") == path for route in application.router.routes)  # starlette routes


async def scheduler_states() -> list:
    """Every scheduler's internal state (upstream's own request/response pair), in DP-rank order."""
    global_state = resolve("sglang.srt.entrypoints.http_server.get_global_state")()
    return await global_state.tokenizer_manager.get_internal_state()
