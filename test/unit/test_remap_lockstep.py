"""A restore of remappable weights on a shared pool (``weights.remap.apply``): one rank borrows its
shortfall from the arbiter at once; tensor parallel ranks (a ``LockstepLentPool``) borrow only in the
tick's "give back, borrow" step, so their restore asks that step (``take_restore_ask``) and is decided
again at the next tick on the FREE the ranks evened, then falls back to evicting KV as on one rank.
``shared_pool.balance`` keeps the ask out of its give-back and borrows it with the rest."""

from __future__ import annotations

import types

import pytest

from memory_ext.policy.oneiros import Action
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.weights import remap

CHUNKS_PER_GROUP = 4


class _Pool:
    def __init__(self, free: int):
        self.free = free

    def available(self) -> int:
        return self.free


class _Store:
    def __init__(self, pool: _Pool):
        self.pool, self.reserved = pool, 0

    def reserve(self, n: int) -> None:
        assert n <= self.pool.free
        self.pool.free -= n
        self.reserved += n


class _Pipeline:
    def __init__(self):
        self.requests = []

    def request(self, streamed, slots) -> None:
        self.requests.append((list(streamed), slots))

    def apply_if_idle(self) -> None:
        pass

    def pending(self):
        return None


def _link(kind: type, pool: _Pool):
    """A shared pool's link of ``kind`` (no arbiter): counts its borrows, a borrow lands in FREE."""

    class Link(kind):
        def __init__(self):  # no arbiter: only what ``apply`` calls
            self.borrows = []

        def borrow(self, n, wait=0.0):
            self.borrows.append(n)
            pool.free += n
            return n

    return Link()


def _weights_and_kv(free: int):
    pool = _Pool(free)
    w = types.SimpleNamespace(store=_Store(pool), pipeline=_Pipeline(), decisions={"remap": 0, "restore": 0, "hold": 0},
                              last_reason="restore", restore_ask_chunks=0, restore_ask_tried=False,
                              restore_asks=0)  # fmt: skip
    kv = types.SimpleNamespace(buffers=types.SimpleNamespace(pool=pool, chunks_per_group=CHUNKS_PER_GROUP))
    return w, kv, pool


@pytest.fixture
def need(monkeypatch):
    """Every restore below needs 10 chunks; evicting KV frees the groups asked (``free_groups``)."""
    evicted = []

    def free_groups(kv, allocator, tree, groups):
        evicted.append(groups)
        kv.buffers.pool.free += groups * CHUNKS_PER_GROUP
        return groups

    monkeypatch.setattr(remap, "chunks_needed", lambda w, streamed, slots: 10)
    monkeypatch.setattr(remap, "free_groups", free_groups)
    return evicted


def _restore(w, kv, lent) -> None:
    remap.apply(w, kv, None, None, None, lent, Action.RESTORE, ["layer1"], 1)


def test_one_rank_borrows_the_shortfall_at_once(need):
    w, kv, pool = _weights_and_kv(free=4)
    lent = _link(LentPool, pool)
    _restore(w, kv, lent)
    assert lent.borrows == [6] and w.store.reserved == 10 and w.pipeline.requests == [(["layer1"], 1)]
    assert w.restore_ask_chunks == w.restore_asks == 0 and need == []


def test_tensor_parallel_ranks_ask_the_next_tick_then_restore_from_what_it_borrowed(need):
    w, kv, pool = _weights_and_kv(free=4)
    lent = _link(LockstepLentPool, pool)
    _restore(w, kv, lent)
    assert lent.borrows == [] and w.store.reserved == 0 and w.pipeline.requests == []  # nothing changed here
    assert w.restore_ask_chunks == 6 and w.restore_asks == 1 and "borrow its memory in the next tick" in w.last_reason
    assert remap.take_restore_ask(w) == 6 and w.restore_ask_tried  # the tick's "give back, borrow"
    pool.free += 6  # what that step borrowed, evened across the ranks
    _restore(w, kv, lent)
    assert w.store.reserved == 10 and w.pipeline.requests == [(["layer1"], 1)] and w.decisions["restore"] == 1
    assert (w.restore_ask_chunks, w.restore_ask_tried) == (0, False) and need == [] and lent.borrows == []


def test_tensor_parallel_ranks_evict_kv_once_the_tick_borrowed_too_little(need):
    w, kv, pool = _weights_and_kv(free=4)
    lent = _link(LockstepLentPool, pool)
    _restore(w, kv, lent)
    remap.take_restore_ask(w)
    pool.free += 1  # the arbiter had one chunk
    _restore(w, kv, lent)
    assert need == [2]  # 5 short: two KV groups of 4 chunks, as one rank after its borrow
    assert w.store.reserved == 10 and (w.restore_ask_chunks, w.restore_ask_tried) == (0, False)


def test_no_ask_is_taken_when_no_restore_waits():
    w, _, _ = _weights_and_kv(free=0)
    assert remap.take_restore_ask(w) == 0 and not w.restore_ask_tried


def test_a_decision_other_than_restore_drops_the_ask(monkeypatch):
    w, kv, pool = _weights_and_kv(free=0)
    w.mode, w.sleeping, w.alpha, w.restore_ask_chunks, w.restore_ask_tried = "remap", False, 2, 6, True
    monkeypatch.setattr(remap.up_sched, "waiting", lambda scheduler: [object()])
    monkeypatch.setattr(remap.up_sched, "tree_cache", lambda scheduler: None)
    monkeypatch.setattr(remap, "decide", lambda *a: (Action.HOLD, [], 0))
    remap.step(w, kv, None, None, None, None)
    assert (w.restore_ask_chunks, w.restore_ask_tried) == (0, False) and w.decisions["hold"] == 1


@pytest.mark.parametrize("kind,borrows,full", [(LentPool, [6], True), (LockstepLentPool, [], False)])
def test_a_wake_of_tensor_parallel_ranks_borrows_nothing_and_is_partial(need, kind, borrows, full):
    """``weights.sleep.wake``: one rank borrows every layer's memory and wakes whole; tensor parallel
    ranks take what FREE holds (equal on every rank), wake partial, and restore in later ticks."""
    from sglang_memx.weights import sleep

    w, kv, pool = _weights_and_kv(free=4)
    ensured = []
    w.store.ensure = ensured.append
    w.layer_keys, w.sleeping, w.wakes = ["layer0", "layer1"], True, 0
    lent = _link(kind, pool)
    sleep.wake(w, kv, lent)
    assert lent.borrows == borrows and w.last_wake_full is full and not w.sleeping and w.wakes == 1
    assert (w.pipeline.requests, ensured, w.store.reserved) == (([([], 0)], ["layer0", "layer1"], 10) if full
                                                                else ([], [], 0))  # fmt: skip


GROUP_ROWS = 64


@pytest.mark.parametrize(
    "kind,ranks,running_demand,groups",
    [
        (LentPool, 1, 100, 10),  # one client: all the arbiter's 40 free chunks count (an urgent borrow rescues)
        (LockstepLentPool, 2, 0, 7),  # ranks, nothing running: each rank's share, 20 chunks
        (LockstepLentPool, 2, 100, 0),  # ranks, a request running: none of it (no borrow outside the tick)
    ],
)  # fmt: skip
def test_what_the_arbiter_could_lend_counts_for_a_restore(monkeypatch, kind, ranks, running_demand, groups):
    """``free_kv_groups``, nothing waiting: 128 tokens available, nothing evictable, 40 chunks (10 groups)
    free at the arbiter, the running requests' remaining decode ``running_demand``."""
    pool = _Pool(0)
    lent = _link(kind, pool)
    lent.ranks = ranks
    lent.available_now = lambda: 40
    w = types.SimpleNamespace(alpha=2, arbiter_polled_at=0.0, arbiter_free=0)
    kv = types.SimpleNamespace(buffers=types.SimpleNamespace(pool=pool, chunks_per_group=CHUNKS_PER_GROUP,
                                                             group_rows=GROUP_ROWS))  # fmt: skip
    running = [object()] if running_demand else []
    monkeypatch.setattr(remap.up_kv, "available_tokens", lambda allocator: 128)
    monkeypatch.setattr(remap.up_sched, "waiting", lambda scheduler: [])
    monkeypatch.setattr(remap.up_sched, "admitted_reqs", lambda scheduler: running)
    monkeypatch.setattr(remap, "admission_denied", lambda scheduler: False)
    monkeypatch.setattr(remap.demand, "queue_demand_tokens", lambda scheduler: running_demand)
    assert remap.free_kv_groups(w, kv, None, None, None, lent, None) == groups
