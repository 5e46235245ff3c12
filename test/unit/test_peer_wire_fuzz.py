"""A live peer donor under random borrower traffic: it answers with valid messages or drops only
that connection, keeps serving a well-behaved borrower, and leaks neither chunks nor fds.

One ``PeerDonor`` (8 chunks) runs for the module with one good ``PeerLink`` holding one unit.
Each hypothesis example opens an evil connection and sends 1-6 packets: a valid HELLO (then
the donor grows its lease by one unit, so WRITE_BEGIN can fence real blocks), HELLO with a
field dropped / added / retyped or a layout the donor cannot hold, WRITE_BEGIN / WRITE_END of
random blocks, messages only a donor sends (WELCOME, GROW, REVOKE, ...), raw bytes (binary,
invalid UTF-8, non-object JSON, NaN, an empty packet, nesting 100 000 deep, a 5 000-digit
int, 64 KiB + 1 bytes), any of them with fds attached; in any order, and the donor may
reclaim the evil lease's unit in between (under a fence or not). Then the evil end leaves:
half-closed (it reads every answer to EOF) or closed at once (a dead peer).

Checked each example: every packet the donor sent parses under ``wire.recv``'s strict schema
(REFUSE / ERROR name a field); no donor thread raised (a ``threading.excepthook`` spy); once
the evil end is gone its lease is dropped, the pool lends exactly the good lease's unit
(``check_invariants``), the test process has the fds it had before (plus one memfd per chunk
the pool created meanwhile: a FREE chunk keeps its memory), and the good borrower
writes and reads a block.

``MEMX_FUZZ_EXAMPLES`` (default 25) x 2 connections; see docs/reliability.md "Bad input".
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memory_ext.peer import PeerDonor, PeerKVLayout, PeerLink, wire
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import connect_unix, host_backend, private_dir

EXAMPLES = int(os.environ.get("MEMX_FUZZ_EXAMPLES", "25")) * 2
G = 1 << 16
LAYOUT = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32)
BLOCKS_PER_UNIT = G // LAYOUT.block_bytes


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_table() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def chunks_made(pool: ChunkPool) -> int:
    """Chunks the pool has created (each is one memfd, kept while FREE): they are not a leak."""
    return sum(pool.usage().values())


def wait_until(pred, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(donor, pool, good link, thread errors) for the module; everything is checked closed at the end."""
    errors: list = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append((args.thread.name, args.exc_type, args.exc_value))
    vmm = host_backend(G)
    pool = ChunkPool(vmm, capacity_chunks=8)
    path = private_dir(tmp_path_factory.mktemp("peerfuzz") / "s") + "/d.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=4 * G)
    borrower_vmm = host_backend(G)
    good = PeerLink(path, "good", LAYOUT, borrower_vmm)
    good_lease = donor.wait_for_lease()
    donor.grow(good_lease, 1)
    wait_until(lambda: good.num_blocks >= BLOCKS_PER_UNIT, "the good lease grew")
    try:
        yield donor, pool, good, good_lease, errors
    finally:
        good.close()
        borrower_vmm.close()
        donor.close()
        pool.check_invariants()
        assert pool.usage()[Owner.PEER_DONATION] == 0
        vmm.close()
        threading.excepthook = old_hook
    assert not errors, errors


# ----------------------------------------------------------------------------- packets

HELLO = {"type": "HELLO", "version": 1, "name": "evil", "pid": 1, "layout": LAYOUT.to_wire()}
JUNK = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.lists(st.integers(), max_size=3)
)
SCHEMA_TYPES = sorted(wire.SCHEMA)


def mutate(msg: dict, how: str, key: str, value) -> dict:
    msg = json.loads(json.dumps(msg))
    if how == "drop":
        msg.pop(key, None)
    elif how == "add":
        msg["extra"] = value
    elif how == "retype":
        msg[key] = value
    return msg


BAD_LAYOUTS = [
    {**LAYOUT.to_wire(), "num_layers": 10**6},  # a block larger than the lease
    {**LAYOUT.to_wire(), "dtype": "int3"},
    {**LAYOUT.to_wire(), "dtype": [1]},
    {**LAYOUT.to_wire(), "head_dim": 0},
    {**LAYOUT.to_wire(), "head_dim": 10**400},
    {**LAYOUT.to_wire(), "model": "m" * 300},
    {**LAYOUT.to_wire(), "bogus": 1},
    {"num_layers": 1},
    {},
]
RAW = [b"", b"\xff\xfe garbage", b"[1, 2]", b'"HELLO"', b"NaN", b"{", b"[" * 60_000, b"9" * 5000,
       b'{"type": "REVOKE", "units": ' + b"9" * 5000 + b"}", b"x" * (wire.MAX_PACKET + 1),
       json.dumps({**HELLO, "name": "n" * (wire.MAX_PACKET - 200)}).encode()]  # fmt: skip


@st.composite
def packet(draw) -> tuple[str, object]:
    """("msg", dict) sent as JSON, ("raw", bytes), or ("reclaim", None): the donor takes the unit back."""
    kind = draw(st.sampled_from(["hello", "bad_hello", "write", "donor_msg", "mutated", "raw", "reclaim"]))
    if kind == "hello":
        return "msg", HELLO
    if kind == "bad_hello":
        return "msg", {**HELLO, "layout": draw(st.sampled_from(BAD_LAYOUTS))} if draw(st.booleans()) else mutate(
            HELLO, draw(st.sampled_from(["drop", "add", "retype"])), draw(st.sampled_from(sorted(HELLO))), draw(JUNK)
        )
    blocks = st.lists(st.integers(0, 2 * BLOCKS_PER_UNIT) | st.integers(0, 2**63), max_size=4)
    if kind == "write":
        return "msg", {"type": draw(st.sampled_from(["WRITE_BEGIN", "WRITE_END"])), "req_id": draw(st.integers(0, 9)),
                       "blocks": draw(blocks)}  # fmt: skip
    if kind in ("donor_msg", "mutated"):
        t = draw(st.sampled_from(SCHEMA_TYPES))
        msg = {"type": t, **{f: draw(JUNK) for f in wire.SCHEMA[t]}}
        if kind == "mutated":
            msg = mutate(msg, draw(st.sampled_from(["drop", "add", "retype"])), draw(st.sampled_from(sorted(msg))),
                         draw(JUNK))  # fmt: skip
        return "msg", msg
    if kind == "raw":
        return "raw", draw(st.sampled_from(RAW) | st.binary(max_size=64))
    return "reclaim", None


def send_packet(sock: socket.socket, payload: bytes, nfds: int) -> None:
    """Send one packet with ``nfds`` fresh pipe fds attached (ours are closed at once after)."""
    fds = []
    for _ in range((nfds + 1) // 2):
        fds.extend(os.pipe())
    if len(fds) > nfds:
        os.close(fds.pop())
    try:
        if fds:
            socket.send_fds(sock, [payload], fds)
        else:
            sock.send(payload)
    finally:
        wire.close_fds(fds)


def read_replies(sock: socket.socket, replies: list) -> None:
    """Every packet the donor sent until EOF: each must pass wire.recv's strict check."""
    sock.settimeout(5)
    while True:
        try:
            got = wire.recv(sock)
        except ConnectionResetError:
            return
        if got is None:
            return
        msg, fds = got
        wire.close_fds(fds)
        replies.append(msg)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(
    packets=st.lists(st.tuples(packet(), st.sampled_from([0, 0, 0, 1, 2, 5])), min_size=1, max_size=6),
    leave=st.sampled_from(["half_close", "close"]),
    greet=st.booleans(),
)
def test_random_borrower_traffic_drops_only_that_connection(world, packets, leave, greet):
    donor, pool, good, good_lease, errors = world
    before, table = fd_count() - chunks_made(pool), fd_table()
    threads_before = len(donor._threads)  # white box: the donor starts one thread per accepted connection
    evil = connect_unix(donor.socket_path)
    replies: list = []
    lease = None
    if greet:  # half the connections start well: a lease, so writes, fences and reclaims are reached
        packets = [(("msg", HELLO), 0), *packets]
    try:
        for (what, body), nfds in packets:
            if what == "reclaim":
                if lease is not None:
                    try:
                        donor.reclaim(lease, donor.region(lease).units)
                    except ValueError as exc:  # the donor dropped the lease meanwhile (an earlier bad packet)
                        assert str(exc).startswith("lease: no live lease"), exc
                continue
            payload = body if what == "raw" else json.dumps(body).encode()
            try:
                send_packet(evil, payload, nfds)
            except OSError:
                break  # the donor already closed this connection (refused or dropped it)
            if what == "msg" and body is HELLO and nfds == 0 and lease is None:
                evil.settimeout(5)  # a valid HELLO first: WELCOME (then the donor lends one unit)
                try:
                    got = wire.recv(evil)
                except ConnectionResetError:
                    got = None
                if got is None:
                    break
                msg, fds = got
                wire.close_fds(fds)
                replies.append(msg)
                if msg["type"] == "WELCOME":
                    lease = msg["lease"]
                    donor.grow(lease, 1)
        if leave == "half_close":
            evil.shutdown(socket.SHUT_WR)
            read_replies(evil, replies)
    finally:
        evil.close()
    for msg in replies:
        assert msg["type"] in ("WELCOME", "REFUSE", "GROW", "REVOKE", "WRITE_OK", "WRITE_DENIED", "ERROR"), msg
        if msg["type"] in ("REFUSE", "ERROR"):
            assert msg["field"] and msg["message"], msg
    accepted = lambda: len(donor._threads) > threads_before and donor._threads[threads_before].ident is not None  # noqa: E731
    wait_until(accepted, "the donor accepted the evil connection and started its thread")
    evil_thread = donor._threads[threads_before]
    evil_thread.join(5)  # it ended: its socket and every fd it received are closed
    assert not evil_thread.is_alive()
    assert donor.leases() == [good_lease], donor.leases()
    try:
        wait_until(lambda: fd_count() - chunks_made(pool) == before, "the donor closed the evil connection's fds")
    except AssertionError:
        now = fd_table()
        new = {k: v for k, v in now.items() if table.get(k) != v}
        gone = {k: v for k, v in table.items() if now.get(k) != v}
        raise AssertionError(f"fds new {new}, gone {gone}, chunks {pool.usage()}") from None
    assert pool.usage()[Owner.PEER_DONATION] == 1, pool.usage()  # only the good lease's unit is lent
    pool.check_invariants()
    assert not errors, errors
    data = torch.randint(0, 255, (LAYOUT.block_bytes,), dtype=torch.uint8)
    [ref] = good.write([1], [data])
    out = torch.empty_like(data)
    assert good.read(ref, out) and torch.equal(out, data)


# ------------------------------------------------- regressions: what the fuzzer found (each killed a lease
# thread with an exception that named no field)


@pytest.mark.parametrize("msg", [{"type": [1]}, {"type": {"a": 1}}, {"type": ["HELLO"], "units": 1}])
def test_a_type_of_another_json_type_names_the_type_field(msg):
    with pytest.raises(ValueError, match="^type: unknown message type"):  # was TypeError: unhashable
        wire.validate(msg)


@pytest.mark.parametrize("payload", [b"[" * 60_000, b"9" * 5000, b'{"type": "REVOKE", "units": ' + b"9" * 5000 + b"}"])
def test_json_too_deep_or_an_int_too_long_is_a_bad_message(payload):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        a.send(payload)  # was RecursionError / a ValueError naming no field
        with pytest.raises(ValueError, match="^message: not valid JSON"):
            wire.recv(b)
    finally:
        a.close()
        b.close()
