"""``park_kv`` copies a request's committed KV (whole pages) to the host buffer: the rows it keeps
are the pool's rows at the request's token slots, in every K and V buffer, and they are a copy
(a later write to the pool, as when the slots are reused, leaves them unchanged)."""

from __future__ import annotations

import types

import torch

from sglang_memx.config import MemxConfig
from sglang_memx.elastic.host_buffer import build_host_buffer, park_kv, rows_on_host
from support.fakes import FakeReq

LAYERS, SLOTS, HEADS, DIM = 3, 32, 2, 4


def _allocator(page_size=1):
    k = [torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)]
    pool = types.SimpleNamespace(k_buffer=k, v_buffer=v)
    return types.SimpleNamespace(get_kvcache=lambda: pool, page_size=page_size), k + v


def test_parked_rows_are_the_request_slots_and_a_copy_of_the_pool():
    allocator, buffers = _allocator()
    host = build_host_buffer(MemxConfig(elastic_kv=True, host_buffer_gb=0.001), 4096)
    req = FakeReq(rid="a", prompt=5, outputs=1)
    slots = torch.tensor([7, 3, 20, 11, 0, 30], dtype=torch.int32)
    rows = torch.zeros(2, SLOTS, dtype=torch.int32)
    rows[0, :6] = slots
    want = [b[slots.long()].clone() for b in buffers]
    assert park_kv(host, req, rows, allocator)
    for b in buffers:
        b.fill_(0.0)  # the slots are reused once the request's KV is freed
    entry = host.buffer.take("a")
    assert entry is not None and entry.tokens == [0, 1, 2, 3, 4, 0]
    assert len(entry.rows) == 2 * LAYERS
    for got, expected in zip(entry.rows, want):
        assert torch.equal(got, expected)


def test_only_whole_pages_are_parked_and_nothing_without_room():
    allocator, _ = _allocator(page_size=4)
    host = build_host_buffer(MemxConfig(elastic_kv=True, host_buffer_gb=0.001), 4096)
    rows = torch.arange(2 * SLOTS, dtype=torch.int32).reshape(2, SLOTS) % SLOTS
    assert park_kv(host, FakeReq(rid="b", prompt=6, outputs=1), rows, allocator)
    assert len(host.buffer.take("b").tokens) == 4  # 7 committed tokens: one whole page of 4
    assert not park_kv(host, FakeReq(rid="c", prompt=3), rows, allocator)  # less than a page
    tiny = build_host_buffer(MemxConfig(elastic_kv=True, host_buffer_gb=1e-9), 4096)
    assert not park_kv(tiny, FakeReq(rid="d", prompt=8), rows, allocator)
    assert tiny.buffer.stats["refused"] == 1


def test_rows_from_a_host_pool_are_a_copy_in_pageable_memory():
    """On the host no pinning (nothing copies them to a device) and the indexing is the only copy."""
    pool = torch.randn(SLOTS, HEADS, DIM)
    idx = torch.tensor([4, 9, 2])
    rows = rows_on_host(pool, idx)
    assert torch.equal(rows, pool[idx]) and not rows.is_pinned()
    assert rows.data_ptr() != pool.data_ptr()
    pool.zero_()
    assert rows.abs().sum() > 0
