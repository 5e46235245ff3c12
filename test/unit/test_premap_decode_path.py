"""Steady decode with elastic KV and activation ballooning: the tick's premap and the decode
step's activation reserve must not undo each other (issue 17 item 4: no driver call on the
decode hot path).

Drives the server's own objects the way a scheduler iteration does, with no server: memx's
``tick`` (the premap among its steps) on a fake scheduler, then a decode step's path: the
activation reserve and capacity check (``decode_step_fits``, upstream's
``check_decode_capacity``), the KV allocation through memx's alloc hook over upstream's real
``TokenToKVPoolAllocator``, and ``note_forward``. Every map and unmap of the step's path is
counted by ElasticKV (``decode_map_calls``, ``decode_unmap_calls``); the tick's are not.
"""

import types

import torch

from memory_ext.policy.activation import ActivationProfile
from memory_ext.pool import ChunkPool, LayeredKVBuffers, Owner
from memory_ext.pool.activation_balloon import ActivationBalloon
from memory_ext.vmm import host_backend
from sglang_memx.coordinator import device
from sglang_memx.coordinator.tick import tick
from sglang_memx.elastic.capacity import decode_step_fits
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.hooks.kv_cache import around_alloc
from sglang_memx.upstream import kv as up_kv

CHUNK = 4096
ROW = 64  # bytes per token row per buffer: 64 rows per chunk, a group is 64 tokens in 4 chunks
REQUESTS = 4


def _server(free_chunks_beyond_groups: int, groups: int = 6, per_token_bytes: int = CHUNK):
    """A server whose pool backs group 0, ``groups`` more KV groups, one decode step's activation
    (``REQUESTS`` chunks) and ``free_chunks_beyond_groups`` chunks more."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    num_tokens = 1024
    capacity = 4 * (1 + groups) + REQUESTS * per_token_bytes // CHUNK + free_chunks_beyond_groups
    pool = ChunkPool(host_backend(CHUNK), capacity)
    kv = ElasticKV(LayeredKVBuffers(pool, [ROW] * 4, num_tokens + 1, 1), 1, num_tokens, spare_groups=1)
    kv.activation = ActivationBalloon(pool, ActivationProfile(per_token_bytes=per_token_bytes))
    kv.lengths_capped = True  # the length cap reads upstream's limits, which this fake has not
    alloc = TokenToKVPoolAllocator(num_tokens, torch.bfloat16, "cpu", types.SimpleNamespace(), need_sort=True)
    device.attach(alloc, kv)
    kv.restrict_free_list(alloc)
    reqs = [types.SimpleNamespace(finished=lambda: False) for _ in range(REQUESTS)]
    scheduler = types.SimpleNamespace(
        token_to_kv_pool_allocator=alloc,
        tree_cache=None,
        waiting_queue=[],  # nothing waits: the premap may use idle activation chunks
        running_batch=types.SimpleNamespace(reqs=reqs, batch_is_full=False),
        last_batch=None,
        chunked_req=None,
        chunked_prefill_size=64,
    )
    return kv, alloc, pool, scheduler


def _decode_until_full(kv, alloc, scheduler, max_steps: int = 1000) -> int:
    """Scheduler iterations of steady decode (one new token per request per step) until the
    step no longer fits (upstream would retract); return the steps run."""
    n = REQUESTS
    for step in range(max_steps):
        tick(scheduler)  # before upstream picks the batch: deflation, premap
        fits = decode_step_fits(
            kv,
            alloc,
            lambda: up_kv.free_page_count(alloc) + kv.growable_pages() >= n,
            n,
            None,
            n,
            activation=device.of(alloc).activation_side(),
            lent=None,
        )
        if not fits:
            return step
        got = around_alloc(type(alloc).alloc, alloc, n)  # upstream's decode allocation, memx's hook
        assert got is not None and len(got) == n
        kv.note_forward(decode=True)  # the forward runs now: its activation is live until the next tick
        kv.check(alloc)
        assert kv.activation.live <= kv.activation.held
    return max_steps


def test_without_the_kept_activation_the_premap_and_the_decode_reserve_ping_pong(monkeypatch):
    """Today's defect, reproduced: a premap that may lend all idle activation (no keep) maps a
    group the next decode step's reserve unmaps again, on that step's path, step after step."""
    from sglang_memx.elastic import demand

    monkeypatch.setattr(demand, "decode_activation_chunks", lambda balloon, scheduler: 0)
    kv, alloc, pool, scheduler = _server(free_chunks_beyond_groups=2)
    steps = _decode_until_full(kv, alloc, scheduler)
    st = device.of(alloc).status()
    assert steps >= (63 + 6 * 64) // REQUESTS - 1, steps
    assert st["decode_unmap_calls"] > 1 and st["decode_steps_with_unmap"] > 1, st
    assert st["map_calls"]["premap"] >= 6 + st["decode_unmap_calls"], st["map_calls"]  # each one mapped again
    assert st["activation"]["chunks_from_kv"] > 0 and st["activation"]["chunks_lent_to_kv"] > 0


def test_premap_leaves_the_decode_steps_activation_and_the_decode_path_makes_no_driver_call():
    kv, alloc, pool, scheduler = _server(free_chunks_beyond_groups=2)
    steps = _decode_until_full(kv, alloc, scheduler)
    st = device.of(alloc).status()
    # the KV the requests hold grew over every group the pool could back next to one step's activation
    assert steps >= (63 + 6 * 64) // REQUESTS - 1, steps
    assert st["decode_steps"] == steps
    assert st["map_calls"]["premap"] >= 6 and st["map_calls"]["request"] == 0, st["map_calls"]
    assert st["decode_map_calls"] == 0 and st["decode_unmap_calls"] == 0, {
        k: st[k] for k in ("decode_map_calls", "decode_unmap_calls", "unmap_calls", "map_calls")
    }
    assert st["unmap_calls"]["request"] == 0
    act = st["activation"]
    assert act["chunks_from_kv"] == 0 and act["chunks_lent_to_kv"] == 0  # no ping-pong either way
    # when it stops, the pool is full: KV and the step's activation hold everything
    assert pool.usage()[Owner.FREE] < kv.buffers.chunks_per_group
    assert pool.usage()[Owner.ACTIVATION] >= kv.activation.need_chunks(REQUESTS, REQUESTS)


def test_decode_path_unmaps_are_counted_apart_from_the_ticks():
    """An unmap made by an activation reserve on the decode step's path counts there; the
    tick's routine deflation does not."""
    from sglang_memx.elastic.ballooning import reserve_decode_step

    kv, alloc, pool, scheduler = _server(free_chunks_beyond_groups=0, groups=2)
    kv.grow(alloc, 63 + 2 * 64)  # KV maps every group: FREE is empty
    assert pool.available() == 4  # the activation's share
    assert reserve_decode_step(kv, kv.activation, alloc, None, 8, None)  # 8 chunks: deflates one empty group
    kv.note_forward(decode=True)
    st = device.of(alloc).status()
    assert st["unmap_calls"] == {"request": 1, "tick": 0} and st["decode_unmap_calls"] == 1
    assert st["decode_steps_with_unmap"] == 1
    kv.activation.end_iteration()
    kv.activation.release_idle()
    tick(scheduler)  # busy, one spare group kept: nothing to unmap beyond it
    scheduler.running_batch.reqs = []
    tick(scheduler)  # idle: the spare group goes, in the tick
    kv.note_forward(decode=True)
    st = device.of(alloc).status()
    assert st["unmap_calls"]["tick"] >= 1 and st["decode_unmap_calls"] == 1, st["unmap_calls"]
