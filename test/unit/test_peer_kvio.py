"""Spill from / load into an engine's layer-major KV buffers through the peer tier
(memory_ext.peer.kvio), against a real donor in this process."""

from __future__ import annotations

import time

import pytest
import torch

import memory_ext.peer.kvio as kvio
from memory_ext.peer import HostCopier, PeerDonor, PeerKVIO, PeerKVTier
from memory_ext.peer.kvpack import layout_of_buffers
from memory_ext.pool import ChunkPool
from memory_ext.vmm import host_backend, private_dir

G = 1 << 16
SLOTS, LAYERS, HEADS, DIM, T = 256, 3, 2, 8, 16  # 3072-byte blocks: 21.3 a chunk, 64 in 3 chunks


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def kv(seed):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(SLOTS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    return k, v


@pytest.fixture
def setup(tmp_path):
    donor_vmm, borrower_vmm = host_backend(G), host_backend(G)
    pool = ChunkPool(donor_vmm, capacity_chunks=16)
    path = private_dir(tmp_path / "s") + "/d.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=6 * G)
    k, v = kv(0)
    tier = PeerKVTier(layout_of_buffers(k, v, T, model="m"))
    link = tier.connect(path, "b", borrower_vmm)
    lease = donor.wait_for_lease()
    donor.grow(lease, 3)
    wait_until(lambda: link.num_blocks == 64)
    yield donor, lease, tier, link, k, v
    tier.close()
    donor.close()
    wait_until(lambda: borrower_vmm.ranges() == [])
    donor_vmm.close()
    borrower_vmm.close()


def test_spill_then_load_into_other_slots(setup, monkeypatch):
    donor, lease, tier, link, k, v = setup
    io = PeerKVIO(tier, k, v)
    tokens = list(range(5000, 5000 + 5 * T + 7))  # 5 full pages and a partial one
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))[: len(tokens)]
    assert io.spill(tokens, slots) == 5
    gathers = []
    monkeypatch.setattr(kvio, "gather_block", lambda *a: gathers.append(1) or a[-1])
    assert io.spill(tokens, slots) == 0 and gathers == []  # held pages are not even gathered
    monkeypatch.undo()
    # the engine reuses those slots; the request comes back with pages 0-1 still on the device
    original = [(kk.clone(), vv.clone()) for kk, vv in zip(k, v)]
    for t in k + v:
        t.zero_()
    new_slots = torch.arange(100, 100 + 3 * T)
    reads_before = link.stats["reads_ok"]
    assert io.load(tokens, 2, new_slots) == 3
    assert link.stats["reads_ok"] - reads_before == 3  # pages 0 and 1 were not read
    for layer, (ko, vo) in enumerate(original):
        assert torch.equal(k[layer][new_slots], ko[slots[2 * T : 5 * T]])
        assert torch.equal(v[layer][new_slots], vo[slots[2 * T : 5 * T]])
    assert io.load(tokens, 4, torch.arange(0, 3 * T)) == 1  # only one page left from page 4
    assert io.load(tokens, 5, torch.arange(0, T)) == 0


def test_a_failed_page_is_never_scattered(setup):
    donor, lease, tier, link, k, v = setup
    io = PeerKVIO(tier, k, v)
    tokens = list(range(4 * T))
    assert io.spill(tokens, torch.arange(4 * T)) == 4
    wait_until(lambda: all(le["fences"] == 0 for le in donor.status()["leases"]))

    class ReclaimDuringFirstRead(HostCopier):
        def copy(self, dst, src):
            if not self.done:
                self.done = True
                donor.reclaim(lease, 3)  # the page being read is taken back mid-read
            dst.copy_(src)

    link.copier = ReclaimDuringFirstRead()
    link.copier.done = False
    for t in k + v:
        t[200:].fill_(7.0)
    assert io.load(tokens, 0, torch.arange(200, 200 + 4 * T)) == 0  # the read was refused...
    assert all(bool((t[200:] == 7.0).all()) for t in k + v)  # ...and nothing reached the slots
    assert link.stats["reads_invalidated"] == 1 and tier.stats["stale_dropped"] == 1


def test_buffers_of_another_layout_are_refused(setup):
    donor, lease, tier, link, k, v = setup
    k2 = [torch.zeros(SLOTS, HEADS, DIM * 2, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="layout.head_dim"):
        PeerKVIO(tier, k2, k2)
    io = PeerKVIO(tier, k, v)
    with pytest.raises(ValueError, match="slots"):
        io.spill(list(range(2 * T)), torch.arange(T))
    with pytest.raises(ValueError, match="slots"):
        io.load(list(range(2 * T)), 0, torch.arange(T + 1))


def test_a_block_straddling_two_chunks_goes_with_the_later_one(setup):
    donor, lease, tier, link, k, v = setup
    block_bytes = tier.layout.block_bytes  # 3072: block 21 covers bytes 64512..67584, chunks 0 and 1
    data = torch.arange(block_bytes, dtype=torch.int64).remainder(253).to(torch.uint8)
    refs = link.write([20, 21], [data, data])
    wait_until(lambda: all(le["fences"] == 0 for le in donor.status()["leases"]))
    assert len(donor.reclaim(lease, 2)) == 2  # chunks 1 and 2
    wait_until(lambda: link.num_blocks == 21 and link.imported_chunks() == 1)
    out = torch.empty_like(data)
    assert link.read(refs[0], out) and torch.equal(out, data)  # block 20 lies in chunk 0 only
    assert not link.read(refs[1], out)  # the straddler is gone with chunk 1
