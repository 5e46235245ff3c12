"""benchmark/faults.py's and the soak client's bookkeeping, without SGLang: the client reads
finish_reason and token counts from a stub router (OpenAI chat / completions, streams with their
usage chunk, native ``/generate``'s ``meta_info``) and names its errors; a reset injected by the
load driver passes in a router kill's window in faults and fails the soak."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler

import pytest

from benchmark.accounting import LeakLimits, faults_verdict, judge, soak_verdict
from benchmark.faults import DEFAULT_KINDS
from benchmark.load_driver import LoadDriver
from benchmark.soak_client import Client, program_answer
from support.http_stub import serving


class StubRouter(BaseHTTPRequestHandler):
    """Answers as the router would; ``reason`` / ``cut`` / ``down`` switch what it says."""

    reason = "length"
    cut = False
    down = False

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes, kind="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.down:
            body = {"error": {"message": "restarting", "code": "engine_restarting"}}
            return self._send(503, json.dumps(body).encode())
        n = req.get("max_tokens") or req.get("sampling_params", {}).get("max_new_tokens")
        if self.path.endswith("/generate"):
            meta = {"finish_reason": {"type": self.reason}, "completion_tokens": n}
            return self._send(200, json.dumps({"text": "x", "meta_info": meta}).encode())
        if not req.get("stream"):
            body = {"choices": [{"message": {"content": "x"}, "text": "x", "finish_reason": self.reason}],
                    "usage": {"completion_tokens": n}}  # fmt: skip
            return self._send(200, json.dumps(body).encode())
        events = [{"choices": [{"delta": {"content": "x"}, "finish_reason": None}]} for _ in range(3)]
        events.append({"choices": [{"delta": {}, "finish_reason": self.reason}]})
        events.append({"choices": [], "usage": {"completion_tokens": n}})
        lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ([] if self.cut else ["data: [DONE]\n\n"])
        self._send(200, "".join(lines).encode(), "text/event-stream")


@pytest.fixture
def router():
    try:
        with serving(StubRouter) as url:
            yield url
    finally:
        StubRouter.reason, StubRouter.cut, StubRouter.down = "length", False, False


@pytest.mark.parametrize("kind", ["chat", "chat_stream", "long", "generate"])
def test_the_client_reads_finish_reason_and_tokens(router, kind):
    client = Client(router, timeout=10)
    got = client.run("m", kind, 1)
    assert (got["result"], got["finish_reason"], got["tokens"] == got["expected_tokens"]) == ("ok", "length", True)
    StubRouter.reason = "abort"
    got = client.run("m", kind, 2)
    assert (got["result"], got["finish_reason"]) == ("ok", "abort")


def test_the_clients_errors_are_named_and_an_abort_is_ours(router):
    client = Client(router, timeout=10)
    assert client.run("m", "abort", 1)["result"] == "aborted"
    StubRouter.cut = True
    got = client.run("m", "chat_stream", 2)
    assert (got["result"], got["error"]) == ("failed", "stream ended without [DONE]")
    StubRouter.down = True
    got = client.run("m", "chat", 3)
    assert (got["result"], got["status"]) == ("error", 503) and "engine_restarting" in got["error"]


def test_the_client_through_the_driver_and_the_judge(router):
    """A stub that answers abort with HTTP 200: every request of the run fails, by name."""
    StubRouter.reason = "abort"
    load = LoadDriver(workers=2)
    load.start(Client(router, timeout=10), [(0.0, "m", "long"), (0.01, "m", "generate")])
    load.join(10)
    verdict = judge(load.outcomes)
    assert verdict["failure_reasons"] == {"answered 200 with finish_reason 'abort'": 2}


def test_a_programs_forks_make_one_answer():
    full = {"finish_reason": {"type": "length"}, "completion_tokens": 8}
    assert program_answer([full, full], 8)["finish_reason"] == "length"
    stopped = program_answer([full, {"finish_reason": {"type": "stop"}, "completion_tokens": 3}], 8)
    assert (stopped["finish_reason"], stopped["tokens"], stopped["expected_tokens"]) == ("stop", 11, 16)
    assert (
        program_answer([full, {"finish_reason": {"type": "abort"}, "completion_tokens": 2}], 8)["finish_reason"]
        == "abort"
    )


class AnsweringClient:
    def run(self, name, kind, n):
        return {"result": "ok", "status": 200, "finish_reason": "stop", "tokens": 3, "expected_tokens": 8}


def test_an_injected_reset_passes_in_a_router_kills_window_and_fails_the_soak():
    t0 = time.monotonic()
    load = LoadDriver(workers=2, origin=t0, fault="reset", fault_every=2)
    load.start(AnsweringClient(), [(0.0, "a", "chat"), (0.01, "b", "chat")])
    load.join(10)
    faults = [{"n": 0, "kind": "router", "t": 0.0, "t_recovered": 1.0, "target": "router", "incarnation": 0}]
    checks, details = faults_verdict(load.outcomes, faults, [{}, {}], {}, {}, 30.0, 0)
    assert all(checks.values()), details
    assert details["judgement"]["excused_by_kills"] == 1
    checks, details = soak_verdict(load.outcomes, {}, {}, {}, LeakLimits(), 0, 1)
    assert details["judgement"]["failure_reasons"] == {"connection error outside any kill window": 1}
    assert DEFAULT_KINDS == ("engine", "arbiter", "peer_donor", "router")
