"""Property-based fuzzing of a live arbiter over its socket (hypothesis, stateful).

Every step sends one packet on one of several raw connections (or opens / closes one) to a
real in-process ``Arbiter``: well-formed messages of every client type (HELLO, BORROW, RETURN,
STATUS, REPORT, LINK, ADOPT, RELEASE), the same with a field dropped, added or replaced by junk, raw bytes
(invalid UTF-8 / JSON, deep nesting, huge ints, empty and oversized packets), messages with
fds attached, messages out of order (before HELLO, a second HELLO, RETURN of chunks not
held), and connections closed mid-exchange (a BORROW sent and the socket closed before the
GRANT is read). A model predicts each answer: ERROR naming the field the local decoder names
(or ``fds`` / ``message`` / ``type`` / ``chunks[i]`` / ``iter_times`` / ``min_interval``),
WELCOME, GRANT iff the budget not held covers the borrow (else DENY), ACK, STATUS, LINKED,
ADOPTED (as many as the budget not held covers), ERROR ``n`` for a RELEASE beyond what was
adopted. After every step: ``check_invariants()``, and chunk conservation against the model
(each client holds exactly what it was granted or adopted and did not return or release;
held + free = created <= budget, i.e. held + free + uncreated = budget). At the end the
arbiter still serves a well-behaved client the whole budget (adopted chunks left the books
with their clients) and no fd leaked.

Runtime: ``MEMX_FUZZ_EXAMPLES`` runs (default 100, about 5 s here) of up to
``MEMX_FUZZ_STEPS`` steps (default 50). Long mode: ``MEMX_FUZZ_EXAMPLES=2000``. A failure
prints the falsifying step sequence and a ``@reproduce_failure`` blob; ``pytest
--hypothesis-seed=N`` replays a run's random choices (docs/reliability.md, "Bad input").
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memory_ext.pool import arbiter_protocol as proto
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient
from memory_ext.vmm import host_backend
from memory_ext.vmm.ipc import MAX_FDS, connect_unix

EXAMPLES = int(os.environ.get("MEMX_FUZZ_EXAMPLES", "100"))
STEPS = int(os.environ.get("MEMX_FUZZ_STEPS", "50"))
PAGE = os.sysconf("SC_PAGE_SIZE")
G = PAGE
BUDGET = 6
MAX_CONNS = 4
REPLY_TIMEOUT = 5.0

_leaf = st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True) | st.text(max_size=4)
JUNK = st.recursive(_leaf, lambda s: st.lists(s, max_size=3) | st.dictionaries(st.text(max_size=4), s, max_size=3),
                    max_leaves=6)  # fmt: skip
REQ_ID = st.integers(0, 2**63) | st.sampled_from([0, 1, 10**40])
OWNERS = st.sampled_from(proto.OWNERS)
KNOWN = {"", "message", "type", "fds"} | {f for schema in proto.CLIENT_SCHEMAS.values() for f in schema}


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _link_fields(draw) -> dict:
    n = draw(st.integers(1, 6) | st.sampled_from([proto.MAX_LINK_LAYERS]))
    entries = n + 1 if draw(st.booleans()) else draw(st.integers(2, n + 3))
    number = st.floats(1e-6, 1e3) | st.sampled_from([1e-300, 1e300, 5e-324])
    return {
        "active": draw(st.booleans()),
        "num_layers": n,
        "layer_bytes": draw(st.integers(1, 1 << 40) | st.sampled_from([10**30, 10**300])),
        "link_bytes_per_s": draw(number),
        "min_interval": draw(st.none() | st.integers(1, n + 3)),
        "iter_times": [draw(number) for _ in range(min(entries, 40))] if entries <= 40 else [1.0] * entries,
    }


@st.composite
def client_message(draw, held: list[int], others: list[int]) -> dict:
    """A well-formed (by the schema) client message; its values may still be wrong in context."""
    kind = draw(st.sampled_from(sorted(proto.CLIENT_SCHEMAS)))
    msg: dict = {"type": kind, "req_id": draw(REQ_ID)}
    if kind == "HELLO":
        msg.update(version=proto.PROTOCOL_VERSION, name=draw(st.text(min_size=1, max_size=proto.MAX_NAME_LEN)),
                   pid=draw(st.integers(1, 1 << 22)))  # fmt: skip
    elif kind == "BORROW":
        msg.update(n=draw(st.integers(1, BUDGET + 2) | st.just(proto.MAX_CHUNKS_PER_MESSAGE)), owner=draw(OWNERS))
    elif kind == "RETURN":
        pool = st.sampled_from(held + others) if held + others else st.integers(0, 50)
        ids = draw(st.lists(pool | st.integers(0, 2**40), min_size=1, max_size=6, unique=True))
        msg["chunks"] = ids
    elif kind == "REPORT":
        msg.update(
            idle=draw(st.integers(0, BUDGET + 2)), headroom=draw(st.integers(0, BUDGET)), busy=draw(st.booleans())
        )
    elif kind == "LINK":
        msg.update(_link_fields(draw))
    elif kind in ("ADOPT", "RELEASE"):
        msg["n"] = draw(st.integers(1, BUDGET + 2) | st.just(proto.MAX_ADOPT))
    return msg


@st.composite
def mutated(draw, msg: dict) -> dict:
    """``msg`` with one field dropped, one added, or one value replaced by junk."""
    msg = dict(msg)
    how = draw(st.sampled_from(["drop", "add", "replace", "type"]))
    names = sorted(msg)
    if how == "drop":
        del msg[draw(st.sampled_from(names))]
    elif how == "add":
        msg[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
    elif how == "replace":
        msg[draw(st.sampled_from(names))] = draw(JUNK)
    else:
        msg["type"] = draw(st.sampled_from([k.lower() for k in proto.CLIENT_SCHEMAS] + ["WELCOME", "GRANT", ""]))
    return msg


RAW = st.one_of(
    st.binary(max_size=40),
    st.just(b""),
    st.just(b"\xff\xfe{"),
    st.sampled_from([b"[" * 30000, b"{" * 20000, b'{"a":' * 5000]),  # deeper than json can parse
    st.just(b'{"type":"STATUS","req_id":' + b"7" * 5000 + b"}"),  # an int Python will not convert
    st.sampled_from([b"null", b"[]", b"42", b'"HELLO"', b"NaN", b'{"type":"BORROW","n":NaN}']),
    st.integers(proto.MAX_MESSAGE_BYTES + 1, 2 * proto.MAX_MESSAGE_BYTES).map(lambda n: b"{" + b" " * (n - 1)),
    st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


class _Conn:
    def __init__(self, path: str):
        self.sock = connect_unix(path)
        self.sock.settimeout(REPLY_TIMEOUT)
        self.client_id: int | None = None  # from WELCOME
        self.held: set[int] = set()
        self.adopted = 0  # chunks booked by ADOPT (no ids)


class ArbiterMachine(RuleBasedStateMachine):
    """Raw connections to one live arbiter, and the model of what it must answer."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="fuzz-", dir="/tmp")  # AF_UNIX paths are limited to 107 bytes
        self.path = os.path.join(self.dir, "arb.sock")
        self.fds0 = _nfds()
        self.backend = host_backend(G)
        self.arb = Arbiter(self.path, self.backend, BUDGET, reclaim_timeout=0.05, send_timeout=2.0).start()
        self.conns: list[_Conn] = []

    # ------------------------------------------------------------------ helpers
    def _reply(self, conn: _Conn) -> dict:
        """The next answer on ``conn`` that is not an unsolicited RECLAIM (GRANT fds are closed)."""
        while True:
            data, fds, _, _ = socket.recv_fds(conn.sock, 4 * proto.MAX_MESSAGE_BYTES, MAX_FDS)
            for fd in fds:
                os.close(fd)
            assert data, "the arbiter closed a connection it had no reason to close"
            if data[:1] == b"{":
                msg = proto.decode_server(data)
                assert not fds
            else:  # a chunk packet: 4-byte length, header, fds; the GRANT is its meta
                msg = proto.decode_server(json.dumps(json.loads(data[4:])["meta"]).encode())
                assert msg["type"] == "GRANT" and len(fds) == len(msg["chunks"])
            if msg["type"] != "RECLAIM":
                field = msg.get("field", "")
                known = re.sub(r"\[\d+\]$", "", field) in KNOWN
                event(f"answer {msg['type']} {field if known else '<extra field>'}")
                return msg

    def _expect_error(self, conn: _Conn, field: str, req_id: int | None, what) -> None:
        reply = self._reply(conn)
        assert reply["type"] == "ERROR", (what, reply)
        assert reply["field"] == field, (what, reply)
        assert reply["req_id"] == req_id, (what, reply)

    def _held_total(self) -> int:
        return sum(len(c.held) + c.adopted for c in self.conns)

    def _send_and_check(self, conn: _Conn, payload: bytes, with_fds: bool = False) -> None:
        """Send one packet and check the arbiter's answer against the model."""
        if with_fds:
            r, w = os.pipe()
            try:
                socket.send_fds(conn.sock, [payload], [r, w])
            finally:
                os.close(r), os.close(w)
            return self._expect_error(conn, "fds", None, payload[:80])
        conn.sock.send(payload)
        if len(payload) > proto.MAX_MESSAGE_BYTES:
            return self._expect_error(conn, "message", None, len(payload))
        if not payload:
            return self._expect_error(conn, "message", None, "empty packet")
        try:
            msg = proto.decode_client(payload)
        except proto.ProtocolError as exc:
            return self._expect_error(conn, exc.field, exc.req_id, payload[:80])
        kind, req_id = msg["type"], msg["req_id"]
        if kind == "HELLO" or conn.client_id is None:
            if kind != "HELLO" or conn.client_id is not None:
                return self._expect_error(conn, "type", req_id, msg)
            reply = self._reply(conn)
            assert reply["type"] == "WELCOME" and reply["req_id"] == req_id, reply
            assert (reply["budget"], reply["granularity"]) == (BUDGET, G)
            conn.client_id = reply["client_id"]
            return
        if kind == "BORROW":
            reply = self._reply(conn)
            assert reply["req_id"] == req_id, reply
            if msg["n"] <= BUDGET - self._held_total():
                assert reply["type"] == "GRANT" and len(reply["chunks"]) == msg["n"], (msg, reply)
                assert reply["owner"] == msg["owner"]
                assert not set(reply["chunks"]) & {i for c in self.conns for i in c.held}, "a chunk granted twice"
                conn.held |= set(reply["chunks"])
            else:
                assert reply["type"] == "DENY", (msg, reply, self._held_total())
        elif kind == "RETURN":
            bad = [i for i, cid in enumerate(msg["chunks"]) if cid not in conn.held]
            if bad:
                return self._expect_error(conn, f"chunks[{bad[0]}]", req_id, msg)
            reply = self._reply(conn)
            assert reply == {"type": "ACK", "req_id": req_id, "returned": len(msg["chunks"])}, reply
            conn.held -= set(msg["chunks"])
        elif kind == "ADOPT":
            reply = self._reply(conn)
            want = min(msg["n"], BUDGET - self._held_total())
            assert reply == {"type": "ADOPTED", "req_id": req_id, "adopted": want}, (msg, reply)
            conn.adopted += want
        elif kind == "RELEASE":
            if msg["n"] > conn.adopted:
                return self._expect_error(conn, "n", req_id, msg)
            reply = self._reply(conn)
            assert reply == {"type": "ACK", "req_id": req_id, "returned": msg["n"]}, reply
            conn.adopted -= msg["n"]
        elif kind == "STATUS":
            reply = self._reply(conn)
            assert reply["type"] == "STATUS" and reply["req_id"] == req_id, reply
        elif kind == "REPORT":  # no answer: the next one on this connection is the probe's
            conn.sock.send(proto.encode({"type": "STATUS", "req_id": 424242}))
            reply = self._reply(conn)
            assert (reply["type"], reply["req_id"]) == ("STATUS", 424242), reply
        elif kind == "LINK":
            n = msg["num_layers"]
            if len(msg["iter_times"]) != n + 1:
                return self._expect_error(conn, "iter_times", req_id, msg)
            if msg["min_interval"] is not None and msg["min_interval"] > n + 1:
                return self._expect_error(conn, "min_interval", req_id, msg)
            reply = self._reply(conn)
            assert reply["type"] == "LINKED" and reply["req_id"] == req_id, (msg, reply)

    def _wait_dropped(self, client_ids: set[int]) -> None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        while {c["client_id"] for c in self.arb.status()["clients"]} & client_ids:
            assert time.monotonic() < deadline, "the arbiter did not drop a closed connection"
            time.sleep(0.005)

    def _pick(self, data) -> _Conn:
        return data.draw(st.sampled_from(self.conns), label="conn")

    # -------------------------------------------------------------------- rules
    @initialize()
    def first_connection(self):
        self.conns.append(_Conn(self.path))

    @precondition(lambda self: len(self.conns) < MAX_CONNS)
    @rule()
    def connect(self):
        self.conns.append(_Conn(self.path))

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def hello(self, data):
        conn = self._pick(data)
        self._send_and_check(conn, proto.encode({"type": "HELLO", "req_id": data.draw(REQ_ID), "pid": os.getpid(),
                                                 "version": proto.PROTOCOL_VERSION, "name": "fuzz"}))  # fmt: skip

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def well_formed(self, data):
        conn = self._pick(data)
        others = sorted({i for c in self.conns if c is not conn for i in c.held})
        self._send_and_check(conn, proto.encode(data.draw(client_message(sorted(conn.held), others))))

    @precondition(lambda self: any(c.client_id is not None for c in self.conns))
    @rule(data=st.data())
    def borrow(self, data):
        conn = data.draw(st.sampled_from([c for c in self.conns if c.client_id is not None]), label="conn")
        msg = {"type": "BORROW", "req_id": data.draw(REQ_ID), "n": data.draw(st.integers(1, BUDGET)), "owner": "kv"}
        self._send_and_check(conn, proto.encode(msg))

    @precondition(lambda self: any(c.client_id is not None for c in self.conns))
    @rule(data=st.data())
    def adopt_or_release(self, data):
        """A survivor of a dead arbiter books what it kept (ADOPT), or drops some of it (RELEASE)."""
        conn = data.draw(st.sampled_from([c for c in self.conns if c.client_id is not None]), label="conn")
        kind = "RELEASE" if conn.adopted and data.draw(st.booleans()) else "ADOPT"
        n = data.draw(st.integers(1, max(1, conn.adopted) if kind == "RELEASE" else BUDGET))
        self._send_and_check(conn, proto.encode({"type": kind, "req_id": data.draw(REQ_ID), "n": n}))

    @precondition(lambda self: any(c.held for c in self.conns))
    @rule(data=st.data())
    def return_held(self, data):
        conn = data.draw(st.sampled_from([c for c in self.conns if c.held]), label="conn")
        ids = data.draw(st.lists(st.sampled_from(sorted(conn.held)), min_size=1, unique=True))
        self._send_and_check(conn, proto.encode({"type": "RETURN", "req_id": data.draw(REQ_ID), "chunks": ids}))

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def malformed(self, data):
        conn = self._pick(data)
        msg = data.draw(mutated(data.draw(client_message(sorted(conn.held), []))))
        self._send_and_check(conn, json.dumps(msg).encode())

    @precondition(lambda self: self.conns)
    @rule(data=st.data(), raw=RAW)
    def raw_bytes(self, data, raw):
        self._send_and_check(self._pick(data), raw)

    @precondition(lambda self: self.conns)
    @rule(data=st.data())
    def with_fds(self, data):
        conn = self._pick(data)
        self._send_and_check(conn, proto.encode(data.draw(client_message(sorted(conn.held), []))), with_fds=True)

    @precondition(lambda self: self.conns)
    @rule(data=st.data(), how=st.sampled_from(["close", "shutdown", "borrow_then_close", "return_then_close"]))
    def dead_peer(self, data, how):
        """The peer goes away, possibly with a request in flight; its chunks go back to FREE."""
        conn = self._pick(data)
        self.conns.remove(conn)
        if how == "borrow_then_close":
            conn.sock.send(proto.encode({"type": "BORROW", "req_id": 1, "n": data.draw(st.integers(1, BUDGET)),
                                         "owner": "kv"}))  # fmt: skip
        elif how == "return_then_close" and conn.held:
            conn.sock.send(proto.encode({"type": "RETURN", "req_id": 2, "chunks": sorted(conn.held)}))
        if how == "shutdown":
            conn.sock.shutdown(socket.SHUT_WR)  # EOF for the arbiter, our end still open
        else:
            conn.sock.close()
        if conn.client_id is not None:
            self._wait_dropped({conn.client_id})
        else:  # an anonymous connection: wait until no client beyond the live ones is listed
            deadline = time.monotonic() + REPLY_TIMEOUT
            while len(self.arb.status()["clients"]) > len(self.conns):
                assert time.monotonic() < deadline, "the arbiter did not drop a closed connection"
                time.sleep(0.005)
        if how == "shutdown":
            conn.sock.close()

    @precondition(lambda self: not self.conns)
    @rule()
    def reconnect(self):
        self.conns.append(_Conn(self.path))

    # ---------------------------------------------------------------- invariants
    @invariant()
    def ledger_holds(self):
        self.arb.check_invariants()
        status = self.arb.status()
        by_id = {c["client_id"]: c for c in status["clients"]}
        for conn in self.conns:
            if conn.client_id is not None:
                mine = by_id[conn.client_id]
                assert mine["held"] == len(conn.held) + conn.adopted, (conn.client_id, by_id, conn.held)
                assert mine["adopted"] == conn.adopted, (conn.client_id, by_id)
        assert sum(c["held"] for c in status["clients"]) == self._held_total()
        assert status["adopted"] == sum(c.adopted for c in self.conns)
        assert status["free"] + self._held_total() == status["created"] <= BUDGET
        assert status["pending"] == 0

    def teardown(self):
        try:
            for conn in self.conns:
                conn.sock.close()
            if self.arb._started:
                deadline = time.monotonic() + REPLY_TIMEOUT
                while self.arb.status()["clients"]:
                    assert time.monotonic() < deadline, "closed connections not dropped"
                    time.sleep(0.005)
                self.arb.check_invariants()
                vmm = host_backend(G)  # the arbiter still serves, and every chunk is back
                good = ArbiterClient(self.path, "after-fuzz", vmm, timeout=REPLY_TIMEOUT)
                chunks = good.borrow(BUDGET)
                assert len(chunks) == BUDGET
                good.give_back(chunks)
                good.close()
                vmm.close()
        finally:
            self.arb.stop()
            self.backend.close()
            for p in Path(self.dir).iterdir():
                p.unlink()
            os.rmdir(self.dir)
        assert _nfds() == self.fds0, "file descriptors leaked"


ArbiterMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
test_arbiter_survives_random_message_sequences = ArbiterMachine.TestCase


def _hello(path: str, name: str) -> socket.socket:
    s = connect_unix(path)
    s.settimeout(REPLY_TIMEOUT)
    s.send(proto.encode({"type": "HELLO", "req_id": 1, "version": proto.PROTOCOL_VERSION, "name": name, "pid": 1}))
    return s


def test_more_connections_than_max_clients_are_refused_naming_clients():
    """A flood of connections: beyond ``max_clients`` each gets ERROR(clients) and is closed; a
    slot freed is usable again, and the ledger never moves."""
    d = tempfile.mkdtemp(prefix="cap-", dir="/tmp")
    path = os.path.join(d, "arb.sock")
    with Arbiter(path, host_backend(G), 2, max_clients=3) as arb:
        kept = [_hello(path, f"c{i}") for i in range(3)]
        assert all(proto.decode_server(s.recv(1 << 16))["type"] == "WELCOME" for s in kept)
        for _ in range(5):
            s = connect_unix(path)
            s.settimeout(REPLY_TIMEOUT)
            reply = proto.decode_server(s.recv(1 << 16))
            assert (reply["type"], reply["field"]) == ("ERROR", "clients") and "at most 3" in reply["message"]
            assert s.recv(16) == b""
            s.close()
        kept.pop().close()
        deadline = time.monotonic() + REPLY_TIMEOUT
        while len(arb.status()["clients"]) > 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        again = _hello(path, "again")
        assert proto.decode_server(again.recv(1 << 16))["type"] == "WELCOME"
        assert arb.stats["refused"] == 5
        arb.check_invariants()
        for s in kept + [again]:
            s.close()
    os.rmdir(d)


def test_a_status_too_big_for_one_packet_is_an_error_not_a_dropped_client():
    """64 clients with 128-character names that JSON escapes to 12 bytes each: the STATUS reply
    would exceed one packet, so the asker gets ERROR(message) and stays connected."""
    d = tempfile.mkdtemp(prefix="big-", dir="/tmp")
    path = os.path.join(d, "arb.sock")
    with Arbiter(path, host_backend(G), 2) as arb:
        conns = [_hello(path, "\U0001f600" * proto.MAX_NAME_LEN) for _ in range(arb.max_clients)]
        assert all(proto.decode_server(s.recv(1 << 16))["type"] == "WELCOME" for s in conns)
        asker = conns[0]
        asker.send(proto.encode({"type": "STATUS", "req_id": 7}))
        reply = proto.decode_server(asker.recv(1 << 17))
        assert (reply["type"], reply["field"], reply["req_id"]) == ("ERROR", "message", 7), reply
        asker.send(proto.encode({"type": "BORROW", "req_id": 8, "n": 1, "owner": "kv"}))  # still served
        data, fds, _, _ = socket.recv_fds(asker, 1 << 16, MAX_FDS)
        assert len(fds) == 1 and data[:1] != b"{"
        os.close(fds[0])
        assert len(arb.status()["clients"]) == arb.max_clients
        arb.check_invariants()
        for s in conns:
            s.close()
    os.rmdir(d)
