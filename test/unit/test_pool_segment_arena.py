"""memory_ext.pool.segment_arena on the host backend: the C entry points torch's pluggable
allocator calls (alloc/free by pointer and size), placement below the mapped limit, overflow,
and shrink that never unmaps under a live segment."""

import ctypes
import os
import threading

import pytest

from memory_ext.pool import ChunkPool, Owner
from memory_ext.pool.segment_arena import ALLOC_SYMBOL, FREE_SYMBOL, SegmentArena, load_library
from memory_ext.vmm import host_backend

G = 4 * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def pool():
    backend = host_backend(G)
    p = ChunkPool(backend, 32)
    yield p
    backend.close()


@pytest.fixture
def open_arena(pool):
    """Makes SegmentArenas on ``pool``'s backend; each is closed, its chunks back in the pool, after the test."""
    made = []

    def make(capacity_chunks, **kwargs):
        made.append(SegmentArena(pool.backend, capacity_chunks, **kwargs))
        return made[-1]

    yield make
    for arena in made:
        pool.release(Owner.ACTIVATION, arena.close())


@pytest.fixture
def lib():
    return load_library()


def alloc(lib, size):
    """What torch's CUDAPluggableAllocator does for a new segment: alloc(size, device, stream)."""
    return getattr(lib, ALLOC_SYMBOL)(size, 0, None) or 0


def free(lib, ptr, size):
    getattr(lib, FREE_SYMBOL)(ptr, size, 0, None)


def grown(pool, n, arena):
    arena.grow(pool.acquire(Owner.ACTIVATION, n))


def test_segments_land_in_mapped_chunks_and_bytes_are_real(pool, lib, open_arena):
    arena = open_arena(8)
    grown(pool, 3, arena)
    a = alloc(lib, G)
    b = alloc(lib, G + 1)  # rounded to the 512-byte alignment, placed after a
    assert arena.contains(a) and arena.contains(b)
    assert a == arena.vrange.base and b == a + G
    ctypes.memset(b, 0x5A, G + 1)  # writable memory: the mapped chunks
    assert ctypes.string_at(b + G, 1) == b"\x5a"
    assert alloc(lib, 2 * G) == 0  # 3 chunks mapped, G + 1 + 512 rounding used: no room
    st = arena.stats()
    assert (st["allocs"], st["live_segments"], st["failed_allocs"]) == (2, 2, 1)
    free(lib, a, G)
    free(lib, b, G + 1)
    assert arena.stats()["live_bytes"] == 0 and arena.stats()["peak_bytes"] == G + G + 512


def test_best_fit_prefers_the_smallest_hole(pool, lib, open_arena):
    arena = open_arena(8)
    grown(pool, 8, arena)
    base = arena.vrange.base
    a, b, c, d = (alloc(lib, n * G) for n in (2, 1, 1, 3))
    free(lib, a, 2 * G)  # hole of 2 at 0
    free(lib, c, G)  # hole of 1 at 3
    e = alloc(lib, G)
    assert e == base + 3 * G  # the 1-chunk hole, not the first one that fits
    f = alloc(lib, 2 * G)
    assert f == base
    for p, n in ((b, 1), (d, 3), (e, 1), (f, 2)):
        free(lib, p, n * G)
    assert arena.stats()["live_segments"] == 0


def test_shrink_never_unmaps_under_a_live_segment(pool, lib, open_arena):
    arena = open_arena(8)
    grown(pool, 6, arena)
    low = alloc(lib, G)
    high = alloc(lib, 3 * G)  # chunks 1..3
    assert arena.pinned_chunks() == 4
    assert len(arena.shrink(6)) == 2 and arena.mapped_chunks == 4  # only chunks 4, 5 were idle
    assert arena.shrink(1) == []
    released = []
    got = arena.shrink(3, release_cached=lambda: (free(lib, high, 3 * G), released.append(1)))
    assert released == [1] and len(got) == 3 and arena.mapped_chunks == 1
    pool.release(Owner.ACTIVATION, got)
    assert alloc(lib, 2 * G) == 0  # nothing above the limit is handed out
    ctypes.memset(low, 1, G)  # the chunk under the live segment is still mapped
    free(lib, low, G)
    pool.check_invariants()


def test_overflow_allocator_serves_what_does_not_fit_and_gets_it_back(pool, lib, open_arena):
    held = {}
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
    FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)
    SYNC = ctypes.CFUNCTYPE(ctypes.c_int)
    syncs = []

    @ALLOC
    def fake_alloc(ptr, size):  # plays cuMemAlloc_v2
        buf = ctypes.create_string_buffer(size)
        held[ctypes.addressof(buf)] = buf
        ptr[0] = ctypes.addressof(buf)
        return 0

    @FREE
    def fake_free(ptr):  # plays cuMemFree_v2
        held.pop(ptr)
        return 0

    @SYNC
    def fake_sync():  # plays cuCtxSynchronize
        syncs.append(1)
        return 0

    addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
    arena = open_arena(4, overflow_alloc=addr(fake_alloc), overflow_free=addr(fake_free), sync=addr(fake_sync))
    grown(pool, 1, arena)
    a = alloc(lib, G)
    big = alloc(lib, 2 * G)
    assert arena.contains(a) and not arena.contains(big) and big in held
    st = arena.stats()
    assert (st["overflow_allocs"], st["overflow_live_bytes"]) == (1, 2 * G)
    with pytest.raises(RuntimeError, match="still live"):
        arena.close()
    free(lib, big, 2 * G)
    assert held == {} and arena.stats()["overflow_live_bytes"] == 0
    free(lib, a, G)
    assert syncs == []
    again = alloc(lib, G)  # reusing freed memory waits for queued work first, as cudaFree would
    assert again == a and syncs == [1]
    free(lib, again, G)
    free(lib, 12345, 64)  # a pointer nobody handed out: counted, ignored
    assert arena.stats()["bad_frees"] == 1


def test_one_arena_per_process_and_bad_arguments(pool):
    with pytest.raises(ValueError, match="capacity_chunks"):
        SegmentArena(pool.backend, 0)
    with pytest.raises(ValueError, match="overflow_alloc and overflow_free"):
        SegmentArena(pool.backend, 2, overflow_alloc=1)
    arena = SegmentArena(pool.backend, 2)
    try:
        with pytest.raises(RuntimeError, match="already open"):
            SegmentArena(pool.backend, 2)
        with pytest.raises(ValueError, match="capacity"):
            grown(pool, 3, arena)
        assert pool.usage()[Owner.ACTIVATION] == 3  # the caller still holds what grow refused
        pool.release(Owner.ACTIVATION, pool.chunks_of(Owner.ACTIVATION))
    finally:
        arena.close()
    SegmentArena(pool.backend, 2).close()  # closed: a new one may open


def test_concurrent_segment_traffic_keeps_segments_disjoint(pool, lib, open_arena):
    arena = open_arena(16)
    grown(pool, 16, arena)
    seen, errors = [], []

    def worker(k):
        mine = []
        for i in range(300):
            size = 512 * (1 + (i * 7 + k) % 40)
            p = alloc(lib, size)
            if p:
                ctypes.memset(p, k, size)
                mine.append((p, size, k))
            if len(mine) > 4:
                q, n, tag = mine.pop(0)
                if ctypes.string_at(q, n) != bytes([tag]) * n:
                    errors.append(q)  # someone else wrote into my segment
                free(lib, q, n)
        for q, n, _ in mine:
            free(lib, q, n)
        seen.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == [1, 2, 3, 4] and errors == []
    st = arena.stats()
    assert st["live_segments"] == 0 and st["allocs"] == st["frees"] and st["bad_frees"] == 0


def test_shrink_synchronises_once_after_torch_hands_segments_back(pool, lib, open_arena):
    syncs = []
    SYNC = ctypes.CFUNCTYPE(ctypes.c_int)

    @SYNC
    def fake_sync():  # plays cuCtxSynchronize
        syncs.append(1)
        return 0

    arena = open_arena(4, sync=ctypes.cast(fake_sync, ctypes.c_void_p).value)
    grown(pool, 4, arena)
    a = alloc(lib, G)
    b = alloc(lib, 3 * G)
    got = arena.shrink(2, release_cached=lambda: free(lib, b, 3 * G))
    assert len(got) == 2 and syncs == [1]  # synchronised here, between forwards
    pool.release(Owner.ACTIVATION, got)
    c = alloc(lib, G)  # so this alloc (inside a forward) does not
    assert c == a + G and syncs == [1]
    assert arena.shrink(1, release_cached=lambda: None) == [] and syncs == [1]  # nothing freed
    free(lib, a, G)
    free(lib, c, G)


def test_torch_pluggable_allocator_loads_the_arena_with_the_signatures_it_calls():
    """The CUDA path's contract with torch, checked without a GPU: torch builds its pluggable
    allocator from our library's two symbols, and its header declares the signatures
    ``segment_arena.c`` implements (size, device, stream) / (ptr, size, device, stream)."""
    import re
    from pathlib import Path

    import torch

    from memory_ext.pool.segment_arena import library_path

    header = Path(torch.__file__).parent / "include/torch/csrc/cuda/CUDAPluggableAllocator.h"
    text = re.sub(r"\s+", "", header.read_text())
    assert "std::function<void*(size_t,int,cudaStream_t)>alloc_fn" in text
    assert "std::function<void(void*,size_t,int,cudaStream_t)>free_fn" in text
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library_path()), ALLOC_SYMBOL, FREE_SYMBOL)
    assert allocator.allocator() is not None
    assert callable(torch.cuda.MemPool) and callable(torch.cuda.use_mem_pool)


def test_cache_release_is_rate_limited(pool, lib, open_arena):
    arena = open_arena(4, release_interval_s=3600)
    grown(pool, 4, arena)
    top = alloc(lib, 4 * G)  # a tensor that lives on: emptying the cache cannot help
    calls = []
    assert arena.shrink(1, release_cached=lambda: calls.append(1)) == []
    assert arena.shrink(1, release_cached=lambda: calls.append(1)) == []
    assert calls == [1] and arena.releases == 1
    free(lib, top, 4 * G)
