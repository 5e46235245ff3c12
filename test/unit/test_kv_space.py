"""The engine-free KV space (``memory_ext.pool.kv_space``) with a free list that is a plain Python
list: no engine, no torch in the space; its invariant and its grow / shrink rules."""

from __future__ import annotations

import pytest

from memory_ext.policy.activation import ActivationProfile
from memory_ext.pool import ChunkPool, LayeredKVBuffers
from memory_ext.pool.activation_balloon import ActivationBalloon
from memory_ext.pool.kv_space import KVSpace
from memory_ext.vmm import host_backend

CHUNK = 4096
ROW = 64  # bytes per token row per buffer -> 64 rows per chunk, a group of 64 rows is 4 chunks


class ListFreeList:
    """``FreeListOps`` over ``Engine``: a list of free pages and a list of staged frees."""

    def count(self, e) -> int:
        return len(e.free) + len(e.staged)

    def append_ranges(self, e, ranges):
        for start, end in ranges:
            e.free.extend(range(start, end))

    def drop_groups(self, e, groups, group_pages):
        e.free = [p for p in e.free if p // group_pages not in set(groups)]

    def reset(self, e, start, end):
        e.free, e.staged = list(range(start, end)), []

    def free_per_group(self, e, group_pages, num_groups):
        e.free, e.staged = sorted(e.free + e.staged), []
        counts = [0] * num_groups
        for p in e.free:
            counts[p // group_pages] += 1
        return counts

    def counts_per_group(self, e, group_pages, num_groups):
        counts = [0] * num_groups
        for p in e.free + e.staged:
            counts[p // group_pages] += 1
        return counts

    def groups_with_free_pages(self, e, group_pages):
        return sorted({p // group_pages for p in e.free + e.staged})


class Engine:
    """A toy engine: takes pages from the front of its free list, stages what it frees."""

    def __init__(self):
        self.free: list[int] = []
        self.staged: list[int] = []

    def alloc(self, n):
        if n > len(self.free):
            self.free, self.staged = sorted(self.free + self.staged), []
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, pages):
        self.staged.extend(pages)


def make(num_pages=255, capacity_chunks=1000, page_size=1, spare=0):
    pool = ChunkPool(host_backend(CHUNK), capacity_chunks)
    buffers = LayeredKVBuffers(pool, [ROW] * 4, num_pages * page_size + page_size, page_size)
    space = KVSpace(buffers, page_size, num_pages, ListFreeList(), spare_groups=spare)
    engine = Engine()
    space.restrict_free_list(engine)
    return space, engine, pool


def test_the_free_list_starts_with_group_zero_and_grows_group_by_group():
    space, engine, _ = make()
    assert space.group_pages == 64 and space.num_groups == 4
    assert engine.free == list(range(1, 64)) and space.buffers.mapped_groups() == [0]
    assert space.grow(engine, 100) == 1 and len(engine.free) == 63 + 64
    assert space.map_calls == {"request": 1, "premap": 0}
    assert space.refill(engine, 200) == 2 and space.map_calls["premap"] == 2
    assert space.growable_pages() == 0 and space.logical_free_pages(engine) == 255
    space.check(engine)


def test_the_last_group_is_partial_and_growable_pages_say_so():
    space, engine, _ = make(num_pages=200)  # groups 0..3, the last one holds pages 192..200
    assert space.num_groups == 4 and space.usable_pages(3) == 9
    assert space.growable_pages() == 64 + 64 + 9
    space.grow(engine, 1000)
    assert sorted(engine.free) == list(range(1, 201))


def test_shrink_unmaps_only_empty_groups_highest_first_keeping_spares():
    space, engine, _ = make(spare=1)
    space.grow(engine, 255)
    held = engine.alloc(63 + 64 + 10)  # groups 0 and 1 full, 10 pages of group 2
    assert space.shrink(engine) == 0  # group 3 is empty but it is the spare
    assert space.shrink(engine, spare_groups=0) == 1 and space.buffers.mapped_groups() == [0, 1, 2]
    engine.release(held[63:])  # groups 1 and 2 empty again (staged: merged by the scan)
    assert space.empty_groups(engine) == [2, 1]
    assert space.shrink(engine, spare_groups=0) == 2 and space.buffers.mapped_groups() == [0]
    assert space.unmap_calls == {"request": 3, "tick": 0}
    space.check(engine)
    assert space.shrink(engine, spare_groups=0) == 0  # group 0 is never unmapped


def test_emptiable_groups_count_what_eviction_could_empty():
    space, engine, _ = make()
    space.grow(engine, 255)
    engine.alloc(63 + 64 + 30)  # group 1 full, group 2 holds 30 pages, group 3 empty
    assert space.emptiable_groups(engine, 0) == 1
    assert space.emptiable_groups(engine, 30) == 2 and space.emptiable_groups(engine, 94) == 3


def test_emptiable_groups_count_staged_frees_without_merging_them():
    space, engine, _ = make()
    space.grow(engine, 255)
    taken = engine.alloc(63 + 64 + 30)  # group 1 full, group 2 holds 30 pages, group 3 empty
    engine.release(taken[126:])  # group 1's last page and group 2's 30: staged, not merged
    assert len(engine.staged) == 31
    assert space.emptiable_groups(engine, 0) == 2  # groups 2 and 3 are all free, staged frees counted
    assert space.emptiable_groups(engine, 63) == 3
    assert len(engine.staged) == 31  # a count: the engine's staged frees stay as they were
    assert space.empty_groups(engine) == [3, 2] and engine.staged == []  # the shrink path merges


def test_the_pool_bounds_growth_and_a_refusal_maps_fewer_groups():
    space, engine, pool = make(capacity_chunks=12)  # 3 groups of 4 chunks: group 0 and two more
    assert space.affordable_groups() == 2 and space.growable_pages() == 128
    assert space.grow(engine, 255) == 2 and space.buffers.mapped_groups() == [0, 1, 2]
    assert pool.available() == 0 and space.growable_pages() == 0


def test_idle_activation_is_lent_when_kv_grows_but_not_what_the_next_step_keeps():
    space, engine, pool = make(capacity_chunks=16)  # group 0 + 3 groups = 16 chunks
    balloon = ActivationBalloon(pool, ActivationProfile(per_token_bytes=CHUNK))
    space.activation = balloon
    assert balloon.reserve(8, 1, lambda: 0, lambda n: 0) and balloon.live == 8
    balloon.end_iteration()  # idle now: 8 chunks held, none live
    assert space.affordable_groups(free_only=True) == 1 and space.affordable_groups() == 3
    assert space.affordable_groups(keep_activation=8) == 1
    assert space.refill(engine, 255, keep_activation=8) == 1 and balloon.held == 8  # the premap keeps them
    assert space.grow(engine, 255) == 2 and balloon.held == 0  # the request path takes them


def test_note_forward_counts_a_decode_steps_request_path_maps_and_unmaps():
    space, engine, _ = make()
    space.grow(engine, 100)
    space.note_forward(decode=True)
    space.refill(engine, 200)  # the premap's maps are not the decode step's
    space.note_forward(decode=True)
    stats = space.status()
    assert stats["decode_steps"] == 2 and stats["decode_map_calls"] == 1 and stats["decode_steps_with_map"] == 1


def test_bad_geometry_is_refused_naming_it():
    pool = ChunkPool(host_backend(CHUNK), 100)
    buffers = LayeredKVBuffers(pool, [ROW] * 4, 257, 1)
    with pytest.raises(ValueError, match="page_size"):
        KVSpace(buffers, 3, 80, ListFreeList())
    with pytest.raises(ValueError, match="groups needed"):
        KVSpace(buffers, 1, 1000, ListFreeList())


def test_a_free_page_outside_the_mapped_groups_fails_the_check():
    space, engine, _ = make()
    engine.free.append(200)  # group 3, unmapped
    with pytest.raises(AssertionError, match="unmapped groups"):
        space.check(engine)
