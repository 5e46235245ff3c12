"""Bad HTTP to the router (``serve/router.py``) gets a 4xx, never a 5xx, and the router stays healthy.

The router app runs under FastAPI's ``TestClient`` against two in-process fake engines that
answer 200 to every method and path (and mark their answers with ``x-fake-engine``), so any
5xx can only be the router's own. Hypothesis draws method x path x headers x body; every
answer must be the engine's 200 passed through, or the router's own refusal: an OpenAI-style
error (``{"error": {"message", "type", "param", "code"}}``) with a 4xx, or FastAPI's own
404 / 405 for a path or method no route takes. After each request a well-formed one still
answers 200 and no admission slot is held (nothing queued or in flight).

``MEMX_FUZZ_EXAMPLES`` (default 25) x 4 requests per test; see docs/reliability.md "Bad input".
"""

from __future__ import annotations

import json
import os
import urllib.parse

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_ext.policy.edf_admission import EdfAdmission, ModelLimits
from sglang_memx.serve.admission import AdmissionGate
from sglang_memx.serve.router import EngineRoute, build_app

EXAMPLES = int(os.environ.get("MEMX_FUZZ_EXAMPLES", "25")) * 4
KEY = "s3cret"
MODELS = ("a", "org/b")


def fake_engine(tag: str) -> FastAPI:
    """Answers 200 to anything, echoing what reached it (path, query, headers, body size)."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def anything(path: str, request: Request):
        body = await request.body()
        seen = {"engine": tag, "path": "/" + path, "query": str(request.url.query), "bytes": len(body),
                "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.raw}}  # fmt: skip
        return JSONResponse(seen, headers={"x-fake-engine": tag})

    return app


def router_app(api_key: str | None) -> tuple[FastAPI, AdmissionGate]:
    routes = {n: EngineRoute(n, f"http://engine-{i}", f"/models/{n}") for i, n in enumerate(MODELS)}
    mounts = {f"http://engine-{i}": httpx.ASGITransport(app=fake_engine(n)) for i, n in enumerate(MODELS)}
    gate = AdmissionGate(EdfAdmission({n: ModelLimits(1.0, max_inflight=4, max_queued=4) for n in MODELS}))
    return build_app(routes, gate, api_key=api_key, monitor_interval_s=0.5, client_kwargs={"mounts": mounts}), gate


@pytest.fixture(scope="module")
def open_router():
    app, gate = router_app(None)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.gate = gate
        yield c


@pytest.fixture(scope="module")
def keyed_router():
    app, gate = router_app(KEY)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.gate = gate
        yield c


# ------------------------------------------------------------------------ strategies

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
PREFIXES = ["/v1/", "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/", "/models/",
            "/models/a", "/models/a/", "/models/a/generate", "/models/org/b/", "/models/org/", "/health",
            "/memx/serve", "/metrics", "/", "/unknown/", "/v2/"]  # fmt: skip
ENCODED = ["", "%2e%2e/%2e%2e/etc/passwd", "..%2f..%2f", "%00", "a%00b", "%3Fq=1%23frag", "%2F", "%ff%fe",
           "%c3%a9", "//", "./.", "x" * 10_000, "%25", "generate", "v1/chat/completions", "a/generate"]  # fmt: skip
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # any code point, quoted into the URL
PATHS = st.builds(
    lambda pre, enc, txt, q: pre + enc + urllib.parse.quote(txt, safe="/") + q,
    st.sampled_from(PREFIXES),
    st.sampled_from(ENCODED),
    TEXT,
    st.sampled_from(["", "?x=1", "?model=a", "?%00=%ff", "?" + "q=" * 500, "?stream=true&stream=false"]),
)
CTYPES = ["application/json", "text/plain", "application/octet-stream", "multipart/form-data",
          "application/x-www-form-urlencoded", "application/json; charset=latin-1", "", "\xe9/\xe9"]  # fmt: skip
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
MODEL_VALUES = st.sampled_from(["a", "org/b", "", "A", "zzz", "a/", "/a", "a\x00", "org", " a"]) | JSONISH
OPTIONAL = {"model": MODEL_VALUES, "stream": JSONISH, "messages": JSONISH, "prompt": JSONISH, "text": JSONISH,
            "max_tokens": JSONISH, "extra": JSONISH}  # fmt: skip
DOCS = st.fixed_dictionaries({}, optional=OPTIONAL)
ODD_BODIES = [b"", b"{", b'{"model": "a"', b"[" * 100_000, b'{"model": "a", "x": ' + b"9" * 5000 + b"}",
              b'{"model": "a"}' + b" " * (2 << 20), b'\xef\xbb\xbf{"model": "a"}', b'{"model": "a"}\x00',
              '{"model": "a", "prompt": "\ud800"}'.encode("utf-8", "surrogatepass"),
              b'{"model": "a", "model": 5}', b'{"model": NaN}', b'"a"']  # fmt: skip
BODIES = st.one_of(
    DOCS.map(lambda d: json.dumps(d).encode()),
    JSONISH.map(lambda d: json.dumps(d).encode()),  # non-object JSON (and NaN / Infinity)
    st.binary(max_size=200),  # random binary, invalid UTF-8
    st.sampled_from(ODD_BODIES),
)
AUTH = st.sampled_from([None, f"Bearer {KEY}", "Bearer wrong", "Bearer", f"bearer {KEY}", f"Bearer {KEY} ",
                        KEY, "Basic Zm9vOmJhcg==", "Bearer \xe9\xe9", ""])  # fmt: skip
EXTRA_HEADER = st.sampled_from([None, ("x-odd", "caf\xe9"), ("x-odd", "\x7f\x01"), ("host", "evil"),
                                ("connection", "close, x-odd"), ("x-forwarded-for", "1" * 8000)])  # fmt: skip


def _send(c: TestClient, method: str, path: str, body: bytes, ctype: str | None, auth: str | None, extra):
    headers = []
    if ctype is not None:
        headers.append((b"content-type", ctype.encode("latin-1")))
    if auth is not None:
        headers.append((b"authorization", auth.encode("latin-1")))
    if extra is not None:
        headers.append((extra[0].encode(), extra[1].encode("latin-1")))
    return c.request(method, path, content=body, headers=headers)


def _check(r: httpx.Response, method: str) -> None:
    """The engine's 200 passed through, or the router's (or FastAPI's routing) 4xx."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if "x-fake-engine" in r.headers:
        assert r.status_code == 200, r.status_code  # what the engine said, unchanged
        return
    if r.status_code < 400 or method == "HEAD":
        return
    doc = r.json()
    if "detail" in doc:  # no route takes this path / method: FastAPI's own answer
        assert r.status_code in (404, 405) and set(doc) == {"detail"}, (r.status_code, doc)
        return
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert r.status_code in (400, 401, 404), (r.status_code, doc)  # a fake engine never sheds or dies


def _healthy(c: TestClient, auth: dict) -> None:
    """A well-formed request still answers 200 from the engine and no admission slot is held."""
    r = c.post("/v1/chat/completions", json={"model": "org/b", "messages": []}, headers=auth)
    assert r.status_code == 200 and r.json()["path"] == "/v1/chat/completions", r.text[:300]
    adm = c.gate.policy.snapshot()
    assert all(adm[m]["inflight"] == 0 and adm[m]["queued"] == 0 for m in MODELS), adm


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                             HealthCheck.too_slow])  # fmt: skip


@FUZZ
@given(method=st.sampled_from(METHODS), path=PATHS, body=BODIES, ctype=st.none() | st.sampled_from(CTYPES),
       extra=EXTRA_HEADER)  # fmt: skip
def test_random_requests_get_a_4xx_never_a_5xx(open_router, method, path, body, ctype, extra):
    _check(_send(open_router, method, path, body, ctype, None, extra), method)
    _healthy(open_router, {})


@FUZZ
@given(method=st.sampled_from(METHODS), path=PATHS, body=BODIES, auth=AUTH, extra=EXTRA_HEADER)
def test_random_requests_with_an_api_key_set_get_401_or_pass(keyed_router, method, path, body, auth, extra):
    r = _send(keyed_router, method, path, body, "application/json", auth, extra)
    _check(r, method)
    if auth != f"Bearer {KEY}" and urllib.parse.urlsplit(path).path != "/health":
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (r.status_code, r.text[:200])
        if method != "HEAD":
            assert r.json()["error"]["code"] == "invalid_api_key"
    if r.status_code == 200 and "x-fake-engine" in r.headers and method != "HEAD":
        assert r.json()["headers"]["authorization"] == f"Bearer {KEY}"  # the router's key, not the client's
    _healthy(keyed_router, {"Authorization": f"Bearer {KEY}"})


# ------------------------------------------------- regressions: what the fuzzer found (each was a 500)


def test_json_nested_deeper_than_the_parser_is_a_400(open_router):
    r = open_router.post("/v1/chat/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    _healthy(open_router, {})


def test_a_non_ascii_header_value_passes_through_to_the_engine(open_router):
    raw = "caf\xe9".encode()  # UTF-8 bytes; Starlette reads them as latin-1 text, httpx sent ASCII only
    r = open_router.post("/models/a/generate", json={"text": "x"}, headers=[(b"x-odd", raw)])
    assert r.status_code == 200 and r.json()["headers"]["x-odd"].encode("latin-1") == raw  # the very bytes
    _healthy(open_router, {})


@pytest.mark.parametrize(
    "path, engine_path",
    [("/models/a/x%00y", "/x\x00y"), ("/models/a/x%3Fq=1%23f", "/x?q=1#f"), ("/models/org/b/%20", "/ ")],
)
def test_a_decoded_nul_question_mark_or_hash_stays_in_the_engine_path(open_router, path, engine_path):
    r = open_router.get(path)
    assert r.status_code == 200 and r.json()["path"] == engine_path and r.json()["query"] == ""
    _healthy(open_router, {})
