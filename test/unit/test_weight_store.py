"""WeightStore / LayerPipeline on the host backend: lending, streaming, exact outputs."""

from __future__ import annotations

import pytest
import torch

from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import host_backend
from memory_ext.weights import LayerPipeline, NotResident, WeightStore

G = 1 << 16


def _model(layers=6, width=96, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _pooled(model, capacity=64, strict=False):
    pool = ChunkPool(host_backend(G), capacity)
    store = WeightStore(pool, strict=strict)
    for i, layer in enumerate(model):
        params = list(layer.parameters())
        for p, v in zip(params, store.add_layer(i, [p.data for p in params])):
            p.data = v
    pipe = LayerPipeline(store, list(range(len(model))))
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda m, a, i=i: pipe.before_layer(i))
        layer.register_forward_hook(lambda m, a, o, i=i: pipe.after_layer(i))
    return pool, store, pipe


def _run(model, pipe, x):
    pipe.begin_forward()
    with torch.no_grad():
        y = model(x)
    pipe.end_forward()
    return y


@pytest.mark.parametrize("streamed,slots", [((), 0), ((1, 4), 1), ((0, 2, 4), 2), (tuple(range(6)), 2)])
def test_outputs_identical_and_bytes_lent(streamed, slots):
    ref = _model()
    x = torch.randn(4, 96)
    with torch.no_grad():
        expect = ref(x)
    model = _model()
    pool, store, pipe = _pooled(model)
    total = store.total_chunks()
    assert pool.usage()[Owner.WEIGHTS] == total
    pipe.request(streamed, slots)
    for _ in range(3):  # several forwards: slots rotate, the next forward's layers prefetch
        assert torch.equal(_run(model, pipe, x), expect)
    lent = sum(store.layer_chunks(k) for k in streamed) - min(slots, len(streamed)) * store.slot_chunks
    assert store.lent_chunks() == lent
    assert pool.usage()[Owner.WEIGHTS] == total - lent
    assert pool.usage()[Owner.FREE] == lent  # the lent chunks are the pool's at once
    store.check_invariants()
    assert store.status()["fetches"] >= (3 * len(streamed) if streamed else 0)


def test_restore_brings_layers_back_exactly():
    model, ref = _model(), _model()
    x = torch.randn(2, 96)
    with torch.no_grad():
        expect = ref(x)
    pool, store, pipe = _pooled(model)
    pipe.request((0, 1, 2, 3, 4), 1)
    _run(model, pipe, x)
    kv = pool.acquire(Owner.KV, pool.available())  # the KV side maps everything lent
    pipe.request((0, 1), 1)
    change = pipe.apply_pending()
    assert change["not_restored"] == [2, 3, 4]  # the pool cannot back them: they stay streamed
    assert torch.equal(_run(model, pipe, x), expect)  # retried at the next forward, still exact
    pool.release(Owner.KV, kv)  # relief: KV gives the memory back
    assert torch.equal(_run(model, pipe, x), expect)
    assert store.streamed() == [0, 1] and store.status()["restores"] == 3
    store.check_invariants()


def test_strict_store_refuses_unfetched_layer():
    model = _model()
    pool, store, pipe = _pooled(model, strict=True)
    pipe.request((3,), 1)
    pipe.apply_pending()
    store.evict(3)
    with pytest.raises(NotResident, match="layer 3"):
        store.ensure(3)


def test_pool_too_small_for_a_layer_changes_nothing():
    pool = ChunkPool(host_backend(G), 1)
    store = WeightStore(pool)
    with pytest.raises(Exception, match="exhausted"):
        store.add_layer(0, [torch.zeros(G)])  # 4 chunks of float32
    assert store.keys == [] and pool.usage()[Owner.WEIGHTS] == 0


def test_close_returns_every_chunk():
    model = _model()
    pool, store, pipe = _pooled(model)
    pipe.request((1, 3, 5), 2)
    _run(model, pipe, torch.randn(1, 96))
    store.close()
    assert pool.usage()[Owner.WEIGHTS] == 0
    pool.check_invariants()


def test_reserved_chunks_back_the_next_restore_and_nothing_else():
    model = _model()
    pool, store, pipe = _pooled(model)
    pipe.request((0, 1, 2, 3), 1)
    pipe.apply_pending()
    store.reserve(store.layer_chunks(2))  # the scheduler's thread takes the memory now
    kv = pool.acquire(Owner.KV, pool.available())  # the rest is the KV side's
    pipe.request((0, 1, 3), 1)
    assert pipe.apply_pending()["restored"] == [2]  # later, on the forward's thread
    assert store.reserved_chunks == 0
    store.check_invariants()
    pool.release(Owner.KV, kv)
    store.reserve(3)
    store.close()  # unused reservations go back
    assert pool.usage()[Owner.WEIGHTS] == 0
