"""The lease protocol's validation (memory_ext.peer.wire) and a donor that survives a borrower
speaking nonsense: errors name the field, received fds are closed, other leases carry on."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch

from memory_ext.peer import PeerDonor, PeerKVLayout, PeerLink, wire
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import connect_unix, host_backend, private_dir

G = 1 << 16
LAYOUT = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        ([1, 2], "message"),
        ({"type": "HELLO?"}, "type"),
        ({"type": "REVOKE"}, "units"),
        ({"type": "REVOKE", "units": -1}, "units"),
        ({"type": "REVOKE", "units": True}, "units"),
        ({"type": "REVOKE", "units": 1, "more": 2}, "more"),
        ({"type": "WRITE_BEGIN", "req_id": 1, "blocks": [1, "2"]}, "blocks"),
        ({"type": "HELLO", "version": 1, "name": 3, "pid": 1, "layout": {}}, "name"),
        ({"type": "HELLO", "version": 1, "name": "b", "pid": 1, "layout": []}, "layout"),
    ],
)
def test_validate_names_the_field(msg, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        wire.validate(msg)


def test_recv_closes_fds_of_a_bad_message_and_sees_eof():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    before = fd_count()
    r, w = os.pipe()
    # a REVOKE must not carry fds: the receiver refuses it and closes what came
    socket.send_fds(a, [json.dumps({"type": "REVOKE", "units": 1}).encode()], [r, w])
    os.close(r)
    os.close(w)
    with pytest.raises(ValueError, match="^fds"):
        wire.recv(b)
    assert fd_count() == before
    a.send(b"not json")
    with pytest.raises(ValueError, match="^message"):
        wire.recv(b)
    with pytest.raises(ValueError, match="^fds"):
        wire.send(a, {"type": "WELCOME", "version": 1, "lease": 1, "device": "cpu", "chunk_bytes": 1,
                      "block_bytes": 1, "unit_chunks": 1, "max_units": 1})  # fmt: skip
    a.close()
    assert wire.recv(b) is None
    b.close()


def test_donor_survives_a_garbage_borrower(tmp_path):
    vmm = host_backend(G)
    pool = ChunkPool(vmm, capacity_chunks=8)
    path = private_dir(tmp_path / "s") + "/d.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=4 * G)
    try:
        # 1. nonsense instead of HELLO: refused with the field, connection closed
        bad = connect_unix(path)
        bad.send(b'{"type": "GROW", "first_unit": 0, "units": 0, "chunks": []}')
        reply = json.loads(bad.recv(4096))
        assert reply["type"] == "REFUSE" and reply["field"] == "type"
        assert bad.recv(4096) == b""
        bad.close()
        # 2. a proper borrower, then a second one that turns bad after its HELLO
        borrower_vmm = host_backend(G)
        good = PeerLink(path, "good", LAYOUT, borrower_vmm)
        lease_good = donor.wait_for_lease()
        donor.grow(lease_good, 1)
        evil = connect_unix(path)
        hello = {"type": "HELLO", "version": 1, "name": "evil", "pid": os.getpid(), "layout": LAYOUT.to_wire()}
        wire.send(evil, hello)
        msg, fds = wire.recv(evil)
        assert msg["type"] == "WELCOME"
        for fd in fds:
            os.close(fd)
        deadline = time.monotonic() + 5
        while len(donor.leases()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        evil_lease = max(donor.leases())
        donor.grow(evil_lease, 1)
        msg, fds = wire.recv(evil)
        for fd in fds:
            os.close(fd)
        evil.send(b"\xff garbage")  # the donor drops this lease and takes its unit back
        deadline = time.monotonic() + 5
        while evil_lease in donor.leases():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert pool.usage()[Owner.PEER_DONATION] == 1  # only the good lease's unit is lent
        deadline = time.monotonic() + 5
        while good.num_blocks < 8:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        data = torch.arange(LAYOUT.block_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        [ref] = good.write([3], [data])
        out = torch.empty_like(data)
        assert good.read(ref, out) and torch.equal(out, data)
        evil.close()
        good.close()
        borrower_vmm.close()
    finally:
        donor.close()
        pool.check_invariants()
        assert pool.usage()[Owner.PEER_DONATION] == 0
        vmm.close()
