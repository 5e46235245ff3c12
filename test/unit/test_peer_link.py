"""Donor and borrower in one process (threads): byte-identical round trips, reclaim (at once,
seqlock-validated reads, write fences), refusals, and either side going away without leaks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import memory_ext.peer.tier as tier_module
from memory_ext.peer import HostCopier, PeerDonor, PeerKVLayout, PeerKVTier, PeerLink
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import host_backend, private_dir
from support.waiting import wait_until as support_wait_until

G = 1 << 16
LAYOUT = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32, dtype="float16", model="m")
# block = 8192 bytes -> one 64 KiB chunk per elastic unit, 8 blocks per unit


def wait_until(cond, timeout=5.0):
    support_wait_until(cond, timeout, interval=0.002)


@pytest.fixture
def env(tmp_path):
    donor_vmm = host_backend(G)
    pool = ChunkPool(donor_vmm, capacity_chunks=32)
    path = private_dir(tmp_path / "s") + "/donor.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=8 * G, name="d")
    borrower_vmm = host_backend(G)
    yield donor, pool, path, borrower_vmm
    donor.close()
    wait_until(lambda: borrower_vmm.ranges() == [])  # every link has seen the donor go and cleaned up
    pool.check_invariants()
    assert pool.usage()[Owner.PEER_DONATION] == 0
    donor_vmm.close()
    borrower_vmm.close()


def pages(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.block_shape, generator=g).to(torch.float16) for _ in range(n)]


def no_fences(donor):
    """Writes end with an asynchronous WRITE_END; a reclaim right after may find the fence still up."""
    wait_until(lambda: all(lease["fences"] == 0 for lease in donor.status()["leases"]))


def connect(donor, path, vmm, units=2):
    tier = PeerKVTier(LAYOUT)
    link = tier.connect(path, "b", vmm)
    lease = donor.wait_for_lease()
    donor.grow(lease, units)
    wait_until(lambda: link.num_blocks == units * 8)
    return tier, link, lease


def test_store_and_load_byte_identical(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm)
    tokens = list(range(16 * 5 + 3))  # 5 full pages and a partial one
    src = pages(5)
    assert tier.store(tokens, src) == 5
    assert tier.store(tokens, src) == 0  # already held
    assert pool.usage()[Owner.PEER_DONATION] == 2
    out = [torch.empty(LAYOUT.block_shape, dtype=torch.float16) for _ in range(5)]
    assert tier.load(tokens, out) == 5
    assert all(torch.equal(a, b) for a, b in zip(src, out))
    # a different continuation shares only the common prefix (hash chain)
    other = tokens[:32] + [9999] + tokens[33:]
    assert tier.match(other) == 2
    st = donor.status()["leases"][0]
    assert st["units"] == 2 and st["donated_bytes"] == 2 * G and st["borrower"] == "b"
    [mine] = tier.status()["peers"]
    assert mine["borrowed_bytes"] == 2 * G and mine["blocks"] == 16 and mine["pages"] == 5
    assert mine["free_blocks"] == 11 and tier.status()["pages_stored"] == 5
    tier.close()
    wait_until(lambda: not donor.leases())
    assert vmm.live_chunks() == []


def test_reclaim_drops_entries_and_the_chunks_go_back_at_once(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=2)
    tokens = list(range(16 * 16))
    src = pages(16)
    assert tier.store(tokens, src) == 16
    refs = tier.index.match(tier.hashes(tokens))
    no_fences(donor)
    released = donor.reclaim(lease, 1, to=Owner.KV)
    assert len(released) == 1 and pool.usage()[Owner.KV] == 1  # back to the donor in the same call
    wait_until(lambda: link.num_blocks == 8 and link.imported_chunks() == 1)
    lost = [r for r in refs if r.block >= 8]
    assert len(lost) == 8
    buf = torch.empty(LAYOUT.block_shape, dtype=torch.float16)
    assert not any(link.read(r, buf) for r in lost)
    out = [torch.empty(LAYOUT.block_shape, dtype=torch.float16) for _ in range(16)]
    n = tier.load(tokens, out)
    kept = sorted(r.block for r in refs if r.block < 8)
    # pages in blocks still donated load identically up to the first reclaimed page
    first_lost = min(i for i, r in enumerate(refs) if r.block >= 8)
    assert n == first_lost and all(torch.equal(src[i], out[i]) for i in range(n))
    assert tier.stats["entries_dropped_reclaim"] == 8 and len(kept) == 8
    pool.release(Owner.KV, released)


class _ReclaimDuringCopy(HostCopier):
    """Runs ``action`` once, between the copy and the second generation check."""

    def __init__(self, action):
        self.action = action

    def fence(self, dst, src):
        if self.action is not None:
            act, self.action = self.action, None
            act()


def test_reclaim_mid_read_is_never_a_valid_read(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=1)
    src = pages(1, seed=3)
    [ref] = link.write([5], src)
    no_fences(donor)
    buf = torch.empty(LAYOUT.block_shape, dtype=torch.float16)
    assert link.read(ref, buf) and torch.equal(buf, src[0])

    def reclaim_and_reuse():
        # the donor takes the unit back and writes its own data into the very same chunk
        [chunk] = donor.reclaim(lease, 1)
        [again] = pool.acquire(Owner.KV, 1)
        assert again is chunk
        r = pool.backend.reserve(G)
        pool.backend.map(r, 0, again)
        pool.backend.tensor_view(r, 0, G).fill_(0xEE)
        pool.backend.unmap(r, 0)
        pool.backend.release(r)
        pool.release(Owner.KV, [again])

    link.copier = _ReclaimDuringCopy(reclaim_and_reuse)
    # the donor overwrites after the copy: the copied bytes are the stored ones, but a read
    # that overlapped a reclaim is refused all the same
    assert not link.read(ref, buf)
    assert link.stats["reads_invalidated"] == 1


def test_reclaim_racing_the_copy_itself_is_caught(env):
    """The donor scribbles *before* the copy (after the first check): the copy returns foreign
    bytes, and only the second generation check stops them from being returned as valid."""
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=1)
    src = pages(1, seed=4)
    [ref] = link.write([2], src)
    no_fences(donor)
    region = donor.region(lease)

    class ScribbleFirst(HostCopier):
        def copy(self, dst, s):
            donor.reclaim(lease, 1, to=Owner.KV)  # unit revoked, gens bumped, chunk now KV's
            s.fill_(0xEE)  # the donor's new KV lands in the same bytes
            dst.copy_(s)

    link.copier = ScribbleFirst()
    buf = torch.empty(LAYOUT.block_shape, dtype=torch.float16)
    assert not link.read(ref, buf)
    assert bool((buf.view(torch.uint8) == 0xEE).all())  # the copy did read foreign bytes
    assert region.units == 0
    pool.release(Owner.KV, pool.chunks_of(Owner.KV))


def test_write_fence_holds_the_reclaimed_unit_until_the_write_ends(env):
    donor, pool, path, vmm = env
    released_late = []
    donor._on_release = lambda lease_id, chunks: released_late.extend(chunks)
    tier, link, lease = connect(donor, path, vmm, units=1)
    seen = {}

    class ReclaimWhileWriting(HostCopier):
        def copy(self, dst, s):
            if "now" not in seen:
                seen["now"] = donor.reclaim(lease, 1, to=Owner.KV)
                seen["fenced"] = donor.status()["leases"][0]["fenced_units"]
            dst.copy_(s)

    link.copier = ReclaimWhileWriting()
    refs = link.write([1, 2], pages(2))
    assert seen["now"] == [] and seen["fenced"] == 1  # not reused while the write runs
    wait_until(lambda: len(released_late) == 1)
    assert pool.usage()[Owner.KV] == 1 and pool.usage()[Owner.PEER_DONATION] == 0
    link.copier = HostCopier()
    buf = torch.empty(LAYOUT.block_shape, dtype=torch.float16)
    assert refs is not None and not any(link.read(r, buf) for r in refs)  # granted gens are stale now
    assert link.write([1], pages(1)) is None  # the blocks are gone
    pool.release(Owner.KV, released_late)


def test_refused_layout_and_mismatched_backend(env):
    donor, pool, path, vmm = env

    def only_model_m(layout):
        if layout.model != "m":
            raise ValueError(f"layout.model: this donor serves model 'm' only, not {layout.model!r}")

    donor._accept_layout = only_model_m
    other = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32, model="x")
    with pytest.raises(ValueError, match="layout.model: refused by the donor"):
        PeerLink(path, "b", other, vmm)
    wrong = host_backend(2 * G)
    with pytest.raises(ValueError, match="chunk_bytes"):
        PeerLink(path, "b", LAYOUT, wrong)
    wrong.close()
    wait_until(lambda: not donor.leases())
    assert vmm.live_chunks() == [] and vmm.ranges() == []


def test_donor_gone_drops_entries_and_unmaps_everything(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=2)
    tokens = list(range(16 * 4))
    assert tier.store(tokens, pages(4)) == 4
    assert len(vmm.live_chunks()) == 2
    donor.close()
    wait_until(lambda: link.closed)
    # a closing donor revokes first (REVOKE 0), then the connection ends: every entry is gone
    assert len(tier.index) == 0 and tier.stats["donors_lost"] == 1
    assert tier.stats["entries_dropped_reclaim"] + tier.stats["entries_dropped_dead"] == 4
    assert vmm.live_chunks() == [] and vmm.ranges() == []
    out = [torch.empty(LAYOUT.block_shape, dtype=torch.float16) for _ in range(4)]
    assert tier.load(tokens, out) == 0  # a miss -> recompute, never an error
    assert pool.usage()[Owner.PEER_DONATION] == 0


def test_a_donor_gone_before_connect_returns_leaves_no_dead_link(env, monkeypatch):
    """The donor goes between the handshake and ``connect`` registering the link: the tier keeps no
    dead link (a server takes a listed link's donor for linked and would never link to it again),
    and a new donor on the same socket is linked and used."""
    donor, pool, path, vmm = env
    real_link = tier_module.PeerLink

    def link_whose_donor_is_gone(*args, **kw):
        link = real_link(*args, **kw)
        donor.close()
        wait_until(lambda: link.closed)  # its on_dead ran before connect registers it
        return link

    monkeypatch.setattr(tier_module, "PeerLink", link_whose_donor_is_gone)
    tier = PeerKVTier(LAYOUT)
    assert tier.connect(path, "b", vmm).dead
    assert tier.links() == [] and tier.stats["donors_lost"] == 0
    monkeypatch.undo()
    again = PeerDonor(pool, path, max_bytes_per_lease=8 * G, name="d2")
    try:
        link = tier.connect(path, "b", vmm)
        again.grow(again.wait_for_lease(), 1)
        wait_until(lambda: link.num_blocks == 8)
        assert tier.links() == [link]
        tokens, data = list(range(16 * 4)), pages(4)
        assert tier.store(tokens, data) == 4
        out = [torch.empty_like(p) for p in data]
        assert tier.load(tokens, out) == 4 and all(torch.equal(a, b) for a, b in zip(data, out))
        no_fences(again)
    finally:
        tier.close()
        again.close()


def test_full_tier_overwrites_least_recently_used(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=1)  # 8 blocks
    a, b = list(range(16 * 6)), list(range(1000, 1000 + 16 * 6))
    pa, pb = pages(6, 1), pages(6, 2)
    assert tier.store(a, pa) == 6
    assert tier.store(b, pb) == 6  # 4 of a's blocks are overwritten, oldest first
    assert tier.stats["blocks_overwritten"] == 4
    out = [torch.empty(LAYOUT.block_shape, dtype=torch.float16) for _ in range(6)]
    assert tier.load(b, out) == 6 and all(torch.equal(x, y) for x, y in zip(pb, out))
    assert tier.match(a) == 0  # its first page went first


def test_a_write_given_up_on_still_ends_its_fence(env):
    """A write that stops waiting for WRITE_OK (timeout) must not leave the donor's fence up."""
    donor, pool, path, vmm = env
    answer = donor._handle

    def late_answer(lease, msg):  # the donor answers WRITE_BEGIN after 1 s
        if msg["type"] == "WRITE_BEGIN":
            time.sleep(1.0)
        answer(lease, msg)

    donor._handle = late_answer
    tier = PeerKVTier(LAYOUT)
    link = tier.connect(path, "b", vmm, write_timeout=0.05)  # gives up long before the answer
    lease = donor.wait_for_lease()
    donor.grow(lease, 1)
    wait_until(lambda: link.num_blocks == 8)
    assert link.write([0, 1], pages(2)) is None
    wait_until(lambda: link.stats["writes_refused"] == 1)
    wait_until(lambda: donor.stats["writes_fenced"] == 1)  # the late WRITE_OK went out
    no_fences(donor)  # ...and the link's receiver ended it
    assert len(donor.reclaim(lease, 1)) == 1


def test_one_write_per_block_at_a_time(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=1)
    seen = {}

    class WriteAgain(HostCopier):
        def copy(self, dst, s):
            if "err" not in seen:
                seen["err"] = None
                try:
                    link.write([4], pages(1))
                except ValueError as exc:
                    seen["err"] = str(exc)
            dst.copy_(s)

    link.copier = WriteAgain()
    assert link.write([4, 5], pages(2)) is not None
    assert seen["err"] is not None and seen["err"].startswith("blocks: [4] are being written already")


def test_borrower_gone_mid_write_after_a_reclaim(env):
    """The reclaimed (fenced) unit goes where the reclaim said, the lease's other units to FREE."""
    donor, pool, path, vmm = env
    late, lost = [], []
    donor._on_release = lambda lease_id, chunks: late.extend(chunks)
    donor._on_lost = lambda lease_id, units: lost.append(units)
    tier, link, lease = connect(donor, path, vmm, units=2)
    seen = {}

    class ReclaimThenDie(HostCopier):
        def copy(self, dst, s):
            if not seen:
                seen["now"] = donor.reclaim(lease, 1, to=Owner.KV)  # tail unit fenced by us
                # the connection ends while the write runs (as at a borrower's death, except that a
                # dead process would not go on writing: the donor cannot tell the two apart)
                link.sock.shutdown(2)
                wait_until(lambda: not donor.leases())
            dst.copy_(s)

    link.copier = ReclaimThenDie()
    link.write([1, 9], pages(2))  # block 9 is in the reclaimed tail unit
    assert seen["now"] == [] and len(late) == 1 and lost == [1]
    assert pool.usage()[Owner.KV] == 1 and pool.usage()[Owner.PEER_DONATION] == 0
    pool.release(Owner.KV, late)


def test_close_lets_running_writes_finish_first(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=1)
    events = {}

    class SlowWrite(HostCopier):
        def copy(self, dst, s):
            if not events:
                events["closing"] = threading.Thread(target=link.close)
                events["closing"].start()
                time.sleep(0.2)
                events["lease_alive_during_write"] = bool(donor.leases())
            dst.copy_(s)

    link.copier = SlowWrite()
    assert link.write([3], pages(1)) is not None
    events["closing"].join(3)
    assert not events["closing"].is_alive()  # close() went on as soon as the write ended
    assert events["lease_alive_during_write"]  # the donor kept the lease until the write ended
    wait_until(lambda: not donor.leases() and link.closed)
    assert link.write([4], pages(1)) is None


def test_donor_close_waits_for_running_writes(env):
    donor, pool, path, vmm = env
    tier, link, lease = connect(donor, path, vmm, units=1)
    state = {}

    class HeldWrite(HostCopier):
        def copy(self, dst, s):
            if not state:
                state["closer"] = threading.Thread(target=donor.close)
                state["closer"].start()
                time.sleep(0.2)
                state["held_during_write"] = pool.usage()[Owner.PEER_DONATION]
            dst.copy_(s)

    link.copier = HeldWrite()
    refs = link.write([2], pages(1))
    state["closer"].join(5)
    assert not state["closer"].is_alive()
    assert state["held_during_write"] == 1  # the donor did not take the memory back under the write
    assert pool.usage()[Owner.PEER_DONATION] == 0
    buf = torch.empty(LAYOUT.block_shape, dtype=torch.float16)
    assert refs is not None and not link.read(refs[0], buf)  # revoked before the write began to count
