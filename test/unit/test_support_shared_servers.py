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
