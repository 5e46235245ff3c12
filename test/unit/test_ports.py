"""``sglang_memx.ports.free_port``: below the ephemeral range and upstream's own port range."""

import socket

from sglang_memx import ports


def test_the_port_is_below_upstreams_range_and_bindable():
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOW <= port <= ports.HIGH < 22000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", ports.LOW))
    try:
        monkeypatch.setattr(ports, "HIGH", ports.LOW + 1)
        assert all(ports.free_port() == ports.LOW + 1 for _ in range(10))
    finally:
        held.close()


def test_a_full_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "_bindable", lambda host, port: False)
    assert ports.free_port() >= ports._ephemeral_low()
