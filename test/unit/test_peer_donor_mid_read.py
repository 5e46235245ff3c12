"""A peer donor SIGKILLed while its borrower copies one of its blocks (issue 27 item 4, "donor
mid-read"), with real processes and the moment chosen by the test, not by chance.

Who runs where:

* the pool's arbiter: a thread of this process (a budget of ``UNITS`` chunks);
* donor A: a forked child, a ``LentPool`` client of the arbiter lending every chunk it holds
  (``PeerDonor``) to the borrower;
* the borrower: this process, ``PeerKVTier`` + ``PeerKVIO`` over layer-major KV buffers (what the
  server's hooks call);
* a third server: a ``LentPool`` client of this process that the arbiter grants donor A's chunks
  once A is dead, and that writes its own bytes into them (what a co-located engine does with
  memory it was just granted);
* donor B: a forked child with a private pool, the donor the borrower links to afterwards.

The seam is ``PeerLink``'s ``copier`` (what moves a block's bytes; a constructor argument):
``PausingCopier`` copies page ``PAUSE_PAGE``'s block in two parts and runs the fault between
them, in the reading thread: SIGKILL donor A and reap it, wait for the arbiter to take its chunks
back, let the third server write into them (checked through the borrower's own mapping: the
bytes under the copy are now the third server's), then the copy finishes. Two moments in the
block (before its first byte, halfway) times two for the borrower's receiver thread: it has
seen the death (its teardown waits for the copy) or it has not (held off on the link's lock, so
only the read's own checks can tell).

What must hold: the load returns the pages read before the kill, byte-equal, and stops at the
page in flight; that page's slots and every later one keep what they held (no foreign byte
reaches the KV buffers); no exception; the counters say so (``pages_hit``, ``pages_missed``,
``bytes_loaded``, ``stale_dropped``, ``donors_lost``); nothing of the dead donor stays mapped or
open (the borrower's backend, ``/proc/self/fd``, ``/proc/self/maps``; the arbiter's books
balanced); the borrower carries on without a donor (clean misses) and with donor B (round trip
byte-equal). ``test_without_the_hang_up_check_the_third_servers_bytes_pass`` is the control: the
same scenario with ``PeerLink``'s hang-up check switched off puts the third server's bytes into
the borrower's KV as valid, so the scenario does reach memory that changed hands.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile

import pytest
import torch

from memory_ext.peer import HostCopier, PeerDonor, PeerKVIO, PeerKVTier, PeerLink
from memory_ext.peer.kvpack import layout_of_buffers
from memory_ext.pool import ChunkPool, Owner
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.lent_pool import LentPool
from memory_ext.vmm import host_backend
from support.waiting import wait_until as support_wait_until

G = 1 << 16
UNITS = 2  # chunks donor A holds (the arbiter's whole budget) and lends
LAYERS, HEADS, DIM, T = 2, 2, 32, 16  # float16: 8192-byte blocks, 8 a chunk
PAGES = 6
PAUSE_PAGE = 3  # the page whose copy the donor dies in (pages 0-2 are read before)
SRC = torch.arange(0, PAGES * T)  # slots the pages are spilled from
DST = torch.arange(PAGES * T, 2 * PAGES * T)  # slots they are loaded into
SENTINEL = 7.0  # what DST holds before a load
FOREIGN = 0xEE  # the third server's byte


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    support_wait_until(cond, timeout, what, interval=0.002)


def donor_main(conn, parent_end) -> None:
    """A donor process: told its arbiter (or None: a private pool), socket and name, it lends all
    ``UNITS`` chunks to the first borrower when told ``lend``; it exits when the test process is
    gone (its pipe closes), so a crashed test leaves no donor behind."""
    parent_end.close()
    torch.set_num_threads(1)
    try:
        arb_path, path, name = conn.recv()
        vmm = host_backend(G)
        if arb_path is None:
            pool = ChunkPool(vmm, capacity_chunks=UNITS)
        else:
            lent = LentPool(arb_path, name, vmm)
            assert lent.borrow(UNITS) == UNITS
            pool = lent.pool
        donor = PeerDonor(pool, path, max_bytes_per_lease=UNITS * G, name=name)
        conn.send("ready")
        while True:
            if conn.recv() == "lend":
                lease = donor.wait_for_lease(10)
                conn.send(len(donor.grow(lease, UNITS)))
    except EOFError:
        os._exit(0)


class DonorProcess:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=donor_main, args=(child, self.conn), daemon=True)
        self.proc.start()
        child.close()

    def start(self, arb_path, path: str, name: str) -> None:
        self.conn.send((arb_path, path, name))
        assert self.conn.poll(20) and self.conn.recv() == "ready"

    def lend(self) -> int:
        self.conn.send("lend")
        assert self.conn.poll(20), "the donor did not lend"
        return self.conn.recv()

    def kill(self) -> None:
        """SIGKILL and reap: once this returns, the kernel has closed every fd of the donor."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive()


class PausingCopier(HostCopier):
    """``HostCopier``, except that once armed the ``pause_at``-th block copy (0 = the first after
    ``arm``) copies ``split`` of its bytes, calls ``fault(src)`` and then copies the rest."""

    def __init__(self):
        self.fault = None
        self.copies = 0

    def arm(self, pause_at: int, split: float, fault) -> None:
        self.pause_at, self.split, self.fault, self.copies = pause_at, split, fault, 0

    def copy(self, dst, src):
        if self.fault is not None:
            self.copies += 1
            if self.copies - 1 == self.pause_at:
                fault, self.fault = self.fault, None
                cut = int(src.numel() * self.split)
                dst[:cut].copy_(src[:cut])
                fault(src)
                dst[cut:].copy_(src[cut:])
                return
        dst.copy_(src)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def memx_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:memx" in line)


class World:
    """Arbiter, donor A (lending), donor B (not started), the borrower linked to A with PAGES pages
    spilled, and the third server's backend."""

    def __init__(self, tmp: str):
        ctx = mp.get_context("fork")
        # both donors are forked before this process opens any socket, so neither holds a copy of
        # the arbiter's, the borrower's or the third server's (a copy would hide a close)
        self.donor_a, self.donor_b = DonorProcess(ctx), DonorProcess(ctx)
        self.fds0, self.maps0 = fd_count(), memx_mappings()
        self.arb_path = os.path.join(tmp, "p.sock")
        self.path_a, self.path_b = os.path.join(tmp, "p.peer.a.sock"), os.path.join(tmp, "p.peer.b.sock")
        self.arb = Arbiter(self.arb_path, host_backend(G), UNITS).start()
        self.donor_a.start(self.arb_path, self.path_a, "a")
        g = torch.Generator().manual_seed(0)
        self.k = [torch.randn(2 * PAGES * T, HEADS, DIM, generator=g).half() for _ in range(LAYERS)]
        self.v = [torch.randn(2 * PAGES * T, HEADS, DIM, generator=g).half() for _ in range(LAYERS)]
        self.vmm = host_backend(G)
        self.tier = PeerKVTier(layout_of_buffers(self.k, self.v, T, model="m"))
        self.io = PeerKVIO(self.tier, self.k, self.v)
        self.copier = PausingCopier()
        self.link = self.tier.connect(self.path_a, "borrower", self.vmm, copier=self.copier)
        assert self.donor_a.lend() == UNITS
        wait_until(lambda: self.link.num_blocks == UNITS * 8, "the borrower sees donor A's blocks")
        self.tokens = list(range(1000, 1000 + PAGES * T))
        assert self.io.spill(self.tokens, SRC) == PAGES
        self.third_vmm = host_backend(G)
        self.closed = False

    def clear_dst(self) -> None:
        for t in self.k + self.v:
            t[DST] = SENTINEL

    def dst_page(self, i: int) -> list[torch.Tensor]:
        rows = DST[i * T : (i + 1) * T]
        return [t[rows] for t in self.k + self.v]

    def src_page(self, i: int) -> list[torch.Tensor]:
        rows = SRC[i * T : (i + 1) * T]
        return [t[rows] for t in self.k + self.v]

    def third_server_writes(self) -> None:
        """The third server borrows every free chunk of the arbiter (donor A's, once A is dead),
        fills them with ``FOREIGN`` and gives them back."""
        third = LentPool(self.arb_path, "third", self.third_vmm)
        try:
            assert third.borrow(UNITS) == UNITS
            chunks = third.pool.acquire(Owner.KV, UNITS)
            r = self.third_vmm.reserve(UNITS * G)
            for i, chunk in enumerate(chunks):
                self.third_vmm.map(r, i * G, chunk)
            self.third_vmm.tensor_view(r, 0, UNITS * G).fill_(FOREIGN)
            for i in range(UNITS):
                self.third_vmm.unmap(r, i * G)
            self.third_vmm.release(r)
            third.pool.release(Owner.KV, chunks)
            assert third.give_back(UNITS) == UNITS
        finally:
            third.close()

    def kill_mid_read(self, split: float, seen: bool) -> int:
        """Load every page into DST while donor A is SIGKILLed inside page PAUSE_PAGE's copy (see the
        module docstring); the load's result."""
        link = self.link

        def fault(src: torch.Tensor) -> None:
            if not seen:
                link._cond.acquire()  # the receiver thread cannot mark the link dead while we hold it
            self.donor_a.kill()
            if seen:
                wait_until(lambda: self.tier.stats["donors_lost"] == 1, "the borrower sees the death")
                # its teardown waits for this copy: the donor's chunks stay mapped under it
                assert not link.closed and link.imported_chunks() == UNITS
            wait_until(lambda: self.arb.status()["free"] == UNITS, "the arbiter takes donor A's chunks back")
            self.third_server_writes()
            assert bool((src == FOREIGN).all()), "the block being copied is not the third server's memory"

        self.clear_dst()
        self.copier.arm(PAUSE_PAGE, split, fault)
        try:
            return self.io.load(self.tokens, 0, DST)
        finally:
            if not seen:
                link._cond.release()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.tier.close()
        self.donor_a.kill()
        self.donor_b.kill()
        self.arb.stop()
        self.vmm.close()
        self.third_vmm.close()
        self.arb.backend.close()


@pytest.fixture
def world():
    tmp = tempfile.mkdtemp(prefix="peer-", dir="/tmp")  # short AF_UNIX paths; mkdtemp makes it 0700
    w = World(tmp)
    yield w
    w.close()
    for p in os.listdir(tmp):
        os.unlink(os.path.join(tmp, p))
    os.rmdir(tmp)


@pytest.mark.parametrize("seen", [True, False], ids=["death-seen-by-the-link", "death-not-yet-seen"])
@pytest.mark.parametrize("split", [0.0, 0.5], ids=["before-the-first-byte", "halfway"])
def test_donor_killed_mid_copy_is_a_clean_miss_and_leaves_nothing(world, split, seen):
    w, bb = world, world.tier.layout.block_bytes
    got = w.kill_mid_read(split, seen)

    # the pages read before the kill, byte-equal; the page in flight and the later ones untouched
    assert got == PAUSE_PAGE
    for i in range(PAUSE_PAGE):
        assert all(torch.equal(a, b) for a, b in zip(w.dst_page(i), w.src_page(i))), f"page {i}"
    for i in range(PAUSE_PAGE, PAGES):
        assert all(bool((t == SENTINEL).all()) for t in w.dst_page(i)), f"page {i} was written"
    assert w.link.stats["reads_ok"] == PAUSE_PAGE and w.link.stats["reads_invalidated"] == 1

    # the borrower drops the donor and everything of it
    wait_until(lambda: w.link.closed, "the link's teardown")
    st = w.tier.stats
    assert st["pages_hit"] == PAUSE_PAGE and st["bytes_loaded"] == PAUSE_PAGE * bb
    assert st["pages_missed"] == PAGES - PAUSE_PAGE and st["stale_dropped"] == 1
    assert st["donors_lost"] == 1 and len(w.tier.index) == 0 and w.tier.links() == []
    # a death seen first drops every entry; otherwise the failed read dropped its own first
    assert st["entries_dropped_dead"] == (PAGES if seen else PAGES - 1)
    assert w.vmm.live_chunks() == [] and w.vmm.ranges() == []
    c = w.vmm.counters()
    assert c["chunks_imported"] == c["chunks_destroyed"] == UNITS
    # the arbiter's books: donor A's chunks went to the third server and came back; no client left
    wait_until(lambda: w.arb.status()["clients"] == [], "the arbiter sees the third server leave")
    arb = w.arb.status()
    assert arb["created"] == arb["free"] == UNITS
    w.arb.check_invariants()

    # without a donor: clean misses, no exception
    w.clear_dst()
    assert w.io.load(w.tokens, 0, DST) == 0 and w.io.spill(w.tokens, SRC) == 0

    # a new donor: the borrower links to it and round-trips byte-equal
    w.donor_b.start(None, w.path_b, "b")
    link_b = w.tier.connect(w.path_b, "borrower", w.vmm)
    assert w.donor_b.lend() == UNITS
    wait_until(lambda: link_b.num_blocks == UNITS * 8, "the borrower sees donor B's blocks")
    assert w.io.spill(w.tokens, SRC) == PAGES
    w.clear_dst()
    assert w.io.load(w.tokens, 0, DST) == PAGES
    for i in range(PAGES):
        assert all(torch.equal(a, b) for a, b in zip(w.dst_page(i), w.src_page(i))), f"page {i}"

    w.close()
    assert w.vmm.counters()["chunks_imported"] == w.vmm.counters()["chunks_destroyed"] == 2 * UNITS
    assert fd_count() == w.fds0
    assert memx_mappings() == w.maps0


@pytest.mark.parametrize("seen", [True, False], ids=["death-seen-by-the-link", "death-not-yet-seen"])
def test_without_the_hang_up_check_the_third_servers_bytes_pass(world, seen, monkeypatch):
    """The control: what the test above guards against does happen in this scenario when
    ``PeerLink.read`` does not ask the kernel whether the donor hung up after its copy."""
    monkeypatch.setattr(PeerLink, "_hung_up", lambda self: False)
    got = world.kill_mid_read(0.5, seen)
    assert got > PAUSE_PAGE  # the page in flight counted as valid
    page = world.dst_page(PAUSE_PAGE)
    foreign = [bool((t.view(torch.uint8) == FOREIGN).any()) for t in page]
    assert any(foreign), "the third server's bytes did not reach the borrower's KV"
