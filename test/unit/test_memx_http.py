"""Bad HTTP to ``/memx/*`` gets a 4xx, never a 5xx (a malformed ``POST /memx/activity``: 400 naming
the field); upstream's ``--api-key`` / ``--admin-api-key``
check covers the memx routes as it covers upstream's own read-only ``/server_info``.

The routes are those ``hooks.http`` adds to upstream's app, on a fresh FastAPI app served by
FastAPI's TestClient (no server, no scheduler: ``up_http.scheduler_states`` answers one fake
rank). The API-key middleware is upstream's own, installed through ``up_http`` the way
upstream's ``launch_server`` installs it.
"""

from __future__ import annotations

import os
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_memx.config import MemxConfig
from sglang_memx.endpoints import ACTIVITY_PATH, add_status_routes
from sglang_memx.metrics import METRICS_PATH
from sglang_memx.slo_update import SLO_PATH
from sglang_memx.upstream import http as up_http

RANK = {"memx": {"kv_pool": {"capacity_tokens": 10}, "requests": {"running": 0, "waiting": 0}}}
EXAMPLES = int(os.environ.get("MEMX_FUZZ_EXAMPLES", "25")) * 4
PATH_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=30)  # what a client can put in a URL
CTYPES = ["application/json", "text/plain", "multipart/form-data", "application/x-www-form-urlencoded"]


def _app(status_path: str = "/memx/status", keys: tuple[str | None, str | None] | None = None) -> FastAPI:
    app = FastAPI()
    assert add_status_routes(app, MemxConfig(status_path=status_path))

    @app.get("/server_info")  # stands for upstream's read-only route (no auth level of its own)
    async def server_info():
        return {"ok": True}

    if keys is not None:
        up_http.add_api_key_middleware(app, api_key=keys[0], admin_api_key=keys[1])
    return app


SENT: list = []  # what POST /memx/activity handed to the (fake) schedulers


@pytest.fixture(autouse=True)
def one_fake_rank(monkeypatch):
    async def states():
        return [RANK]

    async def set_numbers(numbers):
        SENT.append(numbers)
        return [True]

    monkeypatch.setattr(up_http, "scheduler_states", states)
    monkeypatch.setattr(up_http, "set_scheduler_numbers", set_numbers)
    SENT.clear()


@pytest.fixture(scope="module")
def client():
    with TestClient(_app(), raise_server_exceptions=False) as c:
        yield c


def test_the_memx_routes_answer_and_only_activity_and_slo_take_a_post():
    app = _app()
    memx = {r.path: r.methods for r in app.router.routes if r.path.startswith("/memx")}
    assert memx == {"/memx/status": {"GET"}, METRICS_PATH: {"GET"}, ACTIVITY_PATH: {"POST"}, SLO_PATH: {"POST"}}
    with TestClient(app) as c:
        doc = c.get("/memx/status").json()
        assert doc["schedulers"][0]["kv_pool"] == {"capacity_tokens": 10}
        assert c.get(METRICS_PATH).status_code == 200


@pytest.mark.parametrize("path", ["/memx/status", METRICS_PATH])
@pytest.mark.parametrize(
    "method,kwargs,want",
    [
        ("POST", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 405),
        ("PUT", {"json": {"elastic_kv": True}}, 405),
        ("DELETE", {}, 405),
        ("PATCH", {"content": b"\xff" * 100}, 405),
        ("GET", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 200),
        ("GET", {"content": b"x" * (8 << 20)}, 200),  # an 8 MiB body on a GET: ignored, not read
        ("GET", {"params": {"dp_rank": "nan", "verbose": ["1", "2"], "": "\x00"}}, 200),
        ("GET", {"headers": {"content-length": "5"}, "content": b"12345"}, 200),
    ],
)
def test_wrong_methods_bodies_and_query_params(client, path, method, kwargs, want):
    r = client.request(method, path, **kwargs)
    assert r.status_code == want, (method, path, r.status_code, r.text[:200])
    if want == 405:
        assert r.headers["allow"] == "GET"


@pytest.mark.parametrize(
    "path", ["/memx", "/memx/", "/memx/status/", "/memx/status/x", "/memx/statu", "/memx/..%2fserver_info",
             "/memx/%00", "/memx/" + "a" * 10000, "/memx/metrics/extra", "/memx/status%3Fx=1"],
)  # fmt: skip
def test_unknown_sub_paths_are_404(client, path):
    r = client.get(path, follow_redirects=False)
    assert r.status_code in (404, 307), (path, r.status_code)  # 307: starlette's trailing-slash redirect
    if r.status_code == 307:
        assert r.headers["location"].endswith(path.rstrip("/"))


def test_a_custom_status_path_serves_only_there():
    with TestClient(_app("/ops/memx")) as c:
        assert c.get("/ops/memx").status_code == 200
        assert c.get("/memx/status").status_code == 404
        assert c.post("/ops/memx").status_code == 405


GOOD = {"model": "m", "queued": 2, "inflight": 1, "arrival_rate": 0.5, "queued_tokens": 300,
        "since_arrival_s": 0.2, "ttl_s": 5}  # fmt: skip


def sent(n: int) -> list:
    """SENT once it holds ``n`` messages (the handler hands them over on its own task)."""
    deadline = time.monotonic() + 5
    while len(SENT) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return SENT


def test_activity_is_accepted_and_handed_to_the_schedulers(client):
    r = client.post(ACTIVITY_PATH, json=GOOD)
    assert r.status_code == 202 and r.json() == {"accepted": True}
    assert len(sent(1)) == 1
    numbers = SENT[0]
    assert numbers["memx_activity_queued"] == 2 and numbers["memx_activity_queued_tokens"] == 300
    assert all(isinstance(v, (int, float)) for v in numbers.values())  # upstream's request carries numbers only
    r = client.post(ACTIVITY_PATH, json={"queued": 0, "inflight": 0, "arrival_rate": 0})
    assert r.status_code == 202 and sent(2)[-1]["memx_activity_queued_tokens"] == -1  # None on the wire
    assert client.get(ACTIVITY_PATH).status_code == 405


@pytest.mark.parametrize(
    "body,field",
    [
        (b"{not json", "body"), (b"", "body"), (b"[1, 2]", "body"),
        (b'{"inflight": 0, "arrival_rate": 0}', "queued"),
        (b'{"queued": -1, "inflight": 0, "arrival_rate": 0}', "queued"),
        (b'{"queued": 0, "inflight": 0.5, "arrival_rate": 0}', "inflight"),
        (b'{"queued": 0, "inflight": 0, "arrival_rate": "fast"}', "arrival_rate"),
        (b'{"queued": 0, "inflight": 0, "arrival_rate": 0, "ttl_s": 0}', "ttl_s"),
        (b'{"queued": 0, "inflight": 0, "arrival_rate": 0, "queued_tokens": 1e3}', "queued_tokens"),
        (b'{"queued": 0, "inflight": 0, "arrival_rate": 0, "speed": 1}', "speed"),
    ],
)  # fmt: skip
def test_a_malformed_activity_is_a_400_naming_the_field(client, body, field):
    r = client.post(ACTIVITY_PATH, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (body, r.status_code, r.text)
    err = r.json()["error"]
    assert err["field"] == field and err["message"].startswith(field + ":")
    assert not SENT  # nothing reached the schedulers


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    sub=st.sampled_from(["status", "metrics", "activity", ""]) | PATH_TEXT,
    params=st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=4),
    body=st.binary(max_size=2048),
    ctype=st.sampled_from(CTYPES),
)
def test_fuzzed_requests_to_memx_never_get_a_5xx(client, method, sub, params, body, ctype):
    r = client.request(method, "/memx/" + sub, params=params, content=body, headers={"content-type": ctype})
    assert r.status_code < 500, (method, sub, params, r.status_code, r.text[:200])


# --------------------------------------------------------------------------------- API keys
KEYS = [(None, None), ("k", None), (None, "adm"), ("k", "adm")]
TOKENS = [None, "Bearer k", "Bearer adm", "Bearer wrong", "k", "Basic k"]


@pytest.mark.parametrize("keys", KEYS, ids=lambda k: f"api={k[0]},admin={k[1]}")
def test_memx_routes_get_the_same_key_decision_as_upstreams_read_only_route(keys):
    """Whatever keys the server has and whatever the client sends, ``/memx/status`` and
    ``/memx/metrics`` are let through or refused exactly like ``/server_info``."""
    with TestClient(_app(keys=keys)) as c:
        for token in TOKENS:
            headers = {} if token is None else {"Authorization": token}
            ref = c.get("/server_info", headers=headers).status_code
            for path in ("/memx/status", METRICS_PATH):
                assert c.get(path, headers=headers).status_code == ref, (keys, token, path)
            assert c.post("/memx/status", headers=headers).status_code in (401, 405)  # never 5xx
            got = c.post(ACTIVITY_PATH, json=GOOD, headers=headers).status_code
            assert got == (202 if ref == 200 else ref), (keys, token)  # the key decision of a normal route


def test_api_key_is_required_on_memx_when_the_server_has_one():
    with TestClient(_app(keys=("k", "adm"))) as c:
        assert c.get("/memx/status").status_code == 401
        assert c.get("/memx/status", headers={"Authorization": "Bearer adm"}).status_code == 401
        assert c.get("/memx/status", headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get(METRICS_PATH, headers={"Authorization": "Bearer k"}).status_code == 200
    with TestClient(_app(keys=(None, "adm"))) as c:  # only an admin key: read-only routes stay open
        assert c.get("/memx/status").status_code == 200
