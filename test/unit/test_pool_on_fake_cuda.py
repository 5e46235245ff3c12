"""The layers above the VMM on our CUDA backend over the fake driver: the chunk pool and layered KV
buffers, the activation arena's allocator interface (segments, overflow through cuMemAlloc,
shrink), the weight store, and a peer link (export/import between two backends). What the GPU
tests cover, minus tensors on a device: views here are CPU tensors over the same addresses.
Every test ends with the driver holding nothing: each path gives back what it took."""

from __future__ import annotations

import ctypes

import pytest
import torch

from memory_ext.peer import PeerDonor, PeerKVLayout, PeerKVTier
from memory_ext.pool import ChunkPool, LayeredKVBuffers, Owner
from memory_ext.pool.segment_arena import ALLOC_SYMBOL, FREE_SYMBOL, SegmentArena, load_library
from memory_ext.vmm import private_dir
from memory_ext.weights import LayerPipeline, WeightStore
from support.fake_cuda import FakeCudaVmmBackend
from support.fake_cuda_driver import FakeDriver, FakeFault
from support.waiting import wait_until

G = 1 << 16


@pytest.fixture
def drv():
    driver = FakeDriver(min_granularity=G, budget_bytes=64 * G)
    yield driver
    assert set(driver.live().values()) == {0}, driver.live()
    assert driver.used == [0]


@pytest.fixture
def pool(drv):
    backend = FakeCudaVmmBackend(drv)
    p = ChunkPool(backend, 32)
    yield p
    p.check_invariants()
    p.close()
    backend.close()


def test_layered_kv_buffers_map_write_unmap(pool, drv):
    kv = LayeredKVBuffers(pool, [1024, 1024], num_rows=64 * 8, rows_multiple=1)
    assert kv.map_groups([0, 3]) == 2 and pool.usage()[Owner.KV] == 2 * kv.chunks_per_group
    views = [kv.view(i, torch.float16, (512,)) for i in range(2)]
    rows = kv.group_rows
    for i, v in enumerate(views):
        v[3 * rows : 4 * rows] = i + 1
    kv.map_groups([5])
    kv.unmap_groups([5])
    assert all(torch.all(v[3 * rows : 4 * rows] == i + 1) for i, v in enumerate(views))
    with pytest.raises(FakeFault):
        drv.check_access(views[0].data_ptr() + 5 * rows * 1024, 8)  # an unmapped group is a hole
    kv.check_invariants()
    del views
    kv.close()
    assert pool.usage()[Owner.KV] == 0


@pytest.fixture
def lib():
    return load_library()


def test_arena_segments_overflow_and_shrink(pool, drv, lib):
    alloc = lambda n: getattr(lib, ALLOC_SYMBOL)(n, 0, None) or 0
    free = lambda p, n: getattr(lib, FREE_SYMBOL)(p, n, 0, None)
    arena = SegmentArena(pool.backend, 8, **drv.arena_hooks())
    try:
        arena.grow(pool.acquire(Owner.ACTIVATION, 4))
        a, b = alloc(G), alloc(2 * G)
        assert arena.contains(a) and arena.contains(b)
        drv.check_access(b, 2 * G)  # the device may touch a segment: mapped, access set
        ctypes.memset(b, 0x5A, 2 * G)
        used = drv.used[0]
        big = alloc(4 * G)  # no room below the limit: cuMemAlloc
        assert big and not arena.contains(big) and drv.used[0] == used + 4 * G
        drv.check_access(big, 4 * G)
        assert arena.stats()["overflow_allocs"] == 1
        assert alloc(64 * G) == 0 and arena.stats()["failed_allocs"] == 1  # over the budget: OOM
        free(big, 4 * G)
        assert drv.used[0] == used and drv.live()["device_allocs"] == 0
        syncs = drv.calls["cuCtxSynchronize"]
        free(b, 2 * G)
        assert alloc(2 * G) == b and drv.calls["cuCtxSynchronize"] == syncs + 1  # reuse after a sync
        assert arena.pinned_chunks() == 3
        pool.release(Owner.ACTIVATION, arena.shrink(4))  # one idle chunk above the live segments
        assert arena.mapped_chunks == 3
        free(a, G)
        free(b, 2 * G)
        pool.release(Owner.ACTIVATION, arena.shrink(3))
        assert arena.mapped_chunks == 0 and drv.live()["mappings"] == 0
    finally:
        pool.release(Owner.ACTIVATION, arena.close())


def test_weight_store_streams_layers_with_identical_outputs(pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(4, 64)
    with torch.no_grad():
        expect = model(x)
    store = WeightStore(pool)
    for i, layer in enumerate(model):
        params = list(layer.parameters())
        for p, v in zip(params, store.add_layer(i, [p.data for p in params])):
            p.data = v
    pipe = LayerPipeline(store, list(range(4)))
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda m, a, i=i: pipe.before_layer(i))
        layer.register_forward_hook(lambda m, a, o, i=i: pipe.after_layer(i))
    pipe.request([1, 3], 1)
    for _ in range(3):
        pipe.begin_forward()
        with torch.no_grad():
            got = model(x)
        pipe.end_forward()
        assert torch.equal(got, expect)
    assert store.lent_chunks() > 0
    store.check_invariants()
    store.close()
    assert pool.usage()[Owner.WEIGHTS] == 0


LAYOUT = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32, dtype="float16", model="m")


def test_peer_link_round_trip_and_reclaim(drv, tmp_path):
    donor_vmm, borrower_vmm = FakeCudaVmmBackend(drv), FakeCudaVmmBackend(drv)
    pool = ChunkPool(donor_vmm, capacity_chunks=16)
    path = private_dir(tmp_path / "s") + "/donor.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=8 * G, name="d")
    tier = PeerKVTier(LAYOUT)
    try:
        link = tier.connect(path, "b", borrower_vmm)
        lease = donor.wait_for_lease()
        donor.grow(lease, 2)
        wait_until(lambda: link.num_blocks == 16, 10)
        imported = drv.calls["cuMemImportFromShareableHandle"]
        assert imported == 2 and drv.calls["cuMemExportToShareableHandle"] == 2
        g = torch.Generator().manual_seed(0)
        tokens = list(range(16 * 4))
        pages = [torch.randn(LAYOUT.block_shape, generator=g).to(torch.float16) for _ in range(4)]
        assert tier.store(tokens, pages) == 4
        out = [torch.empty_like(p) for p in pages]
        assert tier.load(tokens, out) == 4 and all(torch.equal(a, b) for a, b in zip(pages, out))
        wait_until(lambda: all(le["fences"] == 0 for le in donor.status()["leases"]), 10)
        assert len(donor.reclaim(lease, 2)) == 2
        # the link lowers its blocks first, then unmaps the chunks once no copy is in flight (link.py)
        wait_until(lambda: link.num_blocks == 0 and borrower_vmm.live_chunks() == [], 10)
        assert borrower_vmm.live_chunks() == [] and pool.usage()[Owner.PEER_DONATION] == 0
    finally:
        tier.close()
        donor.close()
        wait_until(lambda: borrower_vmm.ranges() == [], 10)
        pool.close()
        donor_vmm.close()
        borrower_vmm.close()
