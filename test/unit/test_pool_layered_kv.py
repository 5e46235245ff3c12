"""LayeredKVBuffers (group-granular backing of per-layer buffers) and the lent-chunk pool."""

import os
import tempfile
import threading
import time

import pytest
import torch

from memory_ext.pool import Arbiter, ChunkPool, LayeredKVBuffers, LentPool, Owner, PoolExhausted
from memory_ext.pool.layered_kv import group_rows_for
from memory_ext.vmm import host_backend

CHUNK = 4096


@pytest.fixture
def pool():
    backend = host_backend(CHUNK)
    p = ChunkPool(backend, 64)
    yield p
    backend.close()


@pytest.mark.parametrize(
    "row_bytes, multiple, expect",
    [
        ([64, 64], 1, 64),
        ([384], 1, 32),
        ([384, 256], 1, 32),
        ([64], 128, 128),
        ([8192], 1, 1),
        ([6000], 1, 256),
    ],
)
def test_group_rows_fill_whole_chunks(row_bytes, multiple, expect):
    rows = group_rows_for(row_bytes, CHUNK, multiple)
    assert rows == expect
    assert rows % multiple == 0 and all(rows * rb % CHUNK == 0 for rb in row_bytes)


def test_map_groups_backs_every_buffer_and_views_keep_data(pool):
    kv = LayeredKVBuffers(pool, [64, 64, 128], num_rows=640, rows_multiple=1)
    assert kv.group_rows == 64 and kv.num_groups == 10 and kv.chunks_per_group == 1 + 1 + 2
    assert kv.map_groups([0, 3]) == 2 and kv.map_groups([3]) == 0
    views = [kv.view(0, torch.float16, (32,)), kv.view(1, torch.float16, (32,)), kv.view(2, torch.float32, (32,))]
    for i, v in enumerate(views):
        v[3 * 64 : 4 * 64] = i + 1
        v[0:64] = -(i + 1)
    assert pool.usage()[Owner.KV] == 8
    kv.map_groups([5])  # other groups' churn never moves live rows
    kv.unmap_groups([5])
    for i, v in enumerate(views):
        assert torch.all(v[3 * 64 : 4 * 64] == i + 1) and torch.all(v[0:64] == -(i + 1))
    kv.check_invariants()
    assert kv.unmap_groups([0, 3]) == 2 and pool.usage()[Owner.KV] == 0 and kv.num_mapped == 0
    with pytest.raises(ValueError, match="not mapped"):
        kv.unmap_groups([3])
    kv.close()


def test_map_groups_is_all_or_nothing_across_buffers(pool):
    kv = LayeredKVBuffers(pool, [64, 64], num_rows=64 * 40)
    kv.map_groups(range(30))  # 60 of 64 chunks
    with pytest.raises(PoolExhausted):
        kv.map_groups([30, 31, 32])  # needs 6
    assert kv.num_mapped == 30 and pool.usage()[Owner.KV] == 60
    kv.check_invariants()
    kv.close()
    assert pool.usage()[Owner.KV] == 0


@pytest.mark.parametrize(
    "bad, err",
    [
        (dict(row_bytes=[]), ValueError),
        (dict(row_bytes=[0]), ValueError),
        (dict(num_rows=0), ValueError),
        (dict(rows_multiple=0), ValueError),
        (dict(owner=Owner.FREE), ValueError),
    ],
)
def test_bad_arguments_are_refused(pool, bad, err):
    args = dict(row_bytes=[64], num_rows=64, rows_multiple=1)
    args.update(bad)
    with pytest.raises(err):
        LayeredKVBuffers(pool, **args)


def test_pool_that_does_not_create_only_holds_adopted_chunks():
    backend = host_backend(CHUNK)
    pool = ChunkPool(backend, 8, create_chunks=False)
    assert pool.available() == 0
    with pytest.raises(PoolExhausted):
        pool.acquire(Owner.KV, 1)
    chunks = [backend.create_chunk() for _ in range(3)]
    pool.adopt(chunks)
    assert pool.available() == 3 and pool.usage()[Owner.FREE] == 3
    with pytest.raises(Exception, match="already in this pool"):
        pool.adopt(chunks[:1])
    got = pool.acquire(Owner.KV, 2)
    pool.check_invariants()
    out = pool.disown()
    assert len(out) == 1 and pool.available() == 0
    pool.release(Owner.KV, got)
    assert len(pool.disown(5)) == 2 and pool.chunks_created == 0
    pool.check_invariants()
    for c in chunks:
        backend.destroy_chunk(c)
    backend.close()


def test_lent_pool_borrows_gives_back_and_answers_reclaims():
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "p.sock")
    arb = Arbiter(sock, host_backend(CHUNK), 10, reclaim_timeout=1.0).start()
    a = LentPool(sock, "a", host_backend(CHUNK))
    b = LentPool(sock, "b", host_backend(CHUNK))
    try:
        assert b.available_now() == 10
        assert a.borrow(8) == 8 and a.pool.available() == 8 and b.available_now() == 2
        held = a.pool.acquire(Owner.KV, 6)  # 6 in use, 2 FREE
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("b", b.borrow(4)))
        t.start()  # the arbiter reclaims 2 from a; a's engine answers on its own thread:
        deadline = time.time() + 5
        while not a.reclaim_requests and time.time() < deadline:
            time.sleep(0.01)
        assert a.pool.available() == 2  # nothing was taken behind the engine's back
        assert a.take_pending_reclaim() == 2 and a.give_back() == 2
        t.join(5)
        assert got["b"] == 4
        assert b.borrow(2) == 0 and b.denied_total == 1  # a's 6 are in use: refused, not hung
        assert a.take_pending_reclaim() == 2  # left for the engine, which frees memory first
        a.pool.release(Owner.KV, held[:2])
        assert a.give_back(2) == 2 and b.borrow(2) == 2
        st = arb.status()
        assert sum(c["held"] for c in st["clients"]) == st["created"] - st["free"] == 10
        arb.check_invariants()
    finally:
        a.pool.release(Owner.KV, held[2:])
        a.close()
        b.close()
        arb.stop()


def test_lent_pool_never_blocks_on_a_peer_and_keeps_a_late_grant():
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "p.sock")
    arb = Arbiter(sock, host_backend(CHUNK), 8, reclaim_timeout=3.0).start()
    a = LentPool(sock, "a", host_backend(CHUNK))
    b = LentPool(sock, "b", host_backend(CHUNK))
    try:
        assert a.borrow(8) == 8
        t0 = time.monotonic()
        assert b.borrow(4, wait=0.05) == 0  # needs a reclaim from a: b does not wait for it
        assert time.monotonic() - t0 < 1.0 and b.status()["outstanding"] == 1
        assert b.borrow(1, wait=0.05) == 0  # one request in flight at a time
        deadline = time.time() + 5
        while not a.take_pending_reclaim() and time.time() < deadline:
            time.sleep(0.01)
        assert a.give_back(4) == 4  # a's engine answers on its own time
        while b.pool.available() < 4 and time.time() < deadline:
            time.sleep(0.01)
        assert b.pool.available() == 4 and b.late_grants == 1 and b.status()["outstanding"] == 0
        st = arb.status()
        assert sum(c["held"] for c in st["clients"]) == 8
        arb.check_invariants()
    finally:
        a.close()
        b.close()
        arb.stop()
