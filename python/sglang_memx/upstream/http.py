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


async def set_scheduler_numbers(numbers: dict) -> list:
    """Send ``numbers`` to every scheduler through upstream's ``/set_internal_state`` request pair
    (a scheduler hook answers memx's own keys); returns each rank's ``updated``."""
    global_state = resolve("sglang.srt.entrypoints.http_server.get_global_state")()
    request = resolve("sglang.srt.managers.io_struct.SetInternalStateReq")(server_args=numbers)
    return await global_state.tokenizer_manager.set_internal_state(request)


def add_api_key_middleware(application, api_key: str | None, admin_api_key: str | None) -> None:
    """Upstream's API-key check, installed the way its ``launch_server`` does when ``--api-key`` or
    ``--admin-api-key`` is given: one middleware over the whole app, so memx's routes are covered
    like upstream's own (a route without an auth level counts as a normal one, as ``/server_info``).
    Tests use it to check memx's routes against upstream's check without starting a server."""
    resolve("sglang.srt.utils.auth.add_api_key_middleware")(application, api_key=api_key, admin_api_key=admin_api_key)


def admin_optional(endpoint):
    """``endpoint`` marked with upstream's ``ADMIN_OPTIONAL`` auth level (its ``/set_internal_state``'s):
    with ``--admin-api-key`` set, upstream's middleware asks for that key."""
    level = resolve("sglang.srt.utils.auth.AuthLevel.ADMIN_OPTIONAL")
    return resolve("sglang.srt.utils.auth.auth_level")(level)(endpoint)
