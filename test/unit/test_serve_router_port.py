"""``sglang-memx serve`` claims the router's address before any engine starts and answers 503 there."""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import socket

import pytest

from sglang_memx.serve import main as serve_main
from sglang_memx.serve.starting_responder import RETRY_AFTER_S, StartingResponder, claim_address
from support.fake_checkpoint import fake_model
from support.waiting import wait_until


def _args(tmp_path, port: int) -> argparse.Namespace:
    cfg = tmp_path / "models.yaml"
    cfg.write_text(json.dumps({
        "models": [{"name": "a", "path": str(fake_model(tmp_path, "a"))}],
        "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": 1}],
        "router": {"port": port},
    }))  # fmt: skip
    p = argparse.ArgumentParser()
    serve_main.add_arguments(p)
    return p.parse_args(["--config", str(cfg), "--log-dir", str(tmp_path / "logs")])


def test_a_taken_router_port_fails_before_any_engine_starts(tmp_path, monkeypatch, capsys):
    def no_launcher(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(serve_main, "StartingResponder", no_launcher)
    monkeypatch.setattr("sglang_memx.serve.launcher.Launcher", no_launcher)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        assert serve_main.run(_args(tmp_path, other.getsockname()[1])) == 2
    err = capsys.readouterr().err
    assert "sglang-memx serve: error: router.port: cannot listen on 127.0.0.1:" in err and "in use" in err


def _get(port: int, method: str = "GET", path: str = "/health", body: bytes | None = None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = c.getresponse()
        return r.status, r.getheader("Retry-After"), json.loads(r.read())
    finally:
        c.close()


def test_the_claimed_port_is_held_and_answers_503_starting_until_stopped():
    sock = claim_address("127.0.0.1", 0)
    port = sock.getsockname()[1]
    assert port > 0 and not sock.get_inheritable()  # port 0: the system's choice; engines do not inherit it
    responder = StartingResponder(sock, poll_s=0.05).start()
    try:
        for reuse in (0, 1):  # neither a plain bind (an engine's free port) nor sglang's SO_REUSEADDR probe gets it
            with socket.socket() as rival, pytest.raises(OSError) as taken:
                rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                rival.bind(("127.0.0.1", port))
            assert taken.value.errno == errno.EADDRINUSE
        assert _get(port) == (503, str(RETRY_AFTER_S), {"status": "starting"})
        status, retry, doc = _get(port, "POST", "/v1/chat/completions", body=b'{"model": "a"}' * 2000)
        assert status == 503 and retry == str(RETRY_AFTER_S)
        assert doc["error"]["code"] == "starting" and doc["error"]["type"] == "service_unavailable"
        # counted after the answer is sent: the client may read it first
        wait_until(lambda: responder.answered == 2, timeout=5.0, what="both answers counted", interval=0.01)
        assert responder.answered == 2
    finally:
        responder.stop()
    # after stop the socket is the router's: a connection waits for it, the responder answers no more
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):
            c.recv(1)
        conn, _ = sock.accept()  # the next owner takes the queued connection
        conn.close()
    assert responder.answered == 2
    sock.close()
    claim_address("127.0.0.1", port).close()  # released on close; a restart claims it despite TIME_WAIT


def test_a_silent_client_holds_the_responder_no_longer_than_its_budget(monkeypatch):
    monkeypatch.setattr("sglang_memx.serve.starting_responder.CONN_BUDGET_S", 0.2)
    sock = claim_address("127.0.0.1", 0)
    port = sock.getsockname()[1]
    responder = StartingResponder(sock, poll_s=0.05).start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # connects, never sends a byte
            assert _get(port) == (503, str(RETRY_AFTER_S), {"status": "starting"})  # answered behind it
        # the responder counts after its send returns: the client may read the answer first
        wait_until(lambda: responder.answered == 1, timeout=5.0, what="the answer counted", interval=0.01)
        assert responder.answered == 1
    finally:
        responder.stop()
        sock.close()


def test_the_responder_answers_on_a_descriptor_above_1023():
    """A router with many connections (or a process with many chunk fds) holds its port on a high
    descriptor; ``select()`` refuses any above 1023, which once killed the responder's thread."""
    import fcntl
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1100:
        pytest.skip("the open-file limit here is too low to place a descriptor above 1023")
    low = claim_address("127.0.0.1", 0)
    sock = socket.socket(fileno=fcntl.fcntl(low.fileno(), fcntl.F_DUPFD_CLOEXEC, 1100))
    low.close()
    assert sock.fileno() >= 1100
    responder = StartingResponder(sock, poll_s=0.05).start()
    try:
        assert _get(sock.getsockname()[1]) == (503, str(RETRY_AFTER_S), {"status": "starting"})
    finally:
        responder.stop()
        sock.close()
