"""memory_ext.pool.ownership: one owner per chunk, floors, ceilings, conservation."""

import os
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from memory_ext.pool import CeilingExceeded, ChunkPool, FloorViolation, Owner, OwnershipError, PoolError, PoolExhausted
from memory_ext.vmm import host_backend

PAGE = os.sysconf("SC_PAGE_SIZE")
G = PAGE
USERS = [o for o in Owner if o is not Owner.FREE]


@pytest.fixture
def vmm():
    backend = host_backend(G)
    yield backend
    backend.close()


def test_lazy_creation_and_reuse(vmm):
    pool = ChunkPool(vmm, 4)
    assert pool.chunks_created == 0 and pool.available() == 4
    a = pool.acquire(Owner.KV, 2)
    assert pool.chunks_created == 2 and vmm.counters()["chunks_created"] == 2
    pool.release(Owner.KV, a)
    b = pool.acquire(Owner.ACTIVATION, 2)
    assert {c.handle_id for c in b} == {c.handle_id for c in a}  # reused, not created
    assert vmm.counters()["chunks_created"] == 2
    assert pool.usage()[Owner.ACTIVATION] == 2 and pool.usage()[Owner.FREE] == 0
    pool.release(Owner.ACTIVATION, b[:1])
    pool.release(Owner.ACTIVATION, b[1:])
    assert pool.acquire(Owner.KV, 1) == b[1:]  # most recently freed (warm) first
    pool.check_invariants()


def test_exhausted_is_all_or_nothing_and_names_owner(vmm):
    pool = ChunkPool(vmm, 3)
    pool.acquire(Owner.WEIGHTS, 2)
    before = pool.usage()
    with pytest.raises(PoolExhausted, match=r"owner KV requested 2 chunk\(s\), 1 available") as info:
        pool.acquire(Owner.KV, 2)
    assert (info.value.owner, info.value.requested, info.value.available) == (Owner.KV, 2, 1)
    assert pool.usage() == before
    pool.check_invariants()


def test_ceiling(vmm):
    pool = ChunkPool(vmm, 8, ceilings={Owner.KV: 3})
    pool.acquire(Owner.KV, 2)
    with pytest.raises(CeilingExceeded, match=r"owner KV holds 2 chunk\(s\), requested 2 more, ceiling 3"):
        pool.acquire(Owner.KV, 2)
    act = pool.acquire(Owner.ACTIVATION, 2)
    with pytest.raises(CeilingExceeded, match="owner KV"):
        pool.transfer(act, Owner.ACTIVATION, Owner.KV)
    pool.transfer(act[:1], Owner.ACTIVATION, Owner.KV)
    assert pool.usage()[Owner.KV] == 3
    pool.check_invariants()


def test_floor_reserves_headroom_and_limits_transfer(vmm):
    pool = ChunkPool(vmm, 4, floors={Owner.KV: 2})
    with pytest.raises(PoolExhausted, match=r"2 more held back for other owners' floors") as info:
        pool.acquire(Owner.ACTIVATION, 3)
    assert info.value.reserved == 2
    act = pool.acquire(Owner.ACTIVATION, 2)
    kv = pool.acquire(Owner.KV, 2)  # the reserved headroom is still there
    with pytest.raises(FloorViolation, match=r"owner KV holds 2 chunk\(s\), transfer of 1 .* floor 2"):
        pool.transfer(kv[:1], Owner.KV, Owner.ACTIVATION)
    pool.transfer(act, Owner.ACTIVATION, Owner.KV)  # ACTIVATION has no floor
    pool.release(Owner.KV, kv)  # release below/at floor by the owner itself is allowed
    assert pool.usage()[Owner.KV] == 2
    pool.check_invariants()


def test_release_wrong_owner_or_twice_or_mapped(vmm):
    pool = ChunkPool(vmm, 4)
    kv = pool.acquire(Owner.KV, 2)
    with pytest.raises(OwnershipError, match=f"{kv[0]} is owned by KV, not by WEIGHTS"):
        pool.release(Owner.WEIGHTS, kv[:1])
    with pytest.raises(OwnershipError, match="listed twice"):
        pool.release(Owner.KV, [kv[0], kv[0]])
    r = vmm.reserve(G)
    vmm.map(r, 0, kv[1])
    with pytest.raises(OwnershipError, match="still mapped"):
        pool.release(Owner.KV, kv)
    assert pool.usage()[Owner.KV] == 2  # nothing released (all or nothing)
    vmm.unmap(r, 0)
    pool.release(Owner.KV, kv)
    with pytest.raises(OwnershipError, match="owned by FREE, not by KV"):
        pool.release(Owner.KV, kv[:1])
    other = host_backend(G)
    try:
        foreign = other.create_chunk()
        with pytest.raises(OwnershipError, match="does not belong to this pool"):
            pool.release(Owner.KV, [foreign])
    finally:
        other.close()
    vmm.release(r)
    pool.check_invariants()


def test_bad_arguments(vmm):
    with pytest.raises(ValueError, match=r"floors\[KV\] = 3 is above ceilings\[KV\] = 2"):
        ChunkPool(vmm, 8, floors={Owner.KV: 3}, ceilings={Owner.KV: 2})
    with pytest.raises(ValueError, match="floors sum to 9, above capacity_chunks 8"):
        ChunkPool(vmm, 8, floors={Owner.KV: 5, Owner.WEIGHTS: 4})
    with pytest.raises(ValueError, match="FREE"):
        ChunkPool(vmm, 8, floors={Owner.FREE: 1})
    pool = ChunkPool(vmm, 2)
    with pytest.raises(ValueError, match="owner must not be Owner.FREE"):
        pool.acquire(Owner.FREE, 1)
    with pytest.raises(ValueError, match="n must be non-negative"):
        pool.acquire(Owner.KV, -1)
    with pytest.raises(ValueError, match="both KV"):
        pool.transfer([], Owner.KV, Owner.KV)
    assert pool.acquire(Owner.KV, 0) == []


def test_transfer_keeps_mappings(vmm):
    pool = ChunkPool(vmm, 2)
    (c,) = pool.acquire(Owner.KV, 1)
    r = vmm.reserve(G)
    vmm.map(r, 0, c)
    vmm.tensor_view(r, 0, G).fill_(7)
    calls = vmm.counters()
    pool.transfer([c], Owner.KV, Owner.PEER_DONATION)
    assert vmm.counters()["map_calls"] == calls["map_calls"]
    assert vmm.counters()["unmap_calls"] == calls["unmap_calls"]
    assert pool.owner_of(c) is Owner.PEER_DONATION
    assert vmm.mappings_of(c) == [(r, 0)]
    assert int(vmm.tensor_view(r, 0, G)[0]) == 7
    vmm.unmap(r, 0)
    vmm.release(r)
    pool.release(Owner.PEER_DONATION, [c])
    pool.check_invariants()


def test_trim_and_close(vmm):
    pool = ChunkPool(vmm, 4)
    kv = pool.acquire(Owner.KV, 3)
    pool.release(Owner.KV, kv[:2])
    assert pool.trim(1) == 1 and pool.chunks_created == 2
    pool.check_invariants()
    with pytest.raises(PoolError, match="chunks still owned.*KV: 1"):
        pool.close()
    pool.release(Owner.KV, kv[2:])
    pool.close()
    assert pool.chunks_created == 0 and len(vmm.live_chunks()) == 0
    pool.check_invariants()


def test_threads_conserve(vmm):
    pool = ChunkPool(vmm, 16)
    errors = []

    def worker(owner):
        try:
            for _ in range(200):
                try:
                    got = pool.acquire(owner, 3)
                except PoolExhausted:
                    continue
                pool.release(owner, got)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(o,)) for o in USERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.usage()[Owner.FREE] == pool.chunks_created <= 16
    pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random acquire/release/transfer against a model of who owns what."""

    def __init__(self):
        super().__init__()
        self.vmm = host_backend(G)
        self.capacity = 10
        self.floors = {Owner.KV: 2, Owner.WEIGHTS: 1}
        self.ceilings = {Owner.ACTIVATION: 4, Owner.KV: 8}
        self.pool = ChunkPool(self.vmm, self.capacity, self.floors, self.ceilings)
        self.model = {o: set() for o in USERS}

    def teardown(self):
        self.vmm.close()

    def _reserved_for_others(self, owner):
        return sum(max(0, f - len(self.model[o])) for o, f in self.floors.items() if o is not owner)

    @rule(owner=st.sampled_from(USERS), n=st.integers(0, 5))
    def acquire(self, owner, n):
        held = sum(len(s) for s in self.model.values())
        ceiling = self.ceilings.get(owner)
        if ceiling is not None and len(self.model[owner]) + n > ceiling:
            with pytest.raises(CeilingExceeded):
                self.pool.acquire(owner, n)
        elif n > self.capacity - held - self._reserved_for_others(owner):
            with pytest.raises(PoolExhausted):
                self.pool.acquire(owner, n)
        else:
            got = self.pool.acquire(owner, n)
            ids = {c.handle_id for c in got}
            assert len(ids) == n
            for s in self.model.values():
                assert not (s & ids)
            self.model[owner] |= ids

    @rule(owner=st.sampled_from(USERS), data=st.data())
    def release(self, owner, data):
        mine = self.pool.chunks_of(owner)
        picked = data.draw(st.lists(st.sampled_from(mine), unique_by=lambda c: c.handle_id) if mine else st.just([]))
        self.pool.release(owner, picked)
        self.model[owner] -= {c.handle_id for c in picked}

    @rule(src=st.sampled_from(USERS), dst=st.sampled_from(USERS), data=st.data())
    def transfer(self, src, dst, data):
        mine = self.pool.chunks_of(src)
        picked = data.draw(st.lists(st.sampled_from(mine), unique_by=lambda c: c.handle_id) if mine else st.just([]))
        ids = {c.handle_id for c in picked}
        if src is dst:
            with pytest.raises(ValueError):
                self.pool.transfer(picked, src, dst)
        elif len(self.model[src]) - len(ids) < self.floors.get(src, 0):
            with pytest.raises(FloorViolation):
                self.pool.transfer(picked, src, dst)
        elif dst in self.ceilings and len(self.model[dst]) + len(ids) > self.ceilings[dst]:
            with pytest.raises(CeilingExceeded):
                self.pool.transfer(picked, src, dst)
        else:
            self.pool.transfer(picked, src, dst)
            self.model[src] -= ids
            self.model[dst] |= ids

    @rule(owner=st.sampled_from(USERS), data=st.data())
    def release_foreign(self, owner, data):
        others = [c for o in USERS if o is not owner for c in self.pool.chunks_of(o)]
        if others:
            c = data.draw(st.sampled_from(others))
            with pytest.raises(OwnershipError, match=f"not by {owner}"):
                self.pool.release(owner, [c])

    @rule(n=st.integers(0, 3))
    def trim(self, n):
        self.pool.trim(n)

    @invariant()
    def conserved(self):
        self.pool.check_invariants()
        use = self.pool.usage()
        for o in USERS:
            assert use[o] == len(self.model[o])
            assert {c.handle_id for c in self.pool.chunks_of(o)} == self.model[o]
        assert sum(use.values()) == self.pool.chunks_created == len(self.vmm.live_chunks())


PoolMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
test_pool_machine = PoolMachine.TestCase
