"""The activation arena behind torch's pluggable allocator / MemPool on a real GPU: tensors made
inside ``use()`` live in pool chunks, results equal torch's own allocator, what does not fit
overflows to cuMemAlloc, and ``release_cached`` + ``shrink`` return every chunk."""

import pytest
import torch

from memory_ext.policy.activation import ActivationProfile
from memory_ext.pool import ChunkPool, Owner
from memory_ext.pool.activation_meter import PeakMeter
from memory_ext.pool.segment_arena import ArenaMemPool, SegmentArena, cuda_driver_hooks

pytestmark = pytest.mark.gpu


@pytest.fixture
def setup():
    from memory_ext.vmm import cuda_backend

    backend = cuda_backend(0)
    pool = ChunkPool(backend, 64)
    arena = SegmentArena(backend, 64, **cuda_driver_hooks())
    mempool = ArenaMemPool()
    yield backend, pool, arena, mempool
    torch.cuda.synchronize()
    mempool.release_cached()
    pool.release(Owner.ACTIVATION, arena.close())
    backend.close()


def _mlp(x, w1, w2):
    return torch.nn.functional.gelu(x @ w1) @ w2


def test_forward_tensors_come_from_pool_chunks_and_match_torch(setup):
    backend, pool, arena, mempool = setup
    arena.grow(pool.acquire(Owner.ACTIVATION, 32))  # 64 MiB at 2 MiB chunks
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1024, device="cuda", generator=g)
    w1 = torch.randn(1024, 4096, device="cuda", generator=g) / 32
    w2 = torch.randn(4096, 1024, device="cuda", generator=g) / 64
    want = _mlp(x, w1, w2)
    with mempool.use():
        with PeakMeter("cuda") as meter:
            inner = torch.empty(256, 4096, device="cuda")
            got = _mlp(x, w1, w2)
    assert arena.contains(inner.data_ptr()) and arena.contains(got.data_ptr())
    torch.testing.assert_close(got, want)
    st = arena.stats()
    assert st["allocs"] >= 1 and st["overflow_allocs"] == 0 and st["live_bytes"] > 0
    assert meter.peak_bytes >= inner.numel() * 4  # the CUDA meter sees MemPool allocations
    del inner, got
    torch.cuda.synchronize()
    got_back = arena.shrink(32, mempool.release_cached)
    assert len(got_back) == 32 and arena.stats()["live_segments"] == 0 and mempool.rotations == 1
    pool.release(Owner.ACTIVATION, got_back)


def test_what_does_not_fit_overflows_to_device_memory_and_is_freed(setup):
    backend, pool, arena, mempool = setup
    arena.grow(pool.acquire(Owner.ACTIVATION, 2))  # 4 MiB mapped
    with mempool.use():
        small = torch.ones(1024, device="cuda")
        big = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB: no room below the limit
    assert arena.contains(small.data_ptr()) and not arena.contains(big.data_ptr())
    assert int(big.sum()) == 64 << 20
    assert arena.stats()["overflow_allocs"] >= 1
    del small, big
    torch.cuda.synchronize()
    mempool.release_cached()
    st = arena.stats()
    assert st["overflow_live_bytes"] == 0 and st["live_segments"] == 0


def test_shrink_keeps_a_live_tensor_mapped(setup):
    backend, pool, arena, mempool = setup
    arena.grow(pool.acquire(Owner.ACTIVATION, 8))
    with mempool.use():
        keep = torch.full((1 << 20,), 3.0, device="cuda")  # 4 MiB, the lowest segment
    got = arena.shrink(8, mempool.release_cached)
    assert arena.mapped_chunks == arena.pinned_chunks() >= 2 and len(got) == 8 - arena.mapped_chunks
    pool.release(Owner.ACTIVATION, got)
    assert float(keep.sum()) == 3.0 * (1 << 20)  # still readable: nothing under it was unmapped
    del keep


def test_balloon_reserve_and_lend_on_cuda(setup):
    from memory_ext.pool.activation_balloon import ActivationBalloon

    backend, pool, arena, mempool = setup
    balloon = ActivationBalloon(pool, ActivationProfile(per_token_bytes=64 << 10), arena=arena, mempool=mempool)
    assert balloon.reserve(256, 1, lambda: 0, lambda n: 0)  # 16 MiB -> 8 chunks mapped
    assert arena.mapped_chunks == balloon.held == 8
    with mempool.use():
        t = torch.randn(1 << 20, device="cuda") * 2
    assert arena.contains(t.data_ptr())
    del t
    balloon.end_iteration()
    assert balloon.lend_to_kv(8) == 8 and arena.mapped_chunks == 0
    assert pool.usage()[Owner.ACTIVATION] == 0
