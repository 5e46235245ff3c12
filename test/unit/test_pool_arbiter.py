"""memory_ext.pool.arbiter: one arbiter lends a device's chunks to several client processes."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory_ext.pool import arbiter_protocol as proto
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient, ArbiterDenied, ArbiterError
from memory_ext.vmm import connect_unix, host_backend
from support.arbiter import arbiter_process, socket_dir
from support.waiting import wait_until

PAGE = os.sysconf("SC_PAGE_SIZE")
G = 4 * PAGE
REPO = Path(__file__).resolve().parents[2]


def _nfds():
    return len(os.listdir("/proc/self/fd"))


_wait = partial(wait_until, timeout=10.0, interval=0.01)


@pytest.fixture
def sock_path():
    with socket_dir("arb-") as d:
        yield str(d / "arb.sock")


def _by_name(status, name):
    return [c for c in status["clients"] if c["name"] == name]


def test_socket_file_mode_is_0600_and_removed_on_stop(sock_path):
    with Arbiter(sock_path, host_backend(G), 2):
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    assert not os.path.exists(sock_path)


def test_reclaim_between_two_in_process_clients(sock_path):
    budget = 6
    with Arbiter(sock_path, host_backend(G), budget) as arb:
        vmm_a, vmm_b = host_backend(G), host_backend(G)
        r = vmm_a.reserve(budget * G)
        calls = []

        def give_up(n):  # A's policy: unmap its highest slots and hand those chunks back
            calls.append(n)
            mapped = vmm_a.mapped_slots(r)
            picked = []
            for off in sorted(mapped, reverse=True)[:n]:
                picked.append(vmm_a.unmap(r, off))
            return picked

        a = ArbiterClient(sock_path, "a", vmm_a, on_reclaim=give_up)
        b = ArbiterClient(sock_path, "b", vmm_b)
        assert (a.granularity, a.budget) == (G, budget)
        chunks_a = a.borrow(budget)
        assert len({c.source_id for c in chunks_a}) == budget
        for i, c in enumerate(chunks_a):
            vmm_a.map(r, i * G, c)
            vmm_a.tensor_view(r, i * G, G).fill_(i + 1)
        arb.check_invariants()

        chunks_b = b.borrow(2, owner="activation")  # nothing free: A is asked for 2
        assert calls == [2] and a.reclaim_requests == [2]
        assert {c.source_id for c in chunks_b} == {c.source_id for c in chunks_a[-2:]}
        rb = vmm_b.reserve(2 * G)
        for i, c in enumerate(chunks_b):
            vmm_b.map(rb, i * G, c)
            vmm_b.tensor_view(rb, i * G, G).fill_(0xEE)
        for i in range(budget - 2):  # A's kept chunks keep A's bytes
            assert bool((vmm_a.tensor_view(r, i * G, G) == i + 1).all())

        status = a.status()
        assert status["free"] == 0 and status["created"] == budget
        assert _by_name(status, "a")[0]["held"] == budget - 2
        assert _by_name(status, "b")[0]["by_owner"] == {"activation": 2}
        arb.check_invariants()

        for i in range(2):
            vmm_b.unmap(rb, i * G)
        with pytest.raises(ValueError, match="not borrowed"):
            a.give_back(chunks_b)  # B's chunks are not A's to return
        b.give_back(chunks_b)
        with pytest.raises(ValueError, match="still mapped"):
            a.give_back([a.held()[0]])
        for off in list(vmm_a.mapped_slots(r)):
            vmm_a.unmap(r, off)
        a.give_back(a.held())
        assert arb.status()["free"] == budget
        arb.check_invariants()
        a.close()
        b.close()
        vmm_a.close()
        vmm_b.close()


def test_deny_beyond_floors_and_after_reclaim_timeout(sock_path):
    with Arbiter(sock_path, host_backend(G), 4, floor_per_client=1, reclaim_timeout=0.3) as arb:
        va, vb = host_backend(G), host_backend(G)
        a = ArbiterClient(sock_path, "stingy", va)  # no on_reclaim: never gives anything back
        b = ArbiterClient(sock_path, "b", vb)
        held = a.borrow(4)
        with pytest.raises(ArbiterDenied) as e:  # A's floor protects 1 chunk: at most 3 possible
            b.borrow(4)
        assert e.value.available == 3
        t0 = time.monotonic()
        with pytest.raises(ArbiterDenied, match="reclaim"):
            b.borrow(1)
        assert time.monotonic() - t0 < 10
        assert a.reclaim_requests == [1]
        assert arb.status()["pending"] == 0
        arb.check_invariants()
        a.give_back(held)
        assert len(b.borrow(4)) == 4  # everything free again
        arb.check_invariants()
        a.close()
        b.close()


CHILD = textwrap.dedent("""
    import sys, time
    from memory_ext.vmm import host_backend
    from memory_ext.pool.arbiter_client import ArbiterClient
    path, g, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    vmm = host_backend(g)
    client = ArbiterClient(path, "child", vmm)
    chunks = client.borrow(n)
    r = vmm.reserve(g)
    vmm.map(r, 0, chunks[0])
    vmm.tensor_view(r, 0, g).fill_(0xC3)
    print("READY", chunks[0].source_id, flush=True)
    time.sleep(300)
""")


def test_child_killed_chunks_return_to_free_without_fd_leak(sock_path):
    budget, n_child = 5, 3
    fds_start = _nfds()
    backend = host_backend(G)
    arb = Arbiter(sock_path, backend, budget).start()
    parent_vmm = host_backend(G)
    parent = ArbiterClient(sock_path, "parent", parent_vmm)
    parent.give_back(parent.borrow(budget))  # create every chunk up front, for exact fd counts
    fds_base = _nfds()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, sock_path, str(G), str(n_child)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        line = child.stdout.readline()  # the child blocks until it has borrowed and written
        assert line.startswith("READY"), line
        written_id = int(line.split()[1])
        status = parent.status()
        [entry] = _by_name(status, "child")
        assert entry["held"] == n_child and entry["pid"] == child.pid and entry["peer_pid"] == child.pid
        assert status["free"] == budget - n_child
        arb.check_invariants()
        fds_with_child = _nfds()

        child.send_signal(signal.SIGKILL)
        child.wait(10)
        _wait(lambda: arb.status()["free"] == budget, what="the child's chunks to return to FREE")
        assert _by_name(arb.status(), "child") == []
        arb.check_invariants()
        assert _nfds() == fds_with_child - 1  # only the child's connection went away

        chunks = parent.borrow(budget)  # the whole budget again
        r = parent_vmm.reserve(budget * G)
        for i, c in enumerate(chunks):
            parent_vmm.map(r, i * G, c)
        [i] = [i for i, c in enumerate(chunks) if c.source_id == written_id]
        assert bool((parent_vmm.tensor_view(r, i * G, G) == 0xC3).all())  # the child really shared it
        for i in range(budget):
            parent_vmm.unmap(r, i * G)
        parent.give_back(chunks)
        parent_vmm.release(r)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
    assert _nfds() == fds_base
    parent.close()
    arb.stop()
    parent_vmm.close()
    backend.close()
    assert _nfds() == fds_start


def _raw(sock, obj):
    sock.send(obj if isinstance(obj, bytes) else json.dumps(obj).encode())
    reply = json.loads(sock.recv(1 << 16))
    return reply


HELLO = {"type": "HELLO", "req_id": 1, "version": proto.PROTOCOL_VERSION, "name": "raw", "pid": 1}

BEFORE_HELLO = [
    (b"not json", "message"),
    (b"[1, 2]", "message"),
    (b"\xff\xfe", "message"),
    ({"req_id": 3}, "type"),
    ({"type": "NOPE", "req_id": 3}, "type"),
    ({"type": 7, "req_id": 3}, "type"),
    ({k: v for k, v in HELLO.items() if k != "pid"}, "pid"),
    (dict(HELLO, extra=1), "extra"),
    (dict(HELLO, pid="12"), "pid"),
    (dict(HELLO, pid=0), "pid"),
    (dict(HELLO, version=99), "version"),
    (dict(HELLO, name=""), "name"),
    ({"type": "BORROW", "req_id": 3, "n": 1, "owner": "kv"}, "type"),  # HELLO first
]

AFTER_HELLO = [
    (HELLO, "type"),  # a second HELLO
    ({"type": "BORROW", "req_id": 4, "n": 0, "owner": "kv"}, "n"),
    ({"type": "BORROW", "req_id": 4, "n": -2, "owner": "kv"}, "n"),
    ({"type": "BORROW", "req_id": 4, "n": True, "owner": "kv"}, "n"),
    ({"type": "BORROW", "req_id": 4, "n": 1.5, "owner": "kv"}, "n"),
    ({"type": "BORROW", "req_id": 4, "n": 10**6, "owner": "kv"}, "n"),
    ({"type": "BORROW", "req_id": 4, "n": 1, "owner": "free"}, "owner"),
    ({"type": "BORROW", "req_id": 4, "n": 1}, "owner"),
    ({"type": "BORROW", "req_id": -1, "n": 1, "owner": "kv"}, "req_id"),
    ({"type": "RETURN", "req_id": 5, "chunks": [999]}, "chunks[0]"),
    ({"type": "RETURN", "req_id": 5, "chunks": []}, "chunks"),
    ({"type": "RETURN", "req_id": 5, "chunks": ["a"]}, "chunks[0]"),
    ({"type": "RETURN", "req_id": 5, "chunks": [1, 1]}, "chunks"),
    ({"type": "RETURN", "req_id": 5, "chunks": 1}, "chunks"),
    ({"type": "STATUS", "req_id": 6, "verbose": True}, "verbose"),
    (b"\x00\x00\x00\x02{}", "message"),  # a chunk packet is not a control message
]


def test_malformed_messages_get_errors_naming_the_field(sock_path):
    with Arbiter(sock_path, host_backend(G), 3) as arb:
        good_vmm = host_backend(G)
        good = ArbiterClient(sock_path, "good", good_vmm)
        fds0 = _nfds()
        raw = connect_unix(sock_path)
        for payload, field in BEFORE_HELLO:
            reply = _raw(raw, payload)
            assert reply["type"] == "ERROR" and reply["field"] == field, (payload, reply)
        assert _raw(raw, HELLO)["type"] == "WELCOME"
        for payload, field in AFTER_HELLO:
            reply = _raw(raw, payload)
            assert reply["type"] == "ERROR" and reply["field"] == field, (payload, reply)
            if isinstance(payload, dict) and payload.get("req_id", -1) >= 0:
                assert reply["req_id"] == payload["req_id"]
        # fds sent to the arbiter are closed, not kept
        r, w = os.pipe()
        socket.send_fds(raw, [json.dumps({"type": "STATUS", "req_id": 9}).encode()], [r, w])
        reply = json.loads(raw.recv(1 << 16))
        assert reply["type"] == "ERROR" and reply["field"] == "fds"
        os.close(r)
        os.close(w)
        # a chunk held by someone else cannot be returned by the raw client
        [chunk] = good.borrow(1)
        reply = _raw(raw, {"type": "RETURN", "req_id": 10, "chunks": [chunk.source_id]})
        assert reply["field"] == "chunks[0]"
        assert _by_name(arb.status(), "good")[0]["held"] == 1
        # the arbiter still serves everyone, and its ledger is intact
        assert _raw(raw, {"type": "STATUS", "req_id": 11})["type"] == "STATUS"
        assert len(good.borrow(2)) == 2
        with pytest.raises(ArbiterDenied):
            good.borrow(1)
        arb.check_invariants()
        raw.close()
        _wait(lambda: len(arb.status()["clients"]) == 1, what="the raw client to be dropped")
        assert _nfds() == fds0 + 6  # 3 memfds created by the arbiter + their 3 imports in `good`
        good.close()
        good_vmm.close()


def test_client_reports_arbiter_errors_and_disconnect(sock_path):
    arb = Arbiter(sock_path, host_backend(G), 2).start()
    vmm = host_backend(G)
    c = ArbiterClient(sock_path, "c", vmm)
    with pytest.raises(ValueError):
        c.borrow(0)
    [chunk] = c.borrow(1)
    arb.stop()
    _wait(lambda: not c.connected, what="the client to notice the arbiter is gone")
    with pytest.raises(ArbiterError, match="not connected"):
        c.status()
    c.close()
    assert vmm.live_chunks() == []
    with pytest.raises(ArbiterError, match="granularity"):
        with Arbiter(sock_path, host_backend(G), 1):
            ArbiterClient(sock_path, "wrong", host_backend(2 * G))


def test_arbiter_runs_as_its_own_process(sock_path):
    with arbiter_process(sock_path, "--budget-chunks", "3", "--granularity-mib", "2") as proc:
        vmm = host_backend(2 << 20)
        c = ArbiterClient(sock_path, "p", vmm)
        assert c.budget == 3 and len(c.borrow(3)) == 3
        c.close()
        vmm.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not os.path.exists(sock_path)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.text(max_size=5),
    lambda s: st.lists(s, max_size=3) | st.dictionaries(st.text(max_size=6), s, max_size=4),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {"type": st.sampled_from(sorted(proto.CLIENT_SCHEMAS) + ["X"])},
        optional={
            "req_id": _json,
            "n": _json,
            "owner": _json,
            "chunks": _json,
            "name": _json,
            "pid": _json,
            "version": _json,
            "junk": _json,
        },
    )
)
def test_protocol_decoder_accepts_or_names_a_field(msg):
    try:
        out = proto.decode_client(json.dumps(msg).encode())
    except proto.ProtocolError as exc:
        assert exc.field and isinstance(exc.field, str)
        return
    assert set(out) == {"type"} | set(proto.CLIENT_SCHEMAS[out["type"]])


RECLAIMING_CHILD = textwrap.dedent("""
    import sys, time
    from memory_ext.vmm import host_backend
    from memory_ext.pool.arbiter_client import ArbiterClient
    path, g, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    vmm = host_backend(g)
    r = vmm.reserve(g)

    def give_back_unmapped(k):  # this server's policy: spare what it has not mapped
        spare = [c for c in client.held() if not vmm.mappings_of(c)][:k]
        print("RECLAIM", k, len(spare), flush=True)
        return spare

    client = ArbiterClient(path, "busy-then-idle", vmm, on_reclaim=give_back_unmapped)
    chunks = client.borrow(n)
    vmm.map(r, 0, chunks[0])
    vmm.tensor_view(r, 0, g).fill_(0x5A)
    print("READY", chunks[0].source_id, flush=True)
    time.sleep(300)
""")


def test_reclaim_across_processes_then_peer_killed(sock_path):
    """Two processes share one pool: the child borrows the whole budget, the parent's
    borrow makes the arbiter reclaim from the child, then the child dies and leaks nothing."""
    budget = 4
    with Arbiter(sock_path, host_backend(G), budget) as arb:
        parent_vmm = host_backend(G)
        parent = ArbiterClient(sock_path, "parent", parent_vmm)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        child = subprocess.Popen(
            [sys.executable, "-c", RECLAIMING_CHILD, sock_path, str(G), str(budget)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            line = child.stdout.readline()
            assert line.startswith("READY"), line
            mapped_id = int(line.split()[1])
            assert arb.status()["free"] == 0

            got = parent.borrow(2)  # nothing free: the arbiter asks the child for 2
            assert child.stdout.readline().split() == ["RECLAIM", "2", "2"]
            assert mapped_id not in {c.source_id for c in got}  # the child kept what it maps
            [entry] = _by_name(arb.status(), "busy-then-idle")
            assert entry["held"] == budget - 2
            arb.check_invariants()

            child.send_signal(signal.SIGKILL)
            child.wait(10)
            _wait(lambda: arb.status()["free"] == budget - 2, what="the dead child's chunks")
            arb.check_invariants()
            more = parent.borrow(2)
            assert len({c.source_id for c in got + more}) == budget  # never granted twice
            parent.give_back(got + more)
            assert arb.status()["free"] == budget
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            parent.close()
            parent_vmm.close()


def test_reclaim_follows_the_reports_idle_clients_first_busy_ones_keep_their_headroom(sock_path):
    """The arbiter asks whom the node policy names (plan_takes), never for memory in use. Budget 16,
    3 clients: fair share 5. "busy" holds 1 beyond its share and keeps its headroom (the asker is
    not below its share); "idle" has work none and gives its idle cache."""
    with Arbiter(sock_path, host_backend(G), 16) as arb:
        idle = ArbiterClient(sock_path, "idle", host_backend(G))
        busy = ArbiterClient(sock_path, "busy", host_backend(G))
        asker = ArbiterClient(sock_path, "asker", host_backend(G))
        try:
            idle.borrow(5)
            busy.borrow(6)
            asker.borrow(5)
            idle.report(3, 0, False)  # 3 of its 5 chunks are cache it could drop
            busy.report(4, 2, True)  # 4 idle, 2 of them wanted by its own queue
            _wait(lambda: all(c["idle"] is not None for c in arb.status()["clients"] if c["name"] != "asker"),
                  what="reports")  # fmt: skip
            # RETURN: busy's 1 beyond its share; IDLE_PEER: idle's 3; SURPLUS: busy's 4 - 1 - 2 = 1
            with pytest.raises(ArbiterDenied) as denied:
                asker.borrow(6, timeout=1.0)
            assert denied.value.available == 5
            assert idle.reclaim_requests == [] and busy.reclaim_requests == []  # nothing asked for a refusal
            with pytest.raises(ArbiterError):  # nobody answers here: the borrow times out waiting
                asker.borrow(4, timeout=0.3)
            _wait(lambda: idle.reclaim_requests and busy.reclaim_requests, what="reclaims")
            assert (idle.reclaim_requests, busy.reclaim_requests) == ([3], [1])
            assert arb.status()["reclaim_by_tier"] == {"return": 1, "idle_peer": 3}
        finally:
            for c in (idle, busy, asker):
                c.close(force=True)


def test_a_malformed_report_gets_an_error_naming_the_field(sock_path):
    with Arbiter(sock_path, host_backend(G), 4):
        s = connect_unix(sock_path)
        try:
            assert _raw(s, HELLO)["type"] == "WELCOME"
            bad = [
                ({"type": "REPORT", "req_id": 2, "idle": -1, "headroom": 0, "busy": True}, "idle"),
                ({"type": "REPORT", "req_id": 3, "idle": 1, "headroom": 0, "busy": 1}, "busy"),
                ({"type": "REPORT", "req_id": 4, "idle": 1, "busy": False}, "headroom"),
            ]
            for payload, field in bad:
                reply = _raw(s, payload)
                assert reply["type"] == "ERROR" and reply["field"] == field, reply
        finally:
            s.close()


def _readable(fd: int, timeout_s: float) -> bool:
    """poll, not select: this process's fds may be numbered past select's 1024."""
    import select

    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(timeout_s * 1000))


def test_lent_pool_wakes_a_sleeping_engine_on_reclaim(sock_path):
    from memory_ext.pool.lent_pool import LentPool

    with Arbiter(sock_path, host_backend(G), 4):
        lent = LentPool(sock_path, "sleeper", host_backend(G))
        asker = ArbiterClient(sock_path, "asker", host_backend(G))
        try:
            assert lent.borrow(4) == 4
            assert not _readable(lent.wake_fd, 0)  # nothing to do yet
            with pytest.raises(ArbiterError):
                asker.borrow(2, timeout=0.2)
            assert _readable(lent.wake_fd, 5.0)  # woken by the RECLAIM
            assert lent.drain_wakeups() >= 1 and lent.take_pending_reclaim() == 2
            assert not _readable(lent.wake_fd, 0)
        finally:
            asker.close(force=True)
            lent.close()
