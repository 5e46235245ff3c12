"""``host_buffer.fetch_parked``: every parked waiting request the next prefill batch could admit
gets its KV back on the device and pinned, in queue order, until the first one that does not fit
(memory with the kept ones' reservations, request slots, prefill tokens); pins of the others go.

Against upstream's RadixKey / MatchPrefixParams / EvictParams, a small fake radix tree (whole
paths, locks counted) and a fake allocator over a real KV tensor."""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictResult

from sglang_memx.config import MemxConfig
from sglang_memx.coordinator.components import NoActivation
from sglang_memx.elastic import host_buffer
from sglang_memx.elastic.host_buffer import build_host_buffer, fetch_parked
from support.fakes import FakeReq, FakeScheduler

SLOTS, WIDTH = 256, 4
PROMPT, OUTPUTS, MAX_NEW = 8, 1, 16
NEED = MAX_NEW - OUTPUTS + 2  # a kept request's own reservation: remaining max_new + 2 pages (page 1)


class FakeAllocator:
    page_size = 1

    def __init__(self, free: int):
        self.k = torch.zeros(SLOTS, WIDTH)
        self.v = torch.zeros(SLOTS, WIDTH)
        self.free_slots = list(range(1, free + 1))
        self.allocs: list[list[int]] = []

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        self.allocs.append(out)
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx):
        self.free_slots += [int(i) for i in idx]

    def get_kvcache(self):
        return types.SimpleNamespace(k_buffer=[self.k], v_buffer=[self.v])


class FakeTree:
    """Paths stored whole: tokens -> [slots, locks]; a match is the longest stored path that is a
    prefix of the key; eviction takes unlocked paths, oldest first."""

    def __init__(self, allocator: FakeAllocator):
        self.allocator = allocator
        self.paths: dict[tuple, list] = {}

    def supports_prefix_sharing(self):
        return True

    def evictable_size(self):
        return sum(len(p) for p, (_, locks) in self.paths.items() if locks == 0)

    def match_prefix(self, params):
        tokens = tuple(params.key.raw_token_ids())
        best = max((p for p in self.paths if tokens[: len(p)] == p), key=len, default=())
        return types.SimpleNamespace(device_prefix_len=len(best), last_device_node=best or None)

    def insert(self, params):
        self.paths[tuple(params.key.raw_token_ids())] = [params.value, 0]

    def lock(self, node):
        self.paths[node][1] += 1
        return node

    def unlock(self, node):
        self.paths[node][1] -= 1

    def evict(self, params):
        gone = 0
        for path in [p for p, (_, locks) in self.paths.items() if locks == 0]:
            if gone >= params.num_tokens:
                break
            self.allocator.free(self.paths.pop(path)[0])
            gone += len(path)
        return EvictResult(num_tokens_evicted=gone)

    def locked(self) -> set:
        return {p for p, (_, locks) in self.paths.items() if locks > 0}


def _parked(host, rid: str, first_token: int, max_new: int = MAX_NEW):
    """A waiting request whose first ``PROMPT`` tokens' KV is parked (rows filled with its number)."""
    req = FakeReq(prompt=PROMPT, outputs=OUTPUTS, max_new=max_new, rid=rid)
    req.origin_input_ids = list(range(first_token, first_token + PROMPT))
    rows = [torch.full((PROMPT, WIDTH), float(first_token)) for _ in range(2)]
    assert host.buffer.park(rid, req.origin_input_ids, rows)
    return req


def _setup(free: int, reqs=(("a", 100), ("b", 200)), **sched):
    host = build_host_buffer(MemxConfig(elastic_kv=True, host_buffer_gb=0.001), 4096)
    allocator = FakeAllocator(free)
    tree = FakeTree(allocator)
    waiting = [_parked(host, rid, first) for rid, first in reqs]
    scheduler = FakeScheduler(waiting=waiting, allocator=allocator, tree=tree, **sched)
    return host, allocator, tree, scheduler, waiting


def _fetch(host, scheduler, reserve=0):
    kv = types.SimpleNamespace(buffers=types.SimpleNamespace(chunks_per_group=1, group_rows=1))
    return fetch_parked(kv, host, NoActivation(), scheduler, reserve)


def _path(req):
    return tuple(req.origin_input_ids)


def test_two_parked_requests_are_both_fetched_and_pinned_when_both_fit():
    host, allocator, tree, scheduler, (a, b) = _setup(free=64)
    assert _fetch(host, scheduler) == 2
    assert set(host.pins) == {"a", "b"} and tree.locked() == {_path(a), _path(b)}
    assert host.buffer.stats["fetched"] == 2
    for req, first in ((a, 100), (b, 200)):  # each one's rows are back in its slots
        slots = tree.paths[_path(req)][0]
        assert torch.equal(allocator.k[slots], torch.full((PROMPT, WIDTH), float(first)))
    assert _fetch(host, scheduler) == 2 and host.buffer.stats["fetched"] == 2  # pinned: nothing copied again


def test_fetches_follow_the_queue_order():
    host, allocator, tree, scheduler, (b, a) = _setup(free=64, reqs=(("b", 200), ("a", 100)))
    assert _fetch(host, scheduler) == 2
    assert [tree.paths[_path(r)][0].tolist() for r in (b, a)] == allocator.allocs  # b's slots first


def test_the_second_is_not_fetched_nor_pinned_when_only_one_fits():
    # a: 40 free >= NEED; fetched, 32 free; b: 32 - a's reservation (17) < NEED
    host, allocator, tree, scheduler, (a, b) = _setup(free=40)
    assert _fetch(host, scheduler) == 1
    assert set(host.pins) == {"a"} and tree.locked() == {_path(a)}
    assert _path(b) not in tree.paths and host.buffer.stats["fetched"] == 1
    assert "b" in host.buffer  # its entry waits for the next pass


def test_a_pin_the_next_batch_no_longer_covers_is_released():
    host, allocator, tree, scheduler, (a, b) = _setup(free=64)
    assert _fetch(host, scheduler) == 2  # both pinned; 48 free now
    # the running requests' reservation grew: a still fits (48 + its and b's pinned 16 - 30 >= 17),
    # b no longer does once a's reservation counts (48 + its 8 - 30 - 17 < 17)
    assert _fetch(host, scheduler, reserve=30) == 1
    assert set(host.pins) == {"a"} and tree.locked() == {_path(a)}
    assert tree.evictable_size() == PROMPT  # b's KV stays cached, evictable
    assert _fetch(host, scheduler, reserve=0) == 2 and host.buffer.stats["fetched"] == 2  # found cached again


def test_no_request_behind_one_that_does_not_fit_is_fetched():
    """First come, first served: a small parked request never passes a big one ahead of it."""
    host = build_host_buffer(MemxConfig(elastic_kv=True, host_buffer_gb=0.001), 4096)
    allocator = FakeAllocator(64)
    tree = FakeTree(allocator)
    big, small = _parked(host, "big", 100, max_new=200), _parked(host, "small", 200)
    scheduler = FakeScheduler(waiting=[big, small], allocator=allocator, tree=tree)
    assert _fetch(host, scheduler) == 0
    assert host.pins == {} and tree.paths == {} and host.buffer.stats["fetched"] == 0
    scheduler.waiting_queue = [small, big]
    assert _fetch(host, scheduler) == 1 and set(host.pins) == {"small"}


def test_a_waiting_request_without_parked_kv_is_passed_over():
    host, allocator, tree, scheduler, (a, b) = _setup(free=64)
    scheduler.waiting_queue = [FakeReq(rid="new"), a, FakeReq(rid="new2"), b]
    assert _fetch(host, scheduler) == 2 and set(host.pins) == {"a", "b"}


@pytest.mark.parametrize(
    "sched,expected",
    [
        ({"max_running": 1}, 1),  # one request slot left: one request
        ({"max_running": 2}, 2),
        ({"max_prefill_tokens": 1}, 1),  # each resumes with 1 new token; the first is admitted whole
        ({"max_prefill_tokens": 2}, 1),  # chunking off: the next must fit strictly below what is left
        ({"max_prefill_tokens": 3}, 2),
        ({"max_prefill_tokens": 1, "chunked_prefill_size": 16}, 1),  # the input budget is spent
        ({"max_prefill_tokens": 2, "chunked_prefill_size": 16}, 2),
        ({"chunked_prefill_size": 1}, 1),  # the chunk is spent by the first
    ],
)
def test_no_more_than_one_prefill_batch_would_admit_is_fetched(sched, expected):
    host, allocator, tree, scheduler, _ = _setup(free=256, reqs=(("a", 100), ("b", 200), ("c", 300)), **sched)
    assert _fetch(host, scheduler) == expected
    assert len(host.pins) == expected == host.buffer.stats["fetched"]


def test_a_chunked_prefill_under_way_takes_its_chunk_and_slot_first():
    host, allocator, tree, scheduler, _ = _setup(free=256, max_running=3, chunked_prefill_size=4)
    scheduler.chunked_req = FakeReq(prompt=20, allocated=16)  # its next chunk: its last 4 tokens
    assert _fetch(host, scheduler) == 1  # the chunk is spent; the first parked one still goes (memory only)
    scheduler.chunked_prefill_size = 8
    assert _fetch(host, scheduler) == 2
    scheduler.max_running = 2  # the chunked request holds one of the two slots
    assert _fetch(host, scheduler) == 1 and set(host.pins) == {"a"}


def test_entries_of_requests_that_left_the_queue_are_dropped_and_unpinned():
    host, allocator, tree, scheduler, (a, b) = _setup(free=64)
    assert _fetch(host, scheduler) == 2
    scheduler.waiting_queue = [b]  # a finished or was aborted
    assert _fetch(host, scheduler) == 1
    assert "a" not in host.buffer and set(host.pins) == {"b"} and tree.locked() == {_path(b)}


class HeldActivation(NoActivation):
    """An activation side holding ``held`` idle chunks (the running batch's decode step) while the
    head's next prefill needs ``head`` of them (one chunk is one KV token here)."""

    def __init__(self, held: int, head: int):
        self.held, self.head = held, head

    def held_chunks(self) -> int:
        return self.held

    def head_prefill_chunks(self, scheduler) -> int:
        return self.head


@pytest.mark.parametrize(
    "held, head, fetched",
    [
        (0, 0, 1),  # nothing held
        (32, 2, 1),  # the decode step's chunks are not kept out: prefill and decode forwards alternate
        (32, 32, 0),  # the next prefill's activation is: 40 free - 32 < its 8 tokens + a page
        (31, 31, 1),  # exactly its 8 tokens + a page left
    ],
)
def test_the_copy_leaves_room_for_the_next_prefills_activation_only(held, head, fetched):
    """Until 2026-12-03 every held chunk was kept out of the copy's room, the decode step's too, and
    upstream's admission (which keeps none out) then took the request and recomputed its prompt."""
    host, allocator, tree, scheduler, _ = _setup(free=40, reqs=(("a", 100),))
    kv = types.SimpleNamespace(buffers=types.SimpleNamespace(chunks_per_group=1, group_rows=1))
    assert fetch_parked(kv, host, HeldActivation(held, head), scheduler, 0) == fetched
    assert host.fetch_stopped["copy_room"] == 1 - fetched


class FragmentedKV:
    """A KV space with no FREE chunk whose groups empty only by evicting cached pages: every 8
    evictable pages empty one group (one chunk); pinned pages empty none, however many are free."""

    page_size = 1

    def __init__(self):
        self.buffers = types.SimpleNamespace(chunks_per_group=1, group_rows=1,
                                             pool=types.SimpleNamespace(available=lambda: 0))  # fmt: skip

    def emptiable_groups(self, allocator, evictable_pages: int) -> int:
        return evictable_pages // 8


@pytest.mark.parametrize("cached, fetched", [(16, 1), (8, 0)])
def test_a_pin_that_would_leave_the_heads_activation_no_group_is_not_taken(cached, fetched):
    """The head's next prefill needs 2 chunks more than the activation holds. Beside ``a``'s pinned
    prefix, other cached prefixes of 16 tokens can still empty 2 groups: ``a`` is kept; of 8, only
    1: pinning ``a`` would leave the head no activation (it would wait, and ``a`` behind it, for
    ever), so ``a`` is not kept and its KV stays cached, evictable (the host keeps its copy)."""
    host, allocator, tree, scheduler, (a,) = _setup(free=64, reqs=(("a", 100),))
    tree.paths[tuple(range(900, 900 + cached))] = [allocator.alloc(cached), 0]  # another cached prefix
    assert fetch_parked(FragmentedKV(), host, HeldActivation(0, 2), scheduler, 0) == fetched
    assert host.fetch_stopped["activation_room"] == 1 - fetched
    assert set(host.pins) == ({"a"} if fetched else set()) and _path(a) in tree.paths
    assert tree.locked() == ({_path(a)} if fetched else set()) and "a" in host.buffer


def test_a_request_whose_prompt_and_decode_do_not_both_fit_is_not_fetched():
    """The room a fetch asks is what upstream's admission would ask of the request recomputed: its
    prompt's KV (8) and its decode's (NEED), not its decode's alone."""
    host, allocator, tree, scheduler, _ = _setup(free=NEED + PROMPT - 1, reqs=(("a", 100),))
    assert _fetch(host, scheduler) == 0
    assert host.fetch_stopped["kv_room"] == 1 and tree.paths == {}
    host, allocator, tree, scheduler, _ = _setup(free=NEED + PROMPT, reqs=(("a", 100),))
    assert _fetch(host, scheduler) == 1


def test_an_admission_without_the_parked_kv_on_the_device_is_counted_as_recomputed():
    host, allocator, tree, scheduler, (a, b) = _setup(free=64)
    assert _fetch(host, scheduler) == 2
    a.prefix_len = PROMPT  # admitted with its fetched prefix: taken
    host_buffer.note_admitted(host, a, tree)
    b.prefix_len = 0
    host.pins.pop("b")  # as if the pass had not kept it
    host_buffer.note_admitted(host, b, tree)
    assert host.recomputed == {"not_fetched": 1, "partial_prefix": 0}
    assert host.status()["recomputed"] == host.recomputed and "fetch_stopped" in host.status()
    assert host.buffer.stats["restored"] == 1 and host.buffer.stats["dropped"] == 1


@pytest.mark.parametrize("cap,fetched", [(None, 2), (3, 2), (2, 1), (1, 0)])
def test_a_request_the_governor_would_not_let_in_is_not_fetched(cap, fetched):
    """With the governor, a parked request joins the fetch only if its batch decision (asked with the
    running batch and the ones kept before it, not counted) would let it in; the pass stops there."""
    from memory_ext.policy.governor import BatchGovernor, StepTimeModel
    from sglang_memx.coordinator.governor import GovernorPart

    running = [FakeReq(prompt=4, outputs=1)]
    host, allocator, tree, scheduler, _ = _setup(free=64, running=running)
    model = StepTimeModel(min_samples=2, use_kv=False)
    for batch in (1, 2, 3, 1, 2, 3):
        model.observe(batch, 0, 0.010 * batch)  # 10 ms a request
    part = GovernorPart(BatchGovernor(None if cap is None else 0.010 * cap + 1e-6, model))
    kv = types.SimpleNamespace(buffers=types.SimpleNamespace(chunks_per_group=1, group_rows=1))
    assert fetch_parked(kv, host, NoActivation(), scheduler, 0, part.would_admit) == fetched
    assert host.fetch_stopped["governor"] == (fetched < 2) and len(host.pins) == fetched
    assert sum(part.governor.counts.values()) == 0  # asked ahead of admission: not counted
