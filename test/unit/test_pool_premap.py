"""memory_ext.pool: hiding the mapping cost of the KV eTensor (pre-mapping, async unmap)."""

import os
import random
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory_ext.pool import ChunkPool, KVETensor, Owner
from memory_ext.pool.unmapper import AsyncUnmapper
from memory_ext.vmm import host_backend

PAGE = os.sysconf("SC_PAGE_SIZE")
G = 4 * PAGE  # chunk size
PB = PAGE  # page size: 4 pages per slot


class ThreadCalls:
    """Counts backend map/unmap calls per thread (the hot path = the calling thread)."""

    def __init__(self, vmm):
        self.calls = {}
        self._lock = threading.Lock()
        for name in ("map", "unmap"):
            orig = getattr(vmm, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                out = _orig(*a, **k)
                with self._lock:
                    key = (threading.get_ident(), _name)
                    self.calls[key] = self.calls.get(key, 0) + 1
                return out

            setattr(vmm, name, wrapped)

    def here(self):
        me = threading.get_ident()
        with self._lock:
            return self.calls.get((me, "map"), 0) + self.calls.get((me, "unmap"), 0)


@pytest.fixture
def vmm():
    backend = host_backend(G)
    yield backend
    backend.close()


def _fill(kv, page, tag):
    kv.page_view(page).fill_(tag)


def _check(kv, page, tag):
    v = kv.page_view(page)
    assert int(v[0]) == tag and int(v[-1]) == tag and bool((v == tag).all()), f"page {page} lost its bytes"


def test_headroom_argument_checks(vmm):
    pool = ChunkPool(vmm, 4)
    with pytest.raises(ValueError, match="headroom_slots must be >= 0"):
        KVETensor(pool, PB, 8, headroom_slots=-1)
    with pytest.raises(TypeError, match="unmapper must be an AsyncUnmapper"):
        KVETensor(pool, PB, 8, unmapper=object())
    kv = KVETensor(pool, PB, 8)
    assert kv.headroom_slots == 0 and not kv.async_unmap and kv.refill() == 0
    kv.close()


def test_premap_then_ensure_mapped_makes_no_map_call(vmm):
    pool = ChunkPool(vmm, 8)
    kv = KVETensor(pool, PB, 16)
    assert kv.premap([0, 5, 6]) == 2  # slots 0 and 1 as spares, pages stay free
    assert kv.live_pages == 0 and kv.spare_slots == 2 and pool.usage()[Owner.KV] == 2
    assert kv.slot_state(0) == "spare" and kv.slot_state(2) == "free"
    kv.check_invariants()
    before = vmm.map_calls
    assert kv.ensure_mapped([0, 1, 4]) == 0
    assert vmm.map_calls == before and kv.spare_slots == 0 and kv.slot_state(1) == "live"
    assert kv.trim_headroom() == 0  # no spares left
    kv.close()
    pool.check_invariants()
    assert pool.usage()[Owner.KV] == 0


def test_refill_keeps_k_spares_and_trim_gives_them_back(vmm):
    pool = ChunkPool(vmm, 8)
    kv = KVETensor(pool, PB, 32, headroom_slots=3)
    assert kv.refill() == 3 and kv.spare_slots == 3 and kv.refill() == 0
    assert pool.usage()[Owner.KV] == 3  # spares are KV-owned in the ledger
    kv.ensure_mapped([0])  # uses spare slot 0
    assert kv.spare_slots == 2 and kv.refill() == 1
    kv.free_pages([0])  # 4 spares > K: slot 0 is unmapped (sync)
    assert kv.slot_state(0) == "free" and kv.spare_slots == 3
    kv.headroom_slots = 1
    assert kv.trim_headroom(keep=1) == 2 and kv.spare_slots == 1
    kv.check_invariants()
    pool.check_invariants()
    assert pool.usage()[Owner.KV] == 1 and pool.usage()[Owner.FREE] == 3
    kv.close()


def test_refill_stops_quietly_when_pool_is_short(vmm):
    pool = ChunkPool(vmm, 2)
    kv = KVETensor(pool, PB, 32, headroom_slots=5)
    assert kv.refill() == 2 and kv.spare_slots == 2
    kv.close()


def test_pool_pressure_gives_back_spares_and_retiring(vmm):
    pool = ChunkPool(vmm, 3)
    kv = KVETensor(pool, PB, 32, headroom_slots=2)
    kv.refill()  # slots 0, 1 spare
    kv.ensure_mapped([8])  # slot 2: pool now full
    assert pool.available() == 0
    assert kv.ensure_mapped([12, 16]) == 2  # slots 3, 4: needs both spares' chunks
    assert kv.spare_slots == 0 and pool.usage()[Owner.KV] == 3
    kv.check_invariants()
    pool.check_invariants()
    kv.close()


def test_async_unmap_and_cancelled_retirement(vmm):
    pool = ChunkPool(vmm, 8)
    unmapper = AsyncUnmapper()
    kv = KVETensor(pool, PB, 32, unmapper=unmapper)
    calls = ThreadCalls(vmm)
    kv.ensure_mapped([0, 1, 4, 8])
    for p in (0, 1, 4, 8):
        _fill(kv, p, p + 1)
    chunk1 = kv.chunk_of_slot(1)
    gate = threading.Event()
    unmapper.submit(gate.wait, 10)  # stall the worker deterministically
    n0 = calls.here()
    assert kv.free_pages([4]) == 1  # slot 1 -> RETIRING, returns at once
    assert kv.slot_state(1) == "retiring" and kv.chunk_of_slot(1) is chunk1
    kv.free_pages([8])  # slot 2 -> RETIRING, stays so
    assert kv.ensure_mapped([5]) == 0  # slot 1 needed again: retirement cancelled
    assert calls.here() == n0  # zero map/unmap calls on this thread
    assert kv.slot_state(1) == "live" and kv.chunk_of_slot(1) is chunk1
    assert kv.stats()["cancelled_retirements"] == 1
    gate.set()
    kv.flush()
    assert kv.slot_state(1) == "live" and kv.chunk_of_slot(1) is chunk1  # job was a no-op
    assert kv.slot_state(2) == "free" and kv.stats()["retired_async"] == 1
    _fill(kv, 5, 77)
    _check(kv, 0, 1), _check(kv, 1, 2), _check(kv, 5, 77)
    kv.check_invariants()
    pool.check_invariants()
    assert pool.usage()[Owner.KV] == 1 + 1  # slots 0 and 1
    kv.close()
    unmapper.close()
    assert pool.usage()[Owner.KV] == 0


def test_worker_failure_surfaces_on_flush(vmm):
    pool = ChunkPool(vmm, 4)
    kv = KVETensor(pool, PB, 16, async_unmap=True)
    kv.ensure_mapped([0])
    orig = vmm.unmap

    def boom(*a, **k):
        raise OSError(5, "injected unmap failure")

    vmm.unmap = boom
    kv.free_pages([0])
    with pytest.raises(OSError, match="injected"):
        kv.flush()
    vmm.unmap = orig
    assert kv.slot_state(0) == "spare"  # still mapped and accounted, not lost
    kv.check_invariants()
    pool.check_invariants()
    kv.flush()  # error reported once
    kv.close()
    assert pool.usage()[Owner.KV] == 0


def test_unmapper_basics():
    u = AsyncUnmapper()
    out = []
    futs = [u.submit(out.append, i) for i in range(5)]
    assert u.flush() == 5 and out == list(range(5)) and all(f.done() for f in futs)
    u.submit(lambda: 1 / 0)
    u.submit(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="2 unmap jobs failed"):
        u.flush()
    u.close()
    u.close()
    with pytest.raises(RuntimeError, match="closed"):
        u.submit(print)


@pytest.mark.parametrize("async_unmap", [False, True])
def test_steady_state_decode_hot_path_makes_no_map_calls(vmm, async_unmap):
    """R requests grow one page per step; finished ones free their pages.

    With headroom the hot path never maps; with async unmap it never unmaps
    either (sync mode unmaps slots emptied beyond the headroom in free_pages).
    """
    rng = random.Random(1)
    R, K, NUM_PAGES = 6, 3, 256
    pool = ChunkPool(vmm, 64)
    kv = KVETensor(pool, PB, NUM_PAGES, headroom_slots=K, async_unmap=async_unmap)
    calls = ThreadCalls(vmm)
    reqs = {}  # req id -> [pages]
    tags = {}
    next_id = 0
    hot_calls = hot_ops = 0
    warmup = 20
    hot_unmaps_sync = [0]
    for step in range(200):
        kv.refill()  # off the hot path (a background worker's job)
        if step % 7 == 0:
            kv.flush()
        while len(reqs) < R:
            reqs[next_id] = []
            next_id += 1
        want = kv.suggest_pages(len(reqs))
        b0, c0 = calls.here(), vmm.counters()
        # ---- hot path: one page per request, then free finished requests
        kv.ensure_mapped(want)
        for r, p in zip(list(reqs), want):
            reqs[r].append(p)
        done = [r for r, pages in reqs.items() if len(pages) >= rng.randint(4, 24)]
        kv.free_pages([p for r in done for p in reqs[r]])
        # ---- end of hot path
        if step >= warmup:
            c1 = vmm.counters()
            assert c1["map_calls"] == c0["map_calls"], step  # the worker never maps either
            hot_calls += calls.here() - b0
            hot_ops += 1
            hot_unmaps_sync[0] += c1["unmap_calls"] - c0["unmap_calls"]
        for r in done:
            for p in reqs.pop(r):
                tags.pop(p, None)
        for pages in reqs.values():
            p = pages[-1]
            tags[p] = (step * 31 + p) % 251 + 1
            _fill(kv, p, tags[p])
        if step % 10 == 0:
            for p, t in tags.items():
                _check(kv, p, t)
    assert hot_ops == 180
    if async_unmap:
        assert hot_calls == 0  # neither map nor unmap on the caller's thread
        assert kv.stats()["retired_async"] > 0  # the worker did unmap (off the hot path)
    else:
        assert hot_calls == hot_unmaps_sync[0] > 0  # only the documented sync unmaps
    kv.flush()
    for p, t in tags.items():
        _check(kv, p, t)
    kv.check_invariants()
    pool.check_invariants()
    assert kv.live_pages == len(tags)
    assert pool.usage()[Owner.KV] == kv.mapped_chunks
    kv.close()
    assert pool.usage()[Owner.KV] == 0


class PremapMachine(RuleBasedStateMachine):
    NUM_PAGES = 24  # 6 slots

    def __init__(self):
        super().__init__()
        self.vmm = host_backend(G)
        self.pool = ChunkPool(self.vmm, 5)
        self.unmapper = AsyncUnmapper()
        self.kv = KVETensor(self.pool, PB, self.NUM_PAGES, headroom_slots=1, unmapper=self.unmapper)
        self.tags = {}
        self.gate = None
        self.counter = 0

    def _tag(self):
        self.counter += 1
        return self.counter % 250 + 1

    @rule(pages=st.sets(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=6))
    def ensure_mapped(self, pages):
        before = {s: self.kv.slot_state(s) for s in range(self.kv.num_slots)}
        try:
            self.kv.ensure_mapped(sorted(pages))
        except Exception as exc:
            assert type(exc).__name__ in ("PoolExhausted", "CeilingExceeded"), exc
            for p in pages:
                assert self.kv.is_live(p) == (p in self.tags)
            return
        for p in pages:
            slot = p // self.kv.pages_per_slot
            assert before[slot] != "retiring" or self.kv.slot_state(slot) == "live"
            if p not in self.tags:
                self.tags[p] = self._tag()
                _fill(self.kv, p, self.tags[p])

    @precondition(lambda self: self.tags)
    @rule(data=st.data())
    def free_pages(self, data):
        pages = data.draw(st.sets(st.sampled_from(sorted(self.tags)), min_size=1))
        self.kv.free_pages(sorted(pages))
        for p in pages:
            del self.tags[p]

    @rule(pages=st.sets(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=4))
    def premap(self, pages):
        try:
            self.kv.premap(sorted(pages))
        except Exception as exc:
            assert type(exc).__name__ in ("PoolExhausted", "CeilingExceeded"), exc

    @rule()
    def refill(self):
        self.kv.refill()

    @rule(k=st.integers(0, 3))
    def set_headroom(self, k):
        self.kv.headroom_slots = k

    @rule(keep=st.integers(0, 2))
    def trim(self, keep):
        self.kv.trim_headroom(keep)
        assert self.kv.spare_slots <= max(keep, 0) or self.kv.spare_slots == 0

    @precondition(lambda self: self.gate is None)
    @rule()
    def stall_worker(self):
        self.gate = threading.Event()
        self.unmapper.submit(self.gate.wait, 10)

    @rule()
    def flush(self):
        if self.gate is not None:
            self.gate.set()
            self.gate = None
        self.kv.flush()
        assert self.kv.retiring_slots == 0
        self.kv.check_invariants()
        self.pool.check_invariants()
        assert self.pool.usage()[Owner.KV] == self.kv.mapped_chunks

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        assert self.kv.live_pages == len(self.tags)
        for p, t in self.tags.items():
            _check(self.kv, p, t)

    def teardown(self):
        if self.gate is not None:
            self.gate.set()
        self.kv.close()
        self.unmapper.close()
        self.pool.check_invariants()
        assert self.pool.usage()[Owner.KV] == 0
        self.pool.close()
        self.vmm.close()


TestPremapMachine = PremapMachine.TestCase
TestPremapMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
