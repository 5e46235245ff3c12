"""``ElasticKV.activation_cost_pages``: what admission charges a batch's activation, in the
scheduler's own currency (free list + growable pages), must be what reserving it really takes.

Regression (issue 16): a server whose KV is one slab group plus upstream's padded page (512
tokens of 512-token groups: group 1 holds a single page) charged a 64-token prefill's activation
a whole group, 512 tokens, against a budget of 512, and never admitted its warm-up, although
FREE and idle activation chunks covered it.
"""

import contextlib
import random
import types

import torch

from memory_ext.policy.activation import ActivationProfile
from memory_ext.pool import ChunkPool, LayeredKVBuffers, Owner
from memory_ext.pool.activation_balloon import ActivationBalloon
from memory_ext.vmm import host_backend
from sglang_memx.coordinator import device
from sglang_memx.elastic.ballooning import reserve_activation
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv

CHUNK = 4096
# What balance's borrows wait for the arbiter's grant here. The server waits 20 ms and takes a
# later grant at its next iteration; these tests check what is asked, so a grant delayed by a
# loaded machine (CI: 29 of 32 chunks, the late grant not landed yet) must not count as refused.
GRANT_WAIT_S = 10.0
ROW = 64  # a group is 64 tokens in 4 chunks (4 buffers x 64 B x 64 rows = 16 KiB)


def _server(num_tokens: int, pool_chunks: int):
    pool = ChunkPool(host_backend(CHUNK), pool_chunks)
    kv, alloc = _elastic(pool, num_tokens)
    return kv, alloc, pool


def _elastic(pool, num_tokens: int, lent=None):
    """Elastic KV of ``num_tokens`` (page size 1) over ``pool``, an activation balloon, and upstream's
    own allocator tied to it."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    kv = ElasticKV(LayeredKVBuffers(pool, [ROW] * 4, num_tokens + 1, 1), 1, num_tokens)
    kv.activation = ActivationBalloon(pool, ActivationProfile(per_token_bytes=CHUNK))
    kv.lengths_capped = True
    alloc = TokenToKVPoolAllocator(num_tokens, torch.bfloat16, "cpu", types.SimpleNamespace(), need_sort=True)
    device.attach(alloc, kv, lent=lent)
    kv.restrict_free_list(alloc)
    return kv, alloc


@contextlib.contextmanager
def _shared_pool(budget_chunks: int, borrow: int):
    """A live arbiter of ``budget_chunks`` and a client that borrowed ``borrow`` chunks."""
    from memory_ext.pool.arbiter import Arbiter
    from memory_ext.pool.lent_pool import LentPool
    from support.arbiter import socket_dir

    with socket_dir("memx-act-") as d, Arbiter(str(d / "p.sock"), host_backend(CHUNK), budget_chunks):
        lent = LentPool(str(d / "p.sock"), "server", host_backend(CHUNK))
        try:
            assert lent.borrow(borrow) == borrow
            yield lent
        finally:
            lent.close()


def _available(kv, alloc) -> int:
    return up_kv.free_page_count(alloc) + kv.growable_pages()


def _hold(kv, chunks: int) -> None:
    """Make the activation hold ``chunks`` chunks, idle (as after an iteration's end)."""
    assert kv.activation.reserve(_tokens_for(kv, chunks), 1, lambda: 0, lambda n: 0)
    assert kv.activation.held == chunks
    kv.activation.end_iteration()


def _tokens_for(kv, chunks: int) -> int:
    t = 1
    while kv.activation.need_chunks(t, 1) < chunks:
        t += 1
    assert kv.activation.need_chunks(t, 1) == chunks
    return t


def test_one_group_server_pays_nothing_when_free_and_idle_chunks_cover_the_activation():
    kv, alloc, pool = _server(64, 11)  # groups 0 (63 pages) and 1 (1 page): 8 chunks, 3 more
    kv.grow(alloc, 64, "request")
    assert sorted(kv.buffers.mapped_groups()) == [0, 1] and kv.usable_pages(1) == 1
    _hold(kv, 1)
    assert pool.available() == 2 and _available(kv, alloc) == 64
    assert kv.activation_cost_pages(3) == 0  # the old rule charged a whole group: 64 of 64
    assert kv.activation_cost_pages(4) == 1  # one chunk short: group 1 goes, with its single page
    before = _available(kv, alloc)
    assert reserve_activation(kv, kv.activation, alloc, None, _tokens_for(kv, 4), 1, lent=None)
    assert before - _available(kv, alloc) == 1


def test_cost_equals_what_reserving_takes_from_the_scheduler_count():
    rng = random.Random(5)
    checked = 0
    for _ in range(300):
        num_tokens = rng.randrange(40, 400)
        pool_chunks = 4 * (num_tokens // 64 + 1) + rng.randrange(0, 12)  # every group, and some more
        kv, alloc, pool = _server(num_tokens, pool_chunks)
        try:
            kv.grow(alloc, rng.randrange(0, num_tokens + 1), "request")
            idle_max = pool.available()
            if idle_max:
                _hold(kv, rng.randrange(0, idle_max + 1) or 1)
            extra = rng.randrange(1, 10)
            predicted = kv.activation_cost_pages(extra)
            before = _available(kv, alloc)
            need = kv.activation.live + extra
            if not reserve_activation(kv, kv.activation, alloc, None, _tokens_for(kv, need), 1, lent=None):
                continue  # it does not fit at all (group 0 is never unmapped)
            assert kv.activation.live == need
            assert before - _available(kv, alloc) == predicted, (num_tokens, pool_chunks, extra)
            checked += 1
        finally:
            pool.backend.close()  # its memfds: 300 pools would hold thousands of fds
    assert checked > 150


def test_a_partial_last_group_counts_as_emptiable_by_eviction():
    """Regression (issue 16): 509 cached tokens, 3 free, groups of 512 with a 1-page group 1:
    evicting frees group 1, but ``evictable // group_rows`` said 0 groups, so an activation
    that needed KV to shrink was refused forever while the cache sat there."""
    kv, alloc, pool = _server(64, 11)
    kv.grow(alloc, 64, "request")
    pages = alloc.alloc(64)  # everything allocated (the cache's pages, say)
    assert pages is not None and sorted(kv.buffers.mapped_groups()) == [0, 1]
    alloc.free(pages[pages < 4])  # 3 pages of group 0 free again (page 0 is upstream's padding)
    assert kv.emptiable_groups(alloc, 0) == 0
    assert kv.emptiable_groups(alloc, 61) == 1  # group 1's one page is cached: evicting it empties it
    assert kv.emptiable_groups(alloc, 1_000) == 1  # group 0 is never unmapped
    alloc.free(pages[pages == 64])
    assert kv.emptiable_groups(alloc, 0) == 1 and kv.empty_groups(alloc) == [1]


def test_activation_borrows_its_chunks_from_the_arbiter_when_kv_holds_every_group(tmp_path):
    """Regression (issue 16): in a shared pool, a server whose KV groups are all mapped asked the
    arbiter for KV *groups* for its activation; KV could map none, so nothing was asked and the
    prefill waited forever with the arbiter's chunks free."""
    with _shared_pool(64, 8) as lent:  # both groups, nothing more
        kv, alloc = _elastic(lent.pool, 64, lent)
        kv.grow(alloc, 64, "request")
        assert alloc.alloc(64) is not None  # every page held (running requests, say)
        assert kv.buffers.num_mapped == 2 and lent.pool.available() == 0
        assert reserve_activation(kv, kv.activation, alloc, None, _tokens_for(kv, 3), 1, lent=lent)
        assert kv.activation.live == 3 and kv.buffers.num_mapped == 2  # borrowed, KV untouched


def test_balance_borrows_what_kv_and_the_activation_need_together(monkeypatch):
    """Regression (issue 16, the layer stream cache's long prompts): every unmapped group looked
    affordable because FREE + idle activation chunks covered them, so ``borrow_tokens`` (capped
    at ``unmapped - affordable`` groups) asked for nothing, while the request needed those
    groups *and* its activation: it waited forever. The shortfall is now counted in chunks."""
    from sglang_memx.elastic import demand, shared_pool

    with _shared_pool(128, 4 + 29 + 3) as lent:  # group 0, 29 FREE, 3 for the activation
        kv, alloc = _elastic(lent.pool, 512, lent)
        _hold(kv, 3)
        assert kv.num_groups - kv.buffers.num_mapped == 8 and kv.affordable_groups() == 8
        monkeypatch.setattr(demand, "queue_demand_tokens", lambda scheduler: 512)  # the head: all 8 groups
        monkeypatch.setattr(shared_pool, "report", lambda *a: None)
        monkeypatch.setattr(shared_pool, "QUEUE_WAIT_S", GRANT_WAIT_S)
        scheduler = types.SimpleNamespace(waiting_queue=[object()])
        shared_pool.balance(kv, lent, alloc, None, scheduler, 3, device.of(alloc).activation_side())
        # 8 groups (32 chunks) + 3 activation chunks against 29 FREE + 3 held: 3 borrowed
        assert lent.pool.available() == 29 + 3


def test_balance_keeps_cached_prefixes_with_what_the_arbiter_has_free(monkeypatch):
    """The head's KV would come from evicting cached prefixes (group 0 holds 63 cached tokens):
    while the arbiter has chunks nobody holds, balance borrows the group eviction would have
    freed, at once and once; with nothing free at the arbiter it asks for nothing (no reclaim
    from another server for a cache)."""
    from sglang_memx.elastic import demand, shared_pool

    monkeypatch.setattr(demand, "queue_demand_tokens", lambda scheduler: 60)
    monkeypatch.setattr(shared_pool, "report", lambda *a: None)
    monkeypatch.setattr(shared_pool, "QUEUE_WAIT_S", GRANT_WAIT_S)
    scheduler = types.SimpleNamespace(waiting_queue=[object()])
    tree = types.SimpleNamespace(evictable_size=lambda: 63)
    for budget, kept in ((128, 4), (4, 0)):
        with _shared_pool(budget, 4) as lent:  # group 0 mapped, nothing else held
            kv, alloc = _elastic(lent.pool, 512, lent)
            pages = alloc.alloc(63)  # the cache's pages, say: nothing mapped is free
            assert pages is not None and up_kv.free_page_count(alloc) == 0 and lent.pool.available() == 0
            shared_pool.balance(kv, lent, alloc, tree, scheduler, 0, device.of(alloc).activation_side())
            assert lent.pool.available() == kept
            asked = []
            monkeypatch.setattr(lent, "available_now", lambda asked=asked: asked.append(1) or 0)
            shared_pool.balance(kv, lent, alloc, tree, scheduler, 0, device.of(alloc).activation_side())
            assert lent.pool.available() == kept and lent.client.status()["pending"] == 0
            # covered now: nothing more asked; found nothing free: not asked again within the second
            assert asked == []


def test_a_short_allocation_takes_the_live_activation_chunks_when_they_are_only_counted():
    """The soak's crash (upstream's fatal "Out of memory" in a chunked prefill's next chunk):
    the chunk's activation had taken the FREE chunks its KV was admitted against. Without an
    arena the activation's chunks only count torch's allocations, so KV takes them (the forward
    over-commits, counted) rather than ending the scheduler."""

    kv, alloc, pool = _server(128, 12)  # groups 0-2 (group 2: one page) need 12 chunks; the activation 3
    kv.grow(alloc, 63, "request")
    assert kv.buffers.num_mapped == 1
    assert kv.activation.reserve(_tokens_for(kv, 3), 1, lambda: 0, lambda n: 0) and kv.activation.live == 3
    assert pool.available() == 5  # one group's worth and one chunk
    device.of(alloc).cover_allocation(alloc, 63 + 64 + 1)  # all three groups: the third needs the activation's chunks
    assert up_kv.free_page_count(alloc) == 128 and kv.buffers.num_mapped == 3
    assert kv.activation.stats["overcommitted_chunks"] > 0 and kv.activation.live <= kv.activation.held

    kv, alloc, pool = _server(128, 12)
    kv.grow(alloc, 63, "request")
    assert kv.activation.reserve(_tokens_for(kv, 3), 1, lambda: 0, lambda n: 0)
    kv.activation.arena = object()  # an arena: the chunks back the forward's tensors
    device.of(alloc).cover_allocation(alloc, 128)
    assert kv.buffers.num_mapped == 2 and kv.activation.live == 3  # upstream then refuses, nothing lent


def test_a_chunked_prefill_keeps_its_next_chunks_activation_from_going_back(monkeypatch):
    """Between two chunks a RECLAIM (or a give-back) must leave the next chunk's activation, or it
    takes FREE chunks the request's KV was admitted against."""
    from sglang_memx.elastic import demand, shared_pool

    kv, alloc, pool = _server(64, 8 + 5)
    kv.grow(alloc, 64, "request")
    pool.release(Owner.KV, pool.acquire(Owner.KV, 5))  # created and FREE, as in a shared pool
    assert pool.usage()[Owner.FREE] == 5
    scheduler = types.SimpleNamespace(chunked_req=object(), running_batch=None, last_batch=None)
    monkeypatch.setattr(demand, "running_demand_tokens", lambda s: 0)
    monkeypatch.setattr(demand, "decode_activation_chunks", lambda balloon, s: 1)
    monkeypatch.setattr(demand, "head_prefill_tokens", lambda s, host: _tokens_for(kv, 3))
    activation = device.of(alloc).activation_side()
    assert demand.admitted_activation_chunks(kv.activation, scheduler, None) == 3
    assert shared_pool.spare_free_chunks(kv, alloc, scheduler, activation) == 2
    scheduler.chunked_req = None
    assert demand.admitted_activation_chunks(kv.activation, scheduler, None) == 1
    assert shared_pool.spare_free_chunks(kv, alloc, scheduler, activation) == 4


def test_balance_keeps_and_borrows_what_a_weights_restore_waits_for(monkeypatch):
    """Tensor parallel ranks on a shared pool borrow a restore's shortfall in the tick
    (``restore_chunks``, ``remap.take_restore_ask``): with nothing waiting, FREE beyond the restore's
    ask goes back and the ask stays; short of it, the ask is borrowed."""
    from sglang_memx.elastic import demand, shared_pool

    monkeypatch.setattr(demand, "running_demand_tokens", lambda scheduler: 0)
    monkeypatch.setattr(shared_pool, "QUEUE_WAIT_S", GRANT_WAIT_S)
    idle = types.SimpleNamespace(waiting_queue=[], running_batch=None, last_batch=None, chunked_req=None)
    for free, restore, kept in ((10, 0, 0), (10, 6, 6), (0, 6, 6)):
        with _shared_pool(128, 4 + free) as lent:  # group 0 mapped and ``free`` FREE chunks
            kv, alloc = _elastic(lent.pool, 512, lent)
            assert lent.pool.available() == free
            shared_pool.balance(kv, lent, alloc, None, idle, 0, device.of(alloc).activation_side(), restore)
            assert lent.pool.available() == kept, (free, restore)
