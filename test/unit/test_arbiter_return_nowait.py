"""``ArbiterClient.give_back(wait=False)``: a scheduler gives spare chunks back without waiting for
the arbiter's ACK; nothing leaks whether the ACK comes, is an ERROR, or never comes."""

from __future__ import annotations

import os
from functools import partial

from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient
from memory_ext.vmm import host_backend
from support.arbiter import socket_dir
from support.waiting import wait_until

G = 4 * os.sysconf("SC_PAGE_SIZE")
_wait = partial(wait_until, timeout=10.0, interval=0.01)


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fds_per_file(files: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """How many of this process's fds refer to each of ``files`` ((st_dev, st_ino) of memfds): other
    tests' threads or finalizers in this worker may open or close unrelated fds meanwhile."""
    counts = dict.fromkeys(files, 0)
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing
            continue
        if (st.st_dev, st.st_ino) in counts:
            counts[(st.st_dev, st.st_ino)] += 1
    return counts


def _by_name(status: dict, name: str) -> dict:
    [entry] = [c for c in status["clients"] if c["name"] == name]
    return entry


def test_returned_without_waiting_the_chunks_are_free_for_the_next_request_and_destroyed_on_ack():
    with socket_dir("arb-nowait-") as d, Arbiter(str(d / "a.sock"), host_backend(G), 6) as arb:
        client = ArbiterClient(str(d / "a.sock"), "engine", host_backend(G))
        try:
            client.give_back(client.borrow(6))  # every chunk created up front: exact fd counts
            chunks = client.borrow(4)
            files = {(st.st_dev, st.st_ino) for st in (os.fstat(c.handle) for c in chunks)}
            assert len(files) == 4
            assert client.give_back(chunks, wait=False) == 4
            assert client.held() == []  # off the books at once
            assert client.status()["free"] == 6  # the same connection: the RETURN went first
            _wait(lambda: client.returns_in_flight == 0, what="the ACK")
            # the imports closed when it came; the in-process arbiter may still be closing the
            # copies it received (its thread shares this process's fd table): in the end each chunk's
            # memfd is open once, the arbiter's own
            _wait(
                lambda: set(_fds_per_file(files).values()) == {1},
                what="each returned chunk's fd closed but the arbiter's",
            )
            assert len(client.borrow(6)) == 6  # and the arbiter lends them again
            arb.check_invariants()
        finally:
            client.close()


def test_a_refused_return_goes_back_on_the_books():
    with socket_dir("arb-nowait-") as d, Arbiter(str(d / "a.sock"), host_backend(G), 4) as arb:
        client = ArbiterClient(str(d / "a.sock"), "engine", host_backend(G))
        try:
            [chunk] = client.borrow(1)
            with client._lock:
                del client._held[chunk.source_id]
            client._returning[999] = [chunk]
            client._deliver({"type": "ERROR", "req_id": 999, "field": "chunks", "message": "not yours"}, [])
            assert client.held() == [chunk] and client.returns_in_flight == 0
            assert _by_name(client.status(), "engine")["held"] == 1  # the arbiter's books agree
            client.give_back([chunk])  # still ours: an ordinary return takes it
            assert client.held() == [] and _by_name(client.status(), "engine")["held"] == 0
            arb.check_invariants()
        finally:
            client.close()


def test_returns_in_flight_when_the_arbiter_dies_are_destroyed():
    backend = host_backend(G)
    with socket_dir("arb-nowait-") as d:
        arb = Arbiter(str(d / "a.sock"), host_backend(G), 4).start()
        client = ArbiterClient(str(d / "a.sock"), "engine", backend)
        chunks = client.borrow(3)
        fds_held = _nfds()
        client._returning[12345] = chunks  # as if their ACK had not come when the arbiter died
        with client._lock:
            for c in chunks:
                del client._held[c.source_id]
        arb.stop()
        _wait(lambda: client.lost_reason is not None, what="the connection's end")
        assert client.returns_in_flight == 0
        _wait(lambda: _nfds() <= fds_held - 3, what="the in-flight chunks' fds closed")
        client.close()
