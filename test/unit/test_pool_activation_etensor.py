"""memory_ext.pool.activation_etensor: best fit, coalescing, freed slots stay mapped, lazy shrink."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from memory_ext.pool import ActivationETensor, ChunkPool, Owner, PoolExhausted
from memory_ext.vmm import host_backend

PAGE = os.sysconf("SC_PAGE_SIZE")
G = PAGE


@pytest.fixture
def vmm():
    backend = host_backend(G)
    yield backend
    backend.close()


def test_best_fit_and_coalescing(vmm):
    pool = ChunkPool(vmm, 16)
    arena = ActivationETensor(pool, 10 * G)
    a = arena.alloc(2 * G)
    b = arena.alloc(G + 1)  # rounds up to 2 slots
    c = arena.alloc(G)
    d = arena.alloc(3 * G)
    assert [x.start_slot for x in (a, b, c, d)] == [0, 2, 4, 5]
    arena.free(a)  # extent (0, 2)
    arena.free(c)  # extent (4, 1); plus the tail (8, 2)
    assert arena.free_extents() == [(0, 2), (4, 1), (8, 2)]
    e = arena.alloc(1)  # best fit: the 1-slot hole
    assert e.start_slot == 4
    f = arena.alloc(2 * G)  # two 2-slot holes: lowest address wins
    assert f.start_slot == 0
    arena.free(b)
    arena.free(e)  # 2,3 + 4 coalesce into (2, 3)
    assert arena.free_extents() == [(2, 3), (8, 2)]
    arena.free(d)  # 2..7 + 8..9 coalesce
    assert arena.free_extents() == [(2, 8)]
    with pytest.raises(ValueError, match=r"needs 9 contiguous slot\(s\); the largest free extent has 8"):
        arena.alloc(9 * G)
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(d)
    arena.check_invariants()
    arena.close()
    pool.check_invariants()


def test_freed_slots_stay_mapped_and_shrink_returns_them(vmm):
    pool = ChunkPool(vmm, 8)
    arena = ActivationETensor(pool, 8 * G)
    a = arena.alloc(3 * G)
    arena.tensor(a).fill_(9)
    maps = vmm.counters()["map_calls"]
    arena.free(a)
    assert arena.mapped_chunks == 3 and arena.idle_mapped_chunks == 3
    assert pool.usage()[Owner.ACTIVATION] == 3
    b = arena.alloc(2 * G)  # reuses mapped slots: no map call, no pool traffic
    assert vmm.counters()["map_calls"] == maps and pool.usage()[Owner.ACTIVATION] == 3
    assert arena.idle_mapped_chunks == 1
    assert arena.shrink() == 1  # only slot 2 is idle
    assert pool.usage()[Owner.ACTIVATION] == 2 and pool.usage()[Owner.FREE] == 1
    arena.free(b)
    assert arena.shrink(1) == 1 and arena.mapped_chunks == 1
    assert arena.shrink() == 1 and arena.mapped_chunks == 0
    assert pool.usage()[Owner.ACTIVATION] == 0
    arena.check_invariants()
    pool.check_invariants()
    arena.close()


def test_exhaustion_is_all_or_nothing(vmm):
    pool = ChunkPool(vmm, 3)
    arena = ActivationETensor(pool, 8 * G)
    a = arena.alloc(2 * G)
    with pytest.raises(PoolExhausted, match=r"owner ACTIVATION requested 2 chunk\(s\), 1 available"):
        arena.alloc(2 * G)
    assert arena.free_extents() == [(2, 6)] and arena.mapped_chunks == 2
    arena.free(a)
    b = arena.alloc(3 * G)  # two mapped + one new
    assert b.start_slot == 0 and pool.usage()[Owner.ACTIVATION] == 3
    arena.check_invariants()
    pool.check_invariants()
    arena.close()


SIZES = st.integers(1, 4 * G)


class ArenaMachine(RuleBasedStateMachine):
    """Random alloc/free/shrink with each block's data checked until it is freed."""

    def __init__(self):
        super().__init__()
        self.vmm = host_backend(G)
        self.pool = ChunkPool(self.vmm, 10)
        self.arena = ActivationETensor(self.pool, 12 * G)
        self.blocks = {}  # block_id -> (block, stamp)
        self.stamp = 0

    def teardown(self):
        self.arena.close()
        self.vmm.close()

    @rule(nbytes=SIZES)
    def alloc(self, nbytes):
        n = -(-nbytes // G)
        fits = [(s, l) for s, l in self.arena.free_extents() if l >= n]
        if not fits:
            with pytest.raises(ValueError, match="contiguous"):
                self.arena.alloc(nbytes)
            return
        start = min(fits, key=lambda e: (e[1], e[0]))[0]  # best fit, then lowest address
        mapped = self.vmm.mapped_slots(self.arena.vrange)
        missing = sum(1 for s in range(start, start + n) if s * G not in mapped)
        if missing > self.pool.available():
            with pytest.raises(PoolExhausted):
                self.arena.alloc(nbytes)
            return
        block = self.arena.alloc(nbytes)
        assert block.start_slot == start
        self.stamp = self.stamp % 250 + 1
        self.arena.tensor(block).fill_(self.stamp)
        self.blocks[block.block_id] = (block, self.stamp)

    @rule(data=st.data())
    def free(self, data):
        if self.blocks:
            bid = data.draw(st.sampled_from(sorted(self.blocks)))
            block, _ = self.blocks.pop(bid)
            self.arena.free(block)

    @rule(n=st.none() | st.integers(0, 3))
    def shrink(self, n):
        idle = self.arena.idle_mapped_chunks
        assert self.arena.shrink(n) == (idle if n is None else min(n, idle))

    @invariant()
    def intact(self):
        self.arena.check_invariants()
        self.pool.check_invariants()
        assert self.pool.usage()[Owner.ACTIVATION] == self.arena.mapped_chunks
        for block, stamp in self.blocks.values():
            assert torch.all(self.arena.tensor(block) == stamp)


ArenaMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
test_arena_machine = ArenaMachine.TestCase
