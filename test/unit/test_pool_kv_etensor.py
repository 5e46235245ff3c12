"""memory_ext.pool.kv_etensor: pages mapped on demand, slots deflated eagerly, data kept."""

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from memory_ext.pool import ChunkPool, KVETensor, Owner, PoolExhausted
from memory_ext.vmm import host_backend

PAGE = os.sysconf("SC_PAGE_SIZE")
G = 4 * PAGE  # chunk size
PB = PAGE  # page size: 4 pages per slot


@pytest.fixture
def vmm():
    backend = host_backend(G)
    yield backend
    backend.close()


def _perm(address):
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    return None


def test_geometry_and_errors(vmm):
    pool = ChunkPool(vmm, 8)
    with pytest.raises(ValueError, match=f"page_bytes {3 * PAGE} does not divide the chunk size {G}"):
        KVETensor(pool, 3 * PAGE, 10)
    with pytest.raises(ValueError, match="num_pages must be positive"):
        KVETensor(pool, PB, 0)
    kv = KVETensor(pool, PB, 10)
    assert (kv.pages_per_slot, kv.num_slots, kv.vrange.size) == (4, 3, 3 * G)
    assert kv.mapped_chunks == 0 and kv.live_pages == 0
    assert vmm.counters()["chunks_created"] == 0  # nothing physical until a page is needed
    with pytest.raises(ValueError, match=r"page id 10 is outside \[0, 10\)"):
        kv.ensure_mapped([1, 10])
    assert kv.live_pages == 0
    kv.ensure_mapped([1])
    with pytest.raises(ValueError, match="page id 2 is not live"):
        kv.free_pages([1, 2])
    with pytest.raises(ValueError, match="page id 1 is listed twice"):
        kv.free_pages([1, 1])
    assert kv.is_live(1) and kv.live_pages == 1
    with pytest.raises(ValueError, match="page id 2 is not live"):
        kv.page_view(2)
    kv.close()
    pool.check_invariants()
    assert pool.usage()[Owner.KV] == 0


def test_map_on_demand_and_eager_slot_deflation(vmm):
    pool = ChunkPool(vmm, 8)
    kv = KVETensor(pool, PB, 12)
    assert kv.ensure_mapped([0, 1, 5]) == 2  # slots 0 and 1
    assert kv.ensure_mapped([2, 3]) == 0  # slot 0 already mapped
    assert (kv.mapped_chunks, kv.live_pages, pool.usage()[Owner.KV]) == (2, 5, 2)
    assert kv.free_pages([0, 1, 2]) == 0  # page 3 still live in slot 0
    assert kv.free_pages([3]) == 1  # slot 0 empty -> unmapped, chunk back to FREE
    assert kv.chunk_of_slot(0) is None and _perm(kv.vrange.base) == "---p"
    assert (kv.mapped_chunks, pool.usage()[Owner.KV], pool.usage()[Owner.FREE]) == (1, 1, 1)
    kv.check_invariants()
    pool.check_invariants()
    kv.close()
    assert pool.usage()[Owner.KV] == 0 and len(vmm.ranges()) == 0


def test_exhaustion_leaves_no_partial_state(vmm):
    pool = ChunkPool(vmm, 2)
    kv = KVETensor(pool, PB, 16)
    kv.ensure_mapped([0])
    with pytest.raises(PoolExhausted, match=r"owner KV requested 2 chunk\(s\), 1 available"):
        kv.ensure_mapped([1, 4, 8])  # needs slots 1 and 2
    assert not kv.is_live(1) and kv.live_pages == 1 and kv.mapped_chunks == 1
    assert vmm.mapped_slots(kv.vrange).keys() == {0}
    kv.check_invariants()
    pool.check_invariants()
    kv.close()


def test_map_failure_rolls_back(vmm, monkeypatch):
    pool = ChunkPool(vmm, 8)
    kv = KVETensor(pool, PB, 16)
    real_map, calls = vmm.map, []

    def flaky_map(vrange, offset, chunk):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError("injected map failure")
        return real_map(vrange, offset, chunk)

    monkeypatch.setattr(vmm, "map", flaky_map)
    with pytest.raises(OSError, match="injected"):
        kv.ensure_mapped([0, 4, 8])
    monkeypatch.undo()
    assert kv.live_pages == 0 and kv.mapped_chunks == 0
    assert vmm.mapped_slots(kv.vrange) == {}
    assert pool.usage()[Owner.KV] == 0
    kv.check_invariants()
    pool.check_invariants()
    kv.ensure_mapped([0, 4, 8])
    assert kv.mapped_chunks == 3
    kv.close()


def test_views_are_zero_copy(vmm):
    pool = ChunkPool(vmm, 8)
    kv = KVETensor(pool, PB, 12, dtype=torch.float16)
    kv.ensure_mapped([5, 6])
    full = kv.view(torch.float16, (2, PB // 4))
    assert full.shape == (12, 2, PB // 4)
    full[5].fill_(1.5)
    assert torch.all(kv.page_view(5) == 1.5)
    kv.page_view(6, torch.int32, (PB // 4,)).fill_(-3)
    assert torch.all(full[6].view(torch.int32) == -3)
    with pytest.raises(ValueError, match=f"does not fill page_bytes {PB}"):
        kv.page_view(5, torch.float16, (3,))
    kv.close()


def test_released_chunk_shows_new_owner_writes_only_through_new_mapping(vmm):
    pool = ChunkPool(vmm, 2)
    kv = KVETensor(pool, PB, 8)
    kv.ensure_mapped([0, 1, 2, 3])
    old_chunk = kv.chunk_of_slot(0)
    old_view = kv.page_view(0)
    old_view.fill_(0xAA)
    kv.free_pages([0, 1, 2, 3])
    with pytest.raises(ValueError, match="stale"):
        vmm.check_view(old_view)
    assert _perm(kv.vrange.base) == "---p"  # KV's address no longer reaches the chunk
    (act_chunk,) = pool.acquire(Owner.ACTIVATION, 1)
    assert act_chunk is old_chunk  # LIFO reuse hands the same physical chunk over
    act_range = vmm.reserve(G)
    vmm.map(act_range, 0, act_chunk)
    act = vmm.tensor_view(act_range, 0, G)
    assert torch.all(act[:PB] == 0xAA)  # old bytes survive: the pool does not scrub
    act.fill_(0x55)
    assert vmm.mappings_of(act_chunk) == [(act_range, 0)]
    kv.ensure_mapped([0])  # KV gets a different chunk at its old address
    assert kv.chunk_of_slot(0) is not act_chunk
    kv.page_view(0).fill_(0x11)
    assert torch.all(act == 0x55)
    assert torch.all(kv.page_view(0) == 0x11)
    vmm.unmap(act_range, 0)
    vmm.release(act_range)
    pool.release(Owner.ACTIVATION, [act_chunk])
    kv.close()
    pool.check_invariants()


def test_threads_sharing_slots(vmm):
    pool = ChunkPool(vmm, 8)
    kv = KVETensor(pool, PB, 32, dtype=torch.int32)
    errors = []

    def worker(k):  # thread k owns pages k, k+4, ...: every slot is shared by all threads
        mine = list(range(k, 32, 4))
        try:
            for i in range(60):
                pages = mine[i % 8 :] + mine[: i % 8][:2]
                kv.ensure_mapped(pages)
                for p in pages:
                    kv.page_view(p).fill_(p)
                for p in pages:
                    assert torch.all(kv.page_view(p) == p)
                kv.free_pages(pages)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert kv.live_pages == 0 and kv.mapped_chunks == 0
    kv.check_invariants()
    pool.check_invariants()
    kv.close()


NUM_PAGES = 22  # 6 slots, the last one partial
PAGES = st.lists(st.integers(0, NUM_PAGES - 1), max_size=6)


class KVMachine(RuleBasedStateMachine):
    """Random ensure_mapped/free_pages with a stamp written into each live page."""

    def __init__(self):
        super().__init__()
        self.vmm = host_backend(G)
        self.pool = ChunkPool(self.vmm, 5)
        self.kv = KVETensor(self.pool, PB, NUM_PAGES, dtype=torch.int32)
        self.stamps = {}  # live page -> its value
        self.next_stamp = 1
        self.other = []  # chunks held by another owner, to compete for the pool

    def teardown(self):
        self.kv.close()
        self.vmm.close()

    def _slots(self, pages):
        return {p // self.kv.pages_per_slot for p in pages}

    @rule(pages=PAGES)
    def ensure(self, pages):
        mapped = {s for s in range(self.kv.num_slots) if self.kv.chunk_of_slot(s) is not None}
        need = len(self._slots(pages) - mapped)
        if need > self.pool.available():
            with pytest.raises(PoolExhausted):
                self.kv.ensure_mapped(pages)
            return
        self.kv.ensure_mapped(pages)
        for p in pages:
            if p not in self.stamps:
                self.stamps[p] = self.next_stamp
                self.next_stamp += 1
                self.kv.page_view(p).fill_(self.stamps[p])

    @rule(data=st.data())
    def free(self, data):
        if not self.stamps:
            return
        pages = data.draw(st.lists(st.sampled_from(sorted(self.stamps)), unique=True, max_size=6))
        returned = self.kv.free_pages(pages)
        for p in pages:
            del self.stamps[p]
        emptied = self._slots(pages) - self._slots(self.stamps)
        assert returned == len(emptied)

    @rule(n=st.integers(1, 2))
    def other_owner_takes(self, n):
        if n <= self.pool.available():
            chunks = self.pool.acquire(Owner.ACTIVATION, n)
            r = self.vmm.reserve(G)  # scribble on them through another mapping
            for c in chunks:
                self.vmm.map(r, 0, c)
                self.vmm.tensor_view(r, 0, G).fill_(0x7F)
                self.vmm.unmap(r, 0)
            self.vmm.release(r)
            self.other += chunks

    @rule()
    def other_owner_returns(self):
        self.pool.release(Owner.ACTIVATION, self.other)
        self.other = []

    @invariant()
    def intact(self):
        self.kv.check_invariants()
        self.pool.check_invariants()
        assert self.kv.live_pages == len(self.stamps)
        assert self.kv.mapped_chunks == len(self._slots(self.stamps)) == self.pool.usage()[Owner.KV]
        full = self.kv.view(torch.int32)
        for p, value in self.stamps.items():
            assert torch.all(self.kv.page_view(p) == value), f"page {p} lost its data"
            assert torch.all(full[p] == value)


KVMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
test_kv_machine = KVMachine.TestCase
