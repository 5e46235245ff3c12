"""Two processes: a donor donates, a borrower stores KV blocks and reads them back
byte-identical; the donor reclaims (and overwrites the memory) while reads are in flight, and no
read returns stale bytes as valid (checksums); then the donor is SIGKILLed mid-load: the borrower
drops its entries, unmaps everything and leaks no chunk, mapping or fd.

The donor is a forked child (the parent's torch is already imported, so it starts in
milliseconds); it touches its memory only through libc (``ctypes.memset``) and single-threaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from memory_ext.peer import HostCopier, PeerDonor, PeerKVLayout, PeerKVTier
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import host_backend, private_dir

G = 1 << 16
LAYOUT = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32, dtype="float16", model="m")
UNITS = 4  # 4 units x 8 blocks


def donor_main(path: str, conn) -> None:
    torch.set_num_threads(1)
    vmm = host_backend(G)
    pool = ChunkPool(vmm, capacity_chunks=16)
    donor = PeerDonor(pool, path, max_bytes_per_lease=UNITS * G, name="donor")
    conn.send("ready")
    lease = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "lease":
            lease = donor.wait_for_lease(10)
            conn.send(lease)
        elif cmd == "grow":
            conn.send(len(donor.grow(lease, arg)))
        elif cmd == "reclaim_and_overwrite":
            # take `arg` units back and at once write the donor's own bytes into that memory
            released = donor.reclaim(lease, arg, to=Owner.KV)
            r = vmm.reserve(G)
            for chunk in released:
                addr = vmm.map(r, 0, chunk)
                for _ in range(20):
                    ctypes.memset(addr, 0xEE, G)
                vmm.unmap(r, 0)
            vmm.release(r)
            pool.release(Owner.KV, released)
            conn.send(len(released))
        elif cmd == "status":
            pool.check_invariants()
            conn.send({"peer": pool.usage()[Owner.PEER_DONATION], "created": pool.chunks_created, **donor.status()})


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def memx_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:memx" in line)


class ArmedCopier(HostCopier):
    """Slows every copy by 1 ms; when armed, the next copy from a block >= ``tail`` signals
    ``in_copy`` and waits for ``reclaimed`` before copying: a read guaranteed to be in flight
    (first generation check passed) while the donor reclaims and overwrites its block."""

    def __init__(self, link, tail: int):
        self.link, self.tail = link, tail
        self.armed = False
        self.in_copy, self.reclaimed = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def copy(self, dst, src):
        block = (src.data_ptr() - self.link.vrange.base) // self.link.block_bytes
        with self.lock:
            mine = self.armed and block >= self.tail
            if mine:
                self.armed = False
        if mine:
            self.in_copy.set()
            assert self.reclaimed.wait(20)
        else:
            time.sleep(0.001)
        dst.copy_(src)


def digest(t: torch.Tensor) -> bytes:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


@pytest.fixture
def donor_proc(tmp_path):
    path = private_dir(tmp_path / "s") + "/donor.sock"
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=donor_main, args=(path, child), daemon=True)
    proc.start()
    assert parent.poll(20) and parent.recv() == "ready"

    def call(cmd, arg=None):
        parent.send((cmd, arg))
        assert parent.poll(20), f"donor did not answer {cmd}"
        return parent.recv()

    yield proc, path, call
    if proc.is_alive():
        proc.kill()
    proc.join(5)


def test_two_processes_round_trip_reclaim_and_donor_death(donor_proc):
    proc, path, call = donor_proc
    fds0, maps0 = fd_count(), memx_mappings()
    vmm = host_backend(G)
    tier = PeerKVTier(LAYOUT)
    link = tier.connect(path, "borrower", vmm)
    assert call("lease") is not None
    assert call("grow", UNITS) == UNITS
    deadline = time.monotonic() + 5
    while link.num_blocks < UNITS * 8:
        assert time.monotonic() < deadline
        time.sleep(0.005)

    # 1. store three conversations (8 pages each) and read them back byte-identical
    g = torch.Generator().manual_seed(0)
    convs = {}
    for c in range(3):
        tokens = [c * 100_000 + i for i in range(16 * 8)]
        pages = [torch.randn(LAYOUT.block_shape, generator=g).to(torch.float16) for _ in range(8)]
        assert tier.store(tokens, pages) == 8
        convs[c] = (tokens, pages, [digest(p) for p in pages])
    for tokens, pages, _ in convs.values():
        out = [torch.empty_like(p) for p in pages]
        assert tier.load(tokens, out) == 8
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
    st = call("status")
    assert st["peer"] == UNITS and st["leases"][0]["donated_bytes"] == UNITS * G

    def no_fences():  # WRITE_END is asynchronous: let the donor see the last writes end
        deadline = time.monotonic() + 10
        while call("status")["leases"][0]["fences"]:
            assert time.monotonic() < deadline
            time.sleep(0.005)

    no_fences()

    # 2. readers hammer every page (each valid page checked against its checksum) while the donor
    #    reclaims units and overwrites their memory, then donates again and we store again
    copier = link.copier = ArmedCopier(link, tail=(UNITS - 2) * 8)
    counts = {"valid": 0, "stale": 0, "invalid": 0, "foreign_copied": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def reader():
        buf = torch.empty(LAYOUT.block_shape, dtype=torch.float16)
        while not stop.is_set():
            for tokens, _pages, sums in convs.values():
                for h, want in zip(tier.hashes(tokens), sums):
                    ref = tier.index.get(h)
                    if ref is None:
                        continue
                    ok = link.read(ref, buf)
                    got = digest(buf)
                    with lock:
                        if ok:
                            counts["valid"] += 1
                            counts["stale"] += got != want
                        else:
                            counts["invalid"] += 1
                            counts["foreign_copied"] += bool((buf.view(torch.uint8) == 0xEE).all())

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    cycles = 4
    try:
        for _ in range(cycles):
            copier.in_copy.clear()
            copier.reclaimed.clear()
            copier.armed = True
            assert copier.in_copy.wait(20), "no read of a tail block started"
            assert call("reclaim_and_overwrite", 2) == 2  # back to the donor at once (no fence)
            copier.reclaimed.set()
            time.sleep(0.02)
            assert call("grow", 2) == 2
            deadline = time.monotonic() + 10
            while link.num_blocks < UNITS * 8:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            for tokens, pages, _ in convs.values():
                tier.store(tokens, pages)
            no_fences()
    finally:
        stop.set()
        copier.reclaimed.set()
        for t in threads:
            t.join(10)
    assert counts["stale"] == 0, counts
    # each cycle had a read in flight over the reclaim: it copied the donor's overwrite and
    # was refused (the race is real, and caught)
    assert counts["foreign_copied"] >= cycles and counts["valid"] > 0, counts
    link.copier = HostCopier()
    for tokens, pages, _ in convs.values():  # after the churn everything stored again reads back
        out = [torch.empty_like(p) for p in pages]
        n = tier.load(tokens, out)
        assert all(torch.equal(pages[i], out[i]) for i in range(n))
    st = call("status")
    assert st["peer"] == UNITS and st["created"] <= 16

    # 3. SIGKILL the donor while loads run: every load is a hit or a clean miss, never an error
    errors = []
    stop.clear()

    def loader():
        while not stop.is_set():
            for tokens, pages, _ in convs.values():
                out = [torch.empty_like(p) for p in pages]
                try:
                    n = tier.load(tokens, out)
                    if not all(torch.equal(pages[i], out[i]) for i in range(n)):
                        errors.append("stale")
                except Exception as exc:  # noqa: BLE001
                    errors.append(repr(exc))

    threads = [threading.Thread(target=loader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    deadline = time.monotonic() + 5
    while not link.closed:
        assert time.monotonic() < deadline, "borrower did not notice the donor's death"
        time.sleep(0.005)
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert errors == []
    assert len(tier.index) == 0 and tier.stats["donors_lost"] == 1
    assert all(tier.load(tokens, [torch.empty_like(p) for p in pages]) == 0 for tokens, pages, _ in convs.values())
    assert vmm.live_chunks() == [] and vmm.ranges() == []
    assert vmm.counters()["chunks_imported"] == vmm.counters()["chunks_destroyed"] > 0
    vmm.close()
    assert fd_count() == fds0
    assert memx_mappings() == maps0
