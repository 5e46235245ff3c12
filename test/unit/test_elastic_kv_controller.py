"""ElasticKV against upstream's real allocators: the free list stays inside mapped groups,
groups come and go with use, and `available` never promises more than the pool can back."""

import ctypes
import types

import pytest
import torch

from memory_ext.pool import ChunkPool, LayeredKVBuffers, Owner
from memory_ext.pool.lockstep_pool import LockstepLentPool
from memory_ext.vmm import host_backend
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream.kv import free_page_count

CHUNK = 4096
ROW = 64  # bytes per token row per buffer -> 64 rows per chunk


def _make(page_size, num_tokens=1024, capacity_chunks=1000, buffers=4, borrow_room=0):
    """``borrow_room`` > 0: a shared pool's server, whose pool creates no chunk: it starts with
    ``capacity_chunks`` chunks adopted and may take ``borrow_room`` more (a lent pool's borrows)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    backend = host_backend(CHUNK)
    if borrow_room:
        pool = ChunkPool(backend, capacity_chunks + borrow_room, create_chunks=False)
        pool.adopt([backend.create_chunk() for _ in range(capacity_chunks)])
    else:
        pool = ChunkPool(backend, capacity_chunks)
    layered = LayeredKVBuffers(pool, [ROW] * buffers, num_tokens + page_size, page_size)
    kv = ElasticKV(layered, page_size, num_tokens // page_size)
    cache = types.SimpleNamespace(_memx_elastic=kv)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(num_tokens, torch.bfloat16, "cpu", cache, need_sort=True)
    else:
        alloc = PagedTokenToKVPoolAllocator(num_tokens, page_size, torch.bfloat16, "cpu", cache, need_sort=True)
    kv.restrict_free_list(alloc)
    return kv, alloc, pool, backend


def _avail(kv, alloc):
    return free_page_count(alloc) + kv.growable_pages()


def test_free_list_starts_with_group_zero_only():
    kv, alloc, pool, _ = _make(1)
    assert kv.group_pages == 64 and kv.num_groups == 17  # pages 0..1024
    assert sorted(alloc.free_pages.tolist()) == list(range(1, 64))
    assert kv.buffers.mapped_groups() == [0] and pool.usage()[Owner.KV] == 4
    assert _avail(kv, alloc) == 1024  # logical pages 1..1024 all reachable
    kv.check(alloc)


def test_grow_alloc_free_shrink_round_trip():
    kv, alloc, pool, _ = _make(1)
    kv.grow(alloc, 300)
    got = alloc.alloc(300)
    assert got is not None and len(set(got.tolist())) == 300
    assert {int(p) // 64 for p in got} <= set(kv.buffers.mapped_groups())
    assert kv.buffers.num_mapped == 5  # 63 + 4 * 64 >= 300
    kv.check(alloc)
    alloc.free(got[:200])
    kv.shrink(alloc)
    kv.check(alloc)
    live_groups = {int(p) // 64 for p in got[200:]}
    assert set(kv.buffers.mapped_groups()) == live_groups | {0}
    alloc.free(got[200:])
    assert kv.shrink(alloc) >= 1 and kv.buffers.mapped_groups() == [0]
    assert pool.usage()[Owner.KV] == 4 and kv.logical_free_pages(alloc) == 1024
    kv.check(alloc)


def test_available_never_exceeds_what_the_pool_can_back():
    kv, alloc, pool, _ = _make(1, capacity_chunks=4 * 3)  # group 0 + 2 more groups
    assert kv.growable_pages() == 128 and _avail(kv, alloc) == 63 + 128
    kv.grow(alloc, 1000)  # asks for far more: gets what the pool has, no error
    assert kv.buffers.num_mapped == 3 and kv.growable_pages() == 0
    assert alloc.alloc(63 + 128) is not None and alloc.alloc(1) is None


def test_spare_groups_stay_mapped():
    kv, alloc, _, _ = _make(1)
    kv.spare_groups = 1
    kv.grow(alloc, 63 + 64 * 3)
    got = alloc.alloc(63 + 64 * 3)
    alloc.free(got)
    kv.shrink(alloc)
    assert kv.buffers.num_mapped == 2  # group 0 + one spare
    kv.check(alloc)


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_allocator_extend_and_decode_stay_in_mapped_groups(page_size):
    kv, alloc, _, _ = _make(page_size, num_tokens=2048)
    assert kv.buffers.group_rows % page_size == 0
    n = 3
    prefix = torch.zeros(n, dtype=torch.int64)
    seq = torch.tensor([70, 5, 130], dtype=torch.int64)
    last = torch.full((n,), -1, dtype=torch.int64)
    extend = int(seq.sum())
    kv.grow(alloc, extend // page_size + n + 1)
    out = alloc.alloc_extend(prefix, prefix, seq, seq, last, extend)
    assert out is not None and len(set(out.tolist())) == extend
    mapped = set(kv.buffers.mapped_groups())
    assert {int(t) // kv.buffers.group_rows for t in out} <= mapped
    ends = torch.cumsum(seq, 0) - 1
    last_loc = out[ends]
    kv.grow(alloc, n)
    dec = alloc.alloc_decode(seq + 1, seq + 1, last_loc)
    assert dec is not None
    assert {int(t) // kv.buffers.group_rows for t in dec} <= set(kv.buffers.mapped_groups())
    kv.check(alloc)
    alloc.free(torch.cat([out, dec]))
    kv.shrink(alloc)
    assert kv.buffers.mapped_groups() == [0]
    kv.check(alloc)


def test_check_catches_a_free_page_in_an_unmapped_group():
    kv, alloc, _, _ = _make(1)
    alloc.free_pages = torch.cat([alloc.free_pages, torch.tensor([500])])
    with pytest.raises(AssertionError, match="unmapped groups"):
        kv.check(alloc)


# ------------------------------------------------------------ activation ballooning
def _with_balloon(per_token_bytes, capacity_chunks):
    from memory_ext.policy.activation import ActivationProfile
    from memory_ext.pool.activation_balloon import ActivationBalloon

    kv, alloc, pool, backend = _make(1, capacity_chunks=capacity_chunks)
    kv.activation = ActivationBalloon(pool, ActivationProfile(per_token_bytes=per_token_bytes))
    return kv, alloc, pool


def test_activation_takes_free_chunks_and_kv_inflates_into_idle_ones():
    from sglang_memx.elastic.ballooning import reserve_activation

    kv, alloc, pool = _with_balloon(CHUNK, capacity_chunks=4 * 4)  # group 0 + 12 free chunks
    assert reserve_activation(kv, kv.activation, alloc, None, tokens=8, seqs=1, lent=None)  # 8 chunks
    assert pool.usage()[Owner.ACTIVATION] == 8 and kv.activation.live == 8
    assert kv.growable_pages() == 64  # 4 FREE chunks = one group; the live 8 are not KV's
    kv.activation.end_iteration()  # the forward is over: the 8 chunks are idle
    assert kv.growable_pages() == 3 * 64
    kv.grow(alloc, 63 + 3 * 64)  # inflation: KV maps into idle activation memory
    assert kv.buffers.num_mapped == 4 and pool.usage()[Owner.ACTIVATION] == 0
    assert kv.activation.stats["chunks_lent_to_kv"] == 8
    kv.check(alloc)


def test_activation_deflates_free_kv_lazily_and_refuses_what_cannot_fit():
    from sglang_memx.elastic.ballooning import reserve_activation

    kv, alloc, pool = _with_balloon(CHUNK, capacity_chunks=4 * 4)
    kv.grow(alloc, 63 + 3 * 64)  # KV maps everything
    held = alloc.alloc(63 + 64)  # groups 0 and 1 in use, 2 and 3 free
    assert pool.available() == 0
    assert reserve_activation(
        kv, kv.activation, alloc, None, tokens=5, seqs=1, lent=None
    )  # deflates 2 groups (only 5 needed)
    assert kv.buffers.num_mapped == 2 and pool.usage()[Owner.ACTIVATION] == 5
    assert kv.activation.stats["chunks_from_kv"] == 5
    kv.check(alloc)
    kv.activation.end_iteration()
    assert not reserve_activation(kv, kv.activation, alloc, None, tokens=9, seqs=1, lent=None)  # 9 > 5 held + 3 free
    assert pool.usage()[Owner.ACTIVATION] == 5 and kv.activation.stats["refused"] == 1  # nothing taken
    alloc.free(held)
    assert reserve_activation(kv, kv.activation, alloc, None, tokens=9, seqs=1, lent=None)  # group 1 is free now
    kv.check(alloc)


def test_a_budget_without_room_for_one_prefill_batch_is_refused_naming_the_flag():
    from memory_ext.policy.activation import ActivationProfile
    from sglang_memx.config import MemxConfig, MemxConfigError
    from sglang_memx.elastic.build import build_elastic_kv

    profile = ActivationProfile(per_token_bytes=CHUNK)  # one chunk per token
    config = MemxConfig(elastic_kv=True, chunk_kb=4, pool_budget_gb=12 * CHUNK / (1 << 30))  # 12 chunks
    args = ([ROW] * 4, 1025, 1, 1024, "cpu")
    kv, _ = build_elastic_kv(config, *args, profile=profile, batch_tokens=8)  # 4 (one group) + 8 fit
    assert kv.activation is not None and kv.activation.max_batch_tokens == 8
    with pytest.raises(MemxConfigError, match="--memx-pool-budget-gb") as err:
        build_elastic_kv(config, *args, profile=profile, batch_tokens=9)
    assert "--chunked-prefill-size" in str(err.value)


class _FullPool:
    """A shared pool's client whose arbiter refuses ``refusals`` borrows, then grants."""

    def __init__(self, refusals):
        self.refusals, self.asked, self.last_denied_available = refusals, [], 2

    def borrow(self, n):
        self.asked.append(n)
        if len(self.asked) <= self.refusals:
            return 0
        return n


class _Clock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def test_a_server_joining_a_full_pool_waits_for_its_first_group_then_gives_up_naming_the_flag(caplog):
    from sglang_memx.config import MemxConfigError
    from sglang_memx.elastic.build import JOIN_RETRY_S, borrow_first_group

    clock, lent = _Clock(), _FullPool(refusals=30)
    borrow_first_group(lent, 4, "p", CHUNK, wait_s=60, clock=clock, sleep=clock.sleep)  # the others gave back
    assert lent.asked == [4] * 31 and clock.slept == [JOIN_RETRY_S] * 30
    assert "waiting up to" in caplog.text and "pool 'p'" in caplog.text
    clock, lent = _Clock(), _FullPool(refusals=10**6)
    with pytest.raises(MemxConfigError, match="--memx-pool-budget-gb") as err:
        borrow_first_group(lent, 4, "p", CHUNK, wait_s=60, clock=clock, sleep=clock.sleep)
    assert "in 60 s" in str(err.value) and clock.now == pytest.approx(60, abs=JOIN_RETRY_S)


def test_demand_counts_the_rest_of_a_chunked_prompt():
    """A request mid chunked-prefill is in no batch; its remaining prompt and decode still need
    memory (a shared-pool server once gave that memory back and crashed on the next chunk)."""
    from sglang_memx.elastic.demand import head_prefill_tokens, running_demand_tokens

    def req(prompt, out, max_new, allocated):
        return types.SimpleNamespace(
            origin_input_ids=[1] * prompt,
            output_ids=[2] * out,
            sampling_params=types.SimpleNamespace(max_new_tokens=max_new),
            kv=types.SimpleNamespace(kv_allocated_len=allocated),
            finished=lambda: False,
        )

    decoding = req(100, 10, 64, 110)
    chunked = req(180, 0, 64, 128)
    sched = types.SimpleNamespace(
        running_batch=types.SimpleNamespace(reqs=[decoding]),
        last_batch=None,
        chunked_req=chunked,
        waiting_queue=[],
        chunked_prefill_size=64,
    )
    assert running_demand_tokens(sched) == (64 - 10) + (180 - 128 + 64)
    assert head_prefill_tokens(sched, None) == 52  # the chunked request's last chunk comes before any waiting one


def _waiting_req(prompt, max_new=64):
    return types.SimpleNamespace(origin_input_ids=[1] * prompt, output_ids=[],
                                 sampling_params=types.SimpleNamespace(max_new_tokens=max_new),
                                 finished=lambda: False)  # fmt: skip


@pytest.mark.parametrize(
    "prompts, chunk, max_prefill, slots, taken",
    [
        ([], 4096, 16384, 100, 0),  # nothing waits
        ([200, 300, 250], 4096, 16384, 100, 3),  # a burst: the whole of it fits one prefill batch
        ([200, 300, 250], 400, 16384, 100, 1),  # the chunk holds the head only: the head alone
        ([200, 150, 250], 400, 16384, 100, 2),  # in queue order, stopping at the first that does not fit
        ([5000, 10], 4096, 16384, 100, 1),  # the head always counts, even above the chunk (it is chunked)
        ([200, 300, 250], None, 450, 100, 1),  # chunked prefill off: --max-prefill-tokens bounds the batch
        ([200, 300, 250], 4096, 16384, 2, 2),  # upstream's request slots bound it too
        ([200, 300, 250], 4096, 16384, 0, 1),  # ... but the head is always asked for
    ],
)
def test_the_queue_demand_covers_what_the_next_prefill_batch_could_take(prompts, chunk, max_prefill, slots, taken):
    """A shared-pool server borrows for the requests one prefill batch could admit, as stock's pool
    would admit them at once; not for the head alone (a burst then ran one request a batch)."""
    from sglang_memx.elastic.demand import next_prefill_batch, queue_demand_tokens

    waiting = [_waiting_req(p) for p in prompts]
    decoding = _waiting_req(100)
    decoding.output_ids, decoding.kv = [2] * 10, types.SimpleNamespace(kv_allocated_len=110)
    sched = types.SimpleNamespace(
        running_batch=types.SimpleNamespace(reqs=[decoding]), last_batch=None, chunked_req=None,
        waiting_queue=waiting, chunked_prefill_size=chunk, max_prefill_tokens=max_prefill, page_size=1,
        get_num_allocatable_reqs=lambda running: slots,
    )  # fmt: skip
    assert next_prefill_batch(sched) == waiting[:taken]
    each = sum(p + 64 + 1 + 1 for p in prompts[:taken])  # input + max_new + a page + 1, as upstream admits
    assert queue_demand_tokens(sched) == each + (64 - 10)  # plus the running request's remaining decode


# ------------------------------------------------ activation arena (the CUDA layout, on host chunks)
class _FakeMemPool:
    """Plays ArenaMemPool: ``release_cached`` hands back the segments torch would cache."""

    def __init__(self, lib, cached):
        self.lib, self.cached, self.rotations = lib, cached, 0

    def release_cached(self):
        while self.cached:
            ptr, size = self.cached.pop()
            self.lib.memx_arena_free(ptr, size, 0, None)
        self.rotations += 1


def test_balloon_with_arena_maps_what_it_holds_and_lends_only_unpinned_chunks():
    from memory_ext.policy.activation import ActivationProfile
    from memory_ext.pool.activation_balloon import ActivationBalloon
    from memory_ext.pool.segment_arena import SegmentArena, load_library
    from sglang_memx.elastic.ballooning import reserve_activation

    lib = load_library()
    kv, alloc, pool, backend = _make(1, capacity_chunks=4 * 4)  # groups of 4 chunks
    arena = SegmentArena(backend, pool.capacity_chunks)
    cached, live = [], []
    kv.activation = ActivationBalloon(
        pool, ActivationProfile(per_token_bytes=CHUNK), arena=arena, mempool=_FakeMemPool(lib, cached)
    )
    try:
        assert reserve_activation(kv, kv.activation, alloc, None, tokens=8, seqs=1, lent=None)
        assert arena.mapped_chunks == kv.activation.held == 8 == pool.usage()[Owner.ACTIVATION]
        # the forward: torch's caching allocator takes two segments from the arena
        keep = lib.memx_arena_alloc(2 * CHUNK, 0, None)  # outlives the forward (chunks 0-1)
        live.append((keep, 2 * CHUNK))
        scratch = lib.memx_arena_alloc(4 * CHUNK, 0, None)  # freed by the forward, cached by torch (2-5)
        cached.append((scratch, 4 * CHUNK))
        assert arena.contains(keep) and arena.contains(scratch)
        kv.activation.end_iteration()
        assert kv.activation.idle() == 8 and arena.pinned_chunks() == 6
        assert kv.activation.status()["allocator"]["kind"] == "memx arena"
        # inflation: KV wants 3 groups (12 chunks), FREE has 4; the cached segment comes back
        # first, the live one keeps chunks 0-1 mapped, so only 2 groups can be mapped
        assert kv.grow(alloc, 63 + 3 * 64) == 2
        assert kv.activation.mempool.rotations == 1 and cached == []
        assert arena.mapped_chunks == kv.activation.held == 2 == pool.usage()[Owner.ACTIVATION]
        assert kv.activation.stats["chunks_lent_to_kv"] == 6 and pool.available() == 2
        kv.check(alloc)
        ctypes.memset(keep, 7, 2 * CHUNK)  # the live segment's memory is still mapped
        lib.memx_arena_free(*live.pop(), 0, None)
        assert kv.activation.lend_to_kv(2) == 2 and arena.mapped_chunks == 0
        pool.check_invariants()
    finally:
        for ptr, size in cached + live:
            lib.memx_arena_free(ptr, size, 0, None)
        pool.release(Owner.ACTIVATION, arena.close())


def test_activation_arena_is_cuda_only_optional_and_degrades_with_a_warning(caplog, monkeypatch):
    import memory_ext.pool.segment_arena as segment_arena
    from sglang_memx.config import MemxConfig
    from sglang_memx.elastic.build import activation_arena

    cpu = host_backend(CHUNK)
    try:
        pool = ChunkPool(cpu, 8)
        assert activation_arena(MemxConfig(elastic_kv=True), cpu, pool) == (None, None)  # CPU: accounting only
    finally:
        cpu.close()
    cuda_like = types.SimpleNamespace(device=torch.device("cuda", 0), granularity=CHUNK)
    off = MemxConfig(elastic_kv=True, torch_activations=True)
    assert activation_arena(off, cuda_like, pool) == (None, None)

    def no_driver():
        raise segment_arena.ArenaBuildError("libcuda.so.1 cannot be loaded: not found")

    monkeypatch.setattr(segment_arena, "cuda_driver_hooks", no_driver)
    with caplog.at_level("WARNING", logger="sglang_memx"):
        # no driver library: the arena cannot be built, serving goes on without it
        assert activation_arena(MemxConfig(elastic_kv=True), cuda_like, pool) == (None, None)
    assert "activation arena unavailable" in caplog.text and "libcuda" in caplog.text


class _FakeLent:
    """Plays LentPool (a single client) for borrow_tokens: answers from a script, counts what was asked."""

    BACKS_OFF_ALONE = True

    def __init__(self, answers, outstanding=False):
        self.answers, self.asked, self.outstanding = list(answers), [], outstanding
        self.last_denied_available = 0
        self.ranks, self.borrows_paused = 1, False

    def note_fell_short(self):
        pass

    def available_now(self):
        return 1 << 20

    def borrow(self, n, wait=None):
        self.asked.append(n)
        return n if self.answers.pop(0) else 0


def _borrower(lent):
    kv, _, _, _ = _make(1, capacity_chunks=4)  # group 0 only: every further group must be borrowed
    return kv, lent


def test_a_refused_borrow_backs_off_a_pending_one_does_not_and_a_grant_resets():
    from sglang_memx.elastic.shared_pool import BORROW_BACKOFF_S, borrow_tokens

    kv, lent = _borrower(_FakeLent([False, False]))  # refused outright (and the fewer-groups retry too)
    assert borrow_tokens(kv, lent, 100) == 0
    assert kv.borrow_backoff_until > 0 and kv.borrow_backoff_s == 2 * BORROW_BACKOFF_S
    assert borrow_tokens(kv, lent, 100) == 0 and len(lent.asked) == 1  # backing off: nothing asked
    pending, pending_lent = _borrower(_FakeLent([False], outstanding=True))  # the grant is on its way
    assert borrow_tokens(pending, pending_lent, 100) == 0 and pending.borrow_backoff_until == 0.0
    granted, granted_lent = _borrower(_FakeLent([True]))
    granted.borrow_backoff_s = 1.0
    assert (
        borrow_tokens(granted, granted_lent, 100) == 2 and granted.borrow_backoff_s == BORROW_BACKOFF_S
    )  # 2 groups of 64


class _FakeLockstepLent(LockstepLentPool):
    """A tensor parallel rank's pool for borrow_tokens: answers from a script (no arbiter)."""

    def __init__(self, answers, denied_available=0):  # LentPool's own state is not needed here
        self.script = _FakeLent(answers)
        self.last_denied_available, self.ranks, self.borrows_paused = denied_available, 2, False
        self.borrow_fell_short = False

    @property
    def outstanding(self):
        return False

    def available_now(self):
        return self.script.available_now()

    def borrow(self, n, wait=None):
        return self.script.borrow(n, wait)


def test_tensor_parallel_ranks_neither_back_off_nor_note_a_refusal_alone():
    """Each rank's clock would end a back-off in another tick (one rank borrowing alone, evened back
    for ever): a rank's refusal is noted on every rank by the ranks' evening instead (rank_pools)."""
    from sglang_memx.elastic.shared_pool import borrow_tokens

    kv, lent = _borrower(_FakeLockstepLent([False, False, False, False]))
    assert borrow_tokens(kv, lent, 100) == 0 and kv.borrow_backoff_until == 0.0
    assert lent.borrow_fell_short  # for the ranks' evening to make it a refusal on every rank
    assert borrow_tokens(kv, lent, 100) == 0 and len(lent.script.asked) == 2  # asked again at once
    lent.borrows_paused = True  # the ranks' evening paused them (on their agreed clock)
    assert borrow_tokens(kv, lent, 100) == 0 and len(lent.script.asked) == 2


def test_a_denied_tensor_parallel_rank_takes_only_its_ranks_share_of_what_is_left():
    """Denied, a rank takes half of what the arbiter has left at --tp 2, not all of it (the other rank,
    asking next, would get nothing and the surplus be shed back at the evening, every tick)."""
    from sglang_memx.elastic.shared_pool import borrow_tokens

    kv, lent = _borrower(_FakeLockstepLent([False, True], denied_available=0))
    per_group = kv.buffers.chunks_per_group
    lent.last_denied_available = 4 * per_group  # four groups free at the arbiter
    assert borrow_tokens(kv, lent, 1000) == 2  # two of them
    assert lent.script.asked[1] == 2 * per_group and lent.borrow_fell_short  # less than it asked
    granted, granted_lent = _borrower(_FakeLockstepLent([True]))
    assert borrow_tokens(granted, granted_lent, 100) == 2 and not granted_lent.borrow_fell_short


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_per_group_count_sees_staged_frees_and_leaves_them_staged(page_size):
    """``counts_per_group`` (the arbiter report's count) equals ``free_per_group`` (the shrink
    path's, which merges upstream's staged frees) on both of upstream's allocators, and stages
    nothing differently: upstream still holds its frees unsorted afterwards."""
    kv, alloc, _, _ = _make(page_size)
    kv.grow(alloc, 600)
    got = alloc.alloc(512)
    alloc.free(got[: len(got) // 2])  # staged (need_sort): not in the free list yet
    staged = free_page_count(alloc) - len(alloc.free_pages)
    assert staged > 0
    fl = kv.free_list
    counts = fl.counts_per_group(alloc, kv.group_pages, kv.num_groups)
    assert free_page_count(alloc) - len(alloc.free_pages) == staged  # untouched
    assert sum(counts) == free_page_count(alloc)
    assert counts == fl.free_per_group(alloc, kv.group_pages, kv.num_groups)
    assert free_page_count(alloc) == len(alloc.free_pages)  # free_per_group merged them
    kv.check(alloc)
