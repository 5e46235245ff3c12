"""The per-device coordinator: components present by type, the two orders as data, and a new
mechanism added by writing one component and registering it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from memory_ext.policy.governor import BatchGovernor
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.coordinator import components, device
from sglang_memx.coordinator.components import (
    ActivationBalloonPart,
    HostBufferPart,
    KVCore,
    LayerStreamPart,
    PeerTier,
    SharedPoolLender,
    WeightLender,
)
from sglang_memx.coordinator.governor import GovernorPart
from sglang_memx.coordinator.parts import ITERATION_RANKS, SOURCE_RANKS, Source, Step
from sglang_memx.coordinator.rank_agreement import RankAgreement
from sglang_memx.coordinator.rank_pools import RankPools
from sglang_memx.coordinator.swa_spaces import SwaSpaces
from sglang_memx.upstream import kv as up_kv

# The iteration order as ``coordinator.tick`` listed it before it became the components' data (and the
# ranks' evening of their shared pools since).
OLD_STEPS = (
    "cap request lengths", "park offloaded prefills", "end the activation's iteration", "consume wake-ups",
    "answer reclaims", "work?", "deflate", "deflate the sliding-window space", "host buffer size (Alg. 2)",
    "give back, borrow", "even the ranks' pools", "report to the arbiter", "fetch parked KV",
    "reopen admission for offload", "sleep or wake", "Oneiros step", "hold the head's activation", "premap",
    "premap the sliding-window space",
)  # fmt: skip


class FakeKV:
    """A KV space whose free list is a number: ``grow`` maps up to ``local`` pages."""

    def __init__(self, free=0, local=0):
        self.free, self.local = free, local
        self.phase = "request"
        self.lengths_capped = False
        self.buffers = SimpleNamespace(pool=SimpleNamespace(capacity_chunks=0))
        self.stats = {"ticks": 0, "tick_seconds": 0.0}
        self.phases_seen: list[str] = []

    def grow(self, allocator, pages: int) -> int:
        add = min(max(0, pages - self.free), self.local)
        self.free += add
        self.local -= add
        return add

    def status(self) -> dict:
        return {"free": self.free}


@pytest.fixture
def free_list(monkeypatch):
    monkeypatch.setattr(up_kv, "free_page_count", lambda allocator: allocator.kv.free)


def quiet_kv_core(monkeypatch, alloc) -> list[str]:
    """The KV core's steps record their names instead of reading a scheduler."""
    ran: list[str] = []
    it = components.iteration
    monkeypatch.setattr(it, "cap_request_lengths", lambda scheduler, kv, budget, kept, **_: ran.append("cap"))
    monkeypatch.setattr(it, "has_work", lambda scheduler: ran.append("work?") is None)
    monkeypatch.setattr(it, "deflate", lambda kv, allocator, busy: ran.append("deflate"))
    monkeypatch.setattr(it, "premap", lambda kv, allocator, scheduler, keep: ran.append(("premap", keep)))
    monkeypatch.setattr(
        it, "reopen_admission_when_head_fits", lambda kv, scheduler, allocator, tree: ran.append("reopen")
    )
    monkeypatch.setattr(device.up_sched, "allocator", lambda scheduler: alloc)
    monkeypatch.setattr(device.up_sched, "tree_cache", lambda scheduler: None)
    return ran


def every_component(kv) -> device.Coordinator:
    stub = SimpleNamespace(status=lambda: {"on": True})
    return device.Coordinator(
        kv,
        (
            SharedPoolLender(kv, stub),
            ActivationBalloonPart(kv, stub),
            HostBufferPart(kv, stub),
            WeightLender(kv, stub),
            PeerTier(kv),
            GovernorPart(BatchGovernor(0.05)),
            RankAgreement(2, None),
            RankPools(stub, RankAgreement(2, None), lambda: None),
            SwaSpaces(kv, kv, None, None),
        ),
    )


def test_the_built_in_orders_are_the_governors_measure_the_old_tick_order_the_reopening_the_ranks_then_the_peer():
    kv = SimpleNamespace()
    names = [s.name for _, s in every_component(kv).iteration_order()]
    # the governor's first; reopening admission last in the tick, after every step that adds memory
    assert names == ["new tick for the ranks", "measure the decode step", *OLD_STEPS,
                     "reopen admission when the head fits", "agree across ranks", "peer tier step"]  # fmt: skip
    assert [s.name for _, s in every_component(kv).short_order()] == list(SOURCE_RANKS)
    assert set(names) == set(ITERATION_RANKS)


def test_absent_components_add_no_steps_and_no_sources():
    c = device.Coordinator(SimpleNamespace())
    assert [type(x) for x in c.components] == [KVCore]
    assert [s.name for _, s in c.iteration_order()] == [
        "cap request lengths", "work?", "deflate", "premap", "reopen admission when the head fits"
    ]  # fmt: skip
    assert [s.name for _, s in c.short_order()] == ["map from the local pool"]
    assert c.part(SharedPoolLender) is None and c.part(KVCore) is c.components[0]


def test_components_come_from_the_parts_the_kv_space_was_built_with():
    host = object()
    kv = SimpleNamespace(activation=None)
    c = device.Coordinator(kv, device.components_of(kv, host=host))
    assert c.part(HostBufferPart).host is host and c.part(ActivationBalloonPart) is None


def test_a_component_type_registers_once_and_ranks_stay_unique():
    kv = SimpleNamespace()
    c = device.Coordinator(kv)
    with pytest.raises(ValueError, match="registered already"):
        c.register(KVCore(kv))
    with pytest.raises(TypeError, match="lacks"):
        c.register(object())

    @dataclass(eq=False)
    class Clash:
        name: str = "clash"

        def steps(self):
            return (Step("mine", ITERATION_RANKS["deflate"], lambda it: None),)

        def sources(self):
            return ()

        def status(self):
            return None

    with pytest.raises(ValueError, match="rank is taken"):
        c.register(Clash())
    assert len(c.components) == 1


@dataclass(eq=False)
class Reserve:
    """A new mechanism, written as one component: a reserve of ``pages`` pages it hands out on a
    short allocation after the shared pool, and a step after deflation that counts its ticks."""

    kv: object
    pages: int
    name: str = "test reserve"
    ticks: list = field(default_factory=list)

    def steps(self):
        return (Step("count ticks", ITERATION_RANKS["deflate"] + 1, self._count),)

    def sources(self):
        return (Source("take from the reserve", SOURCE_RANKS["borrow from the shared pool"] + 1, self._take),)

    def status(self):
        return {"test_reserve": {"pages": self.pages}}

    def _count(self, it):
        self.ticks.append((it.kv.phase, it.busy))

    def _take(self, allocator, pages):
        give = min(self.pages, pages - self.kv.free)
        self.pages -= give
        self.kv.free += give


def test_a_new_mechanism_is_one_component_registered(free_list, monkeypatch):
    kv = FakeKV(free=2, local=3)
    c = device.Coordinator(kv)
    c.register(Reserve(kv, pages=10))
    reserve = c.part(Reserve)
    alloc = SimpleNamespace(kv=kv)

    # the short-allocation order: the local pool first, then the reserve, only while short
    assert [s.name for _, s in c.short_order()] == ["map from the local pool", "take from the reserve"]
    c.cover_allocation(alloc, 4)
    assert kv.free == 4 and kv.local == 1 and reserve.pages == 10  # the local pool covered it
    c.cover_allocation(alloc, 9)
    assert kv.free == 9 and kv.local == 0 and reserve.pages == 6  # local 1, then 4 from the reserve

    # the iteration order: its step right after deflation, inside the tick's phase
    names = [s.name for _, s in c.iteration_order()]
    assert names.index("count ticks") == names.index("deflate") + 1
    ran = quiet_kv_core(monkeypatch, alloc)
    c.tick(SimpleNamespace())
    assert ran == ["cap", "work?", "deflate", ("premap", 0), "reopen"]  # the core's steps in order; no activation
    assert reserve.ticks == [("tick", True)] and kv.phase == "request" and kv.stats["ticks"] == 1

    # both orders and its status in the status document
    doc = c.status()
    assert doc["test_reserve"] == {"pages": 6} and doc["free"] == 9 and doc["shared_pool"] is None
    orders = doc["coordinator"]
    assert orders["components"] == ["kv space", "test reserve"]
    assert {"source": "take from the reserve", "component": "test reserve", "rank": 21} in orders[
        "short_allocation_order"
    ]
    assert {"step": "count ticks", "component": "test reserve", "rank": 71, "in_tick": True} in orders[
        "iteration_order"
    ]
    # each step and source timed where it ran: the reserve only in the allocation the local pool left short
    timed = {name: t["calls"] for name, t in orders["time"].items()}
    assert timed["map from the local pool"] == 2 and timed["take from the reserve"] == 1 and timed["count ticks"] == 1
    assert all(t["total_s"] >= t["max_s"] >= 0 for t in orders["time"].values())
    # the tick had work ("work?" said so): its steps' time is on requests' path; a source's always is
    assert all(t["busy_calls"] == t["calls"] and t["busy_s"] == t["total_s"] for t in orders["time"].values())


def test_the_clock_tells_idle_ticks_from_busy_ones(free_list, monkeypatch):
    kv = FakeKV(free=2, local=3)
    c = device.Coordinator(kv)
    ran = quiet_kv_core(monkeypatch, SimpleNamespace(kv=kv))
    work = iter([False, True, False])
    monkeypatch.setattr(components.iteration, "has_work", lambda scheduler: ran.append("work?") is None and next(work))
    for _ in range(3):
        c.tick(SimpleNamespace())
    time = c.status()["coordinator"]["time"]
    assert time["deflate"]["calls"] == 3 and time["deflate"]["busy_calls"] == 1
    assert all(0 <= t["busy_s"] <= t["total_s"] and t["busy_calls"] == 1 for t in time.values())


def test_a_slow_step_is_logged_with_its_name(caplog):
    from sglang_memx.coordinator.step_clock import SLOW_STEP_S, StepClock

    clock = StepClock()
    with caplog.at_level("INFO", logger="sglang_memx"):
        clock.record("give back, borrow", SLOW_STEP_S / 10)
        clock.record("give back, borrow", SLOW_STEP_S * 2)
    assert clock.status()["give back, borrow"] == {"calls": 2, "total_s": round(SLOW_STEP_S * 2.1, 4),
                                                   "max_s": SLOW_STEP_S * 2, "busy_calls": 2,
                                                   "busy_s": round(SLOW_STEP_S * 2.1, 4)}  # fmt: skip
    assert [r.getMessage() for r in caplog.records] == [f"memx: give back, borrow took {SLOW_STEP_S * 2:.3f} s"]


def test_steps_after_the_tick_run_outside_its_phase(monkeypatch):
    kv = FakeKV()
    c = device.Coordinator(kv)
    quiet_kv_core(monkeypatch, None)
    seen = []
    c.register(
        SimpleNamespace(
            name="late",
            steps=lambda: (Step("late", 300, lambda it: seen.append(it.kv.phase), in_tick=False),),
            sources=lambda: (),
            status=lambda: None,
        )
    )
    c.tick(SimpleNamespace())
    assert seen == ["request"]


def test_the_architecture_doc_shows_both_orders_as_the_data_has_them():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    tables = device.orders_markdown(every_component(SimpleNamespace()))
    for table in tables.split("\n\n"):
        assert table in doc


def test_the_physical_budget_is_the_pools_less_what_the_present_parts_keep():
    kv = SimpleNamespace(buffers=SimpleNamespace(pool=SimpleNamespace(capacity_chunks=100)))
    assert device.Coordinator(kv).physical_budget() == (100, 0)  # own pool, nothing else in it
    c = device.Coordinator(
        kv,
        (
            SharedPoolLender(kv, SimpleNamespace(budget_chunks=80)),
            ActivationBalloonPart(
                kv, SimpleNamespace(max_batch_tokens=64, need_chunks=lambda tokens, seqs: tokens // 8)
            ),
        ),
    )
    assert c.physical_budget() == (80, 8)  # the shared pool's budget; the largest prefill's activation
    c.register(WeightLender(kv, SimpleNamespace(min_held_chunks=lambda: 5)))
    assert c.physical_budget() == (80, 13)  # and the weights' minimum
    # tensor parallel ranks on the shared pool: each holds its shard of every request's KV, so a rank
    # may use its share of the budget (a request longer than that waited for ever, never admitted)
    c.register(RankPools(SimpleNamespace(), RankAgreement(2, None), lambda: None))
    assert c.physical_budget() == (40, 13)


def test_sleep_runs_only_with_the_shared_pool(monkeypatch):
    slept = []
    monkeypatch.setattr(components.sleep, "step", lambda w, kv, lent, *rest, rank0s: slept.append((w, rank0s)))
    kv, w = SimpleNamespace(), SimpleNamespace()
    private = device.Coordinator(kv, (WeightLender(kv, w),))
    shared = device.Coordinator(kv, (SharedPoolLender(kv, object()), WeightLender(kv, w)))
    for c in (private, shared):
        step = next(s for _, s in c.iteration_order() if s.name == "sleep or wake")
        step.run(components.Iteration(None, None, kv, None, c))
    assert slept == [(w, None)]  # one rank: its own answer


def test_the_peer_tier_gets_the_layer_stream_cache_when_the_pool_build_made_one(monkeypatch):
    seen = []
    monkeypatch.setattr(components.peer_server, "tick", lambda scheduler, kv, lent, stream: seen.append((kv, stream)))
    kv, stream = SimpleNamespace(), object()
    for parts in ((PeerTier(kv),), (LayerStreamPart(stream), PeerTier(kv))):
        c = device.Coordinator(kv, parts)
        step = next(s for _, s in c.iteration_order() if s.name == "peer tier step")
        step.run(components.Iteration(None, None, kv, None, c))
    assert seen == [(kv, None), (kv, stream)]


def test_status_of_a_real_server_shows_its_components_and_both_orders():
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from memory_ext.policy.activation import ActivationProfile
    from memory_ext.pool import ChunkPool, LayeredKVBuffers
    from memory_ext.pool.activation_balloon import ActivationBalloon
    from memory_ext.vmm import host_backend
    from sglang_memx.elastic.kv import ElasticKV
    from sglang_memx.status import elastic_status

    pool = ChunkPool(host_backend(4096), 64)
    kv = ElasticKV(LayeredKVBuffers(pool, [64] * 4, 257, 1), 1, 256)
    kv.activation = ActivationBalloon(pool, ActivationProfile(per_token_bytes=4096))
    alloc = TokenToKVPoolAllocator(256, torch.bfloat16, "cpu", SimpleNamespace(), need_sort=True)
    assert elastic_status(alloc) is None  # stock KV: no coordinator
    device.attach(alloc, kv)
    kv.restrict_free_list(alloc)
    doc = elastic_status(alloc)
    assert doc["coordinator"]["components"] == ["kv space", "activation balloon"]
    assert [s["step"] for s in doc["coordinator"]["iteration_order"]] == [
        "cap request lengths", "end the activation's iteration", "work?", "deflate", "hold the head's activation",
        "premap", "reopen admission when the head fits",
    ]  # fmt: skip
    assert doc["coordinator"]["time"] == {}  # no iteration yet: nothing timed
    assert [s["source"] for s in doc["coordinator"]["short_allocation_order"]] == [
        "map from the local pool", "over the activation balloon"
    ]  # fmt: skip
    assert doc["activation"] is not None and doc["shared_pool"] is None and doc["host_buffer"] is None
    assert doc["weights"] is None and doc["groups_mapped"] == 1


def test_tensor_parallel_ranks_on_a_shared_pool_borrow_in_the_tick_only():
    """A lockstep pool (one rank of a --tp > 1 server): no urgent-borrow source and no pool for the
    borrows outside the tick's "give back, borrow" step (``Coordinator.borrow_pool``); a plain
    shared pool keeps both."""
    kv = SimpleNamespace(activation=None)
    plain, lockstep = LentPool.__new__(LentPool), LockstepLentPool.__new__(LockstepLentPool)
    c = device.Coordinator(kv, device.components_of(kv, lent=plain))
    assert c.borrow_pool() is plain and "borrow from the shared pool" in [s.name for _, s in c.short_order()]
    c = device.Coordinator(kv, device.components_of(kv, lent=lockstep))
    assert c.shared_pool() is lockstep and c.borrow_pool() is None
    assert [s.name for _, s in c.short_order()] == ["map from the local pool"]
    assert device.Coordinator(kv).borrow_pool() is None  # an own pool
