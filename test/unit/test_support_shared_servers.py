"""The test support's shared servers (issue 27 item 6): one started server per spec, the spec
being what shapes its answers; modules' stops leave shared servers to the session."""

from __future__ import annotations

import pytest

from support import server as srv
from support.server import SGLangServer, release_all, stop_all
from support.shared_servers import SharedServers


def _server(name="s", *, stock=True, tokens=4096, args=("--dtype", "float32"), env=None):
    return SGLangServer("/models/m", name=name, stock=stock, max_total_tokens=tokens, extra_args=list(args), env=env)


def test_the_spec_ignores_the_port_and_the_name_but_not_what_shapes_answers():
    a, b = _server("a"), _server("b")
    assert a.spec_key() == b.spec_key()
    for other in (
        _server(stock=False),
        _server(tokens=8192),
        _server(args=("--dtype", "bfloat16")),
        _server(args=("--dtype", "float32", "--chunked-prefill-size", "16")),
        _server(env={"OMP_NUM_THREADS": "2"}),
    ):
        assert other.spec_key() != a.spec_key()


def test_the_registry_hands_out_the_first_server_of_a_spec():
    registry = SharedServers()
    first = registry.get(_server("ekv-stock"))
    again = registry.get(_server("gov-stock"))
    different = registry.get(_server("other", tokens=2048))
    assert again is first and first.shared and different is not first
    assert len(registry) == 2


class _Recorder(SGLangServer):
    """Counts the stop calls instead of signalling a process."""

    def __init__(self, name, log):
        super().__init__("/models/m", name=name)
        self.log = log

    def terminate(self):
        self.log.append(("terminate", self.name))

    def stop(self):
        self.log.append(("stop", self.name))


def test_module_stops_leave_shared_servers_and_the_session_stops_them():
    log: list = []
    registry = SharedServers()
    shared = registry.get(_Recorder("shared", log))
    own = _Recorder("own", log)
    stop_all([shared, own])
    assert log == [("terminate", "own"), ("stop", "own")]
    log.clear()
    release_all([shared, own])
    srv.join_released()
    assert log == [("terminate", "own"), ("stop", "own")]
    log.clear()
    registry.stop()
    assert log == [("terminate", "shared"), ("stop", "shared")] and len(registry) == 0


def test_start_all_only_waits_for_a_running_shared_server(monkeypatch):
    started, waited = [], []

    class Fake(SGLangServer):
        def __init__(self, name, running):
            super().__init__("/models/m", name=name)
            self._running = running

        @property
        def running(self):
            return self._running

        def start(self):
            started.append(self.name)
            return self

        def wait_ready(self, timeout=420.0):
            waited.append(self.name)
            return self

    servers = [Fake("shared", True), Fake("a", False), Fake("b", False)]
    shared_env = dict(servers[0].env)
    srv.start_all(servers)
    assert started == ["a", "b"] and waited == ["shared", "a", "b"]
    assert servers[0].env == shared_env  # a running server keeps the binding it started with
    assert "OMP_NUM_THREADS" in servers[1].env and "OMP_NUM_THREADS" in servers[2].env


@pytest.mark.parametrize("n", [2, 3])
def test_cores_are_shared_out_among_all_servers_of_a_module(n):
    class Fake(SGLangServer):
        running = False

    servers = [Fake("/models/m", name=f"s{i}") for i in range(n)]
    srv.pin_to_cores(servers)
    per = max(1, len(srv.os.sched_getaffinity(0)) // n)
    assert all(s.env["OMP_NUM_THREADS"] == str(per) for s in servers)


class _FlushAnswers:
    """A stand-in ``/flush_cache``: answers 400 (a request still pending) ``pending`` times, then 200."""

    def __init__(self, pending: int, code: int = 400):
        import http.server
        import threading

        answers = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                answers.calls += 1
                status = answers.code if answers.calls <= answers.pending else 200
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"pending" if status != 200 else b"flushed")

            def log_message(self, *args):
                pass

        self.pending, self.code, self.calls = pending, code, 0
        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def server(self) -> SGLangServer:
        s = _server("flushed")
        s.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        return s


def test_flush_cache_retries_while_a_request_is_pending_then_flushes():
    answers = _FlushAnswers(pending=2)
    try:
        answers.server().flush_cache(timeout_s=10)
        assert answers.calls == 3  # two 400s, then the flush
    finally:
        answers.httpd.shutdown()


def test_flush_cache_raises_naming_the_server_on_another_error_or_after_the_timeout():
    for answers, timeout in ((_FlushAnswers(pending=5, code=500), 10), (_FlushAnswers(pending=10**6), 0.5)):
        try:
            with pytest.raises(RuntimeError, match="flushed: /flush_cache failed"):
                answers.server().flush_cache(timeout_s=timeout)
        finally:
            answers.httpd.shutdown()
