"""The per-device coordinator: the KV space and the typed components around it.

One ``Coordinator`` per scheduler process (one device's KV pool). It owns the KV space
(``ElasticKV``) and a tuple of components (``parts.Component``), each present or absent as a
whole. From their declarations it derives the two orders, as data:

* the iteration order: every present component's steps by rank (``tick`` runs them);
* the short-allocation order: every present component's sources by rank (``cover_allocation``
  runs them while the free list is short of what upstream is about to take).

Both are printed in ``/memx/status`` (``status()["coordinator"]``). ``of(allocator)`` is the
one place that finds the coordinator through an upstream object (the allocator it is attached
to, ``attach``). Invariants: one component per type; ranks unique within each order;
``KVCore`` is always the first component.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.coordinator.components import (
    ActivationBalloonPart,
    HostBufferPart,
    KVCore,
    NoActivation,
    SharedPoolLender,
    WeightLender,
)
from sglang_memx.coordinator.parts import Component, Iteration, Source, Step
from sglang_memx.coordinator.rank_pools import RankPools
from sglang_memx.coordinator.step_clock import StepClock
from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import scheduler as up_sched

C = TypeVar("C")
NO_ACTIVATION = NoActivation()


class Coordinator:
    def __init__(self, kv: ElasticKV, components: tuple[Component, ...] = ()):
        self.kv = kv
        self.components: tuple[Component, ...] = ()
        self._steps: tuple[tuple[Component, Step], ...] = ()
        self._sources: tuple[tuple[Component, Source], ...] = ()
        self.clock = StepClock()
        self._parts: dict[type, Component | None] = {}  # ``part``'s answers; emptied by ``register``
        for component in (KVCore(kv), *components):
            self.register(component)

    # ------------------------------------------------------------ components
    def register(self, component: Component) -> None:
        """Add a mechanism: its steps and sources join the two orders by rank."""
        if not isinstance(component, Component):
            raise TypeError(f"component {component!r} lacks name / steps / sources / status")
        if any(type(c) is type(component) for c in self.components):
            raise ValueError(f"component {type(component).__name__} is registered already")
        steps = self._steps + tuple((component, s) for s in component.steps())
        sources = self._sources + tuple((component, s) for s in component.sources())
        for kind, entries in (("step", steps), ("source", sources)):
            ranks = [e.rank for _, e in entries]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"component {component.name!r}: a {kind} rank is taken already")
        self.components += (component,)
        self._parts.clear()
        self._steps = tuple(sorted(steps, key=lambda e: e[1].rank))
        self._sources = tuple(sorted(sources, key=lambda e: e[1].rank))

    def part(self, kind: type[C]) -> C | None:
        """The registered component of type ``kind``, or None (the mechanism is off). Looked up
        once per kind until the next ``register`` (hooks and steps ask several times an iteration)."""
        try:
            return self._parts[kind]
        except KeyError:
            found = self._parts[kind] = next((c for c in self.components if isinstance(c, kind)), None)
            return found

    # ------------------------------------------------------------ the orders
    def iteration_order(self) -> tuple[tuple[Component, Step], ...]:
        return self._steps

    def short_order(self) -> tuple[tuple[Component, Source], ...]:
        return self._sources

    def orders(self) -> dict[str, Any]:
        """Both orders and the components, JSON-ready (``/memx/status``)."""
        return {
            "components": [c.name for c in self.components],
            "iteration_order": [
                {"step": s.name, "component": c.name, "rank": s.rank, "in_tick": s.in_tick} for c, s in self._steps
            ],
            "short_allocation_order": [
                {"source": s.name, "component": c.name, "rank": s.rank} for c, s in self._sources
            ],
            "time": self.clock.status(),  # seconds per step / source (``step_clock``)
        }

    def activation_side(self) -> ActivationBalloonPart | NoActivation:
        """The activation sharing the pool, or a side that holds nothing (``NoActivation``)."""
        return self.part(ActivationBalloonPart) or NO_ACTIVATION

    def shared_pool(self) -> LentPool | None:
        """This server's link to the device's shared pool (``--memx-pool``), or None (its own pool)."""
        part = self.part(SharedPoolLender)
        return None if part is None else part.lent

    def borrow_pool(self) -> LentPool | None:
        """The shared pool for borrows outside the tick's "give back, borrow" step (admission, a decode
        step's capacity, the head's activation), or None: an own pool, or tensor parallel ranks, which
        borrow in that step only (``rank_pools``)."""
        lent = self.shared_pool()
        return None if isinstance(lent, LockstepLentPool) else lent

    def host_buffer(self) -> HostBufferState | None:
        """The host KV buffer (``--memx-host-buffer-gb``), or None."""
        part = self.part(HostBufferPart)
        return None if part is None else part.host

    def physical_budget(self) -> tuple[int, int]:
        """(chunks this server may ever use: its own pool or the shared pool's budget, chunks of
        them other mechanisms always keep: the weights' minimum, the largest prefill batch's
        activation). Tensor parallel ranks on one shared pool (``RankPools``) split its budget:
        each rank holds its own shard of every request's KV, so a rank may use 1 / tp of it."""
        lender, weights = self.part(SharedPoolLender), self.part(WeightLender)
        balloon, ranks = self.part(ActivationBalloonPart), self.part(RankPools)
        budget = lender.lent.budget_chunks if lender is not None else self.kv.buffers.pool.capacity_chunks
        if ranks is not None:
            budget //= ranks.ranks.tp_size
        kept = 0
        if weights is not None:  # weights share the budget; remap may lend all but a minimum to KV
            kept += weights.weights.min_held_chunks()
        if balloon is not None:  # the largest prefill batch's activation shares the budget
            kept += balloon.balloon.need_chunks(balloon.balloon.max_batch_tokens, 1)
        return budget, kept

    # ------------------------------------------------------------ running them
    def tick(self, scheduler) -> None:
        """One scheduler iteration: the in-tick steps (their unmaps counted as the tick's phase,
        ``ElasticKV.unmap_calls``; timed as ``tick_seconds``), then the steps after the tick. Each
        step's time goes to the clock as busy or idle by the iteration's "work?" step (``it.busy``)."""
        kv = self.kv
        allocator = up_sched.allocator(scheduler)
        t0 = time.perf_counter()
        kv.phase = "tick"
        took: list[tuple[str, float]] = []
        try:
            it = Iteration(scheduler, allocator, kv, up_sched.tree_cache(scheduler), self)
            for _, s in self._steps:
                if s.in_tick:
                    took.append((s.name, self._run_timed(s.run, it)))
        finally:
            kv.phase = "request"
        kv.stats["ticks"] += 1
        kv.stats["tick_seconds"] += time.perf_counter() - t0
        try:
            for _, s in self._steps:
                if not s.in_tick:
                    took.append((s.name, self._run_timed(s.run, it)))
        finally:
            for name, seconds in took:
                self.clock.record(name, seconds, it.busy)

    @staticmethod
    def _run_timed(run, *args) -> float:
        """Seconds ``run(*args)`` took (a step that raises is not timed: the scheduler fails on it)."""
        t0 = time.perf_counter()
        run(*args)
        return time.perf_counter() - t0

    def cover_allocation(self, allocator, pages: int) -> None:
        """Before an allocation upstream has already decided on (a prefill chunk, an extend, a
        decode step): seek ``pages`` free pages from the sources in order, each only while the
        free list is still short. Invariant: an allocation falls short only when no source
        (ultimately the device's whole pool) can cover it; upstream treats it as fatal."""
        for _, s in self._sources:
            if pages <= up_kv.free_page_count(allocator):
                return
            self.clock.record(s.name, self._run_timed(s.take, allocator, pages))

    # ------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """The KV space's numbers, each component's section (None for a mechanism that is off),
        and the coordinator's orders."""
        doc = self.kv.status()
        doc.update(activation=None, host_buffer=None, weights=None, shared_pool=None, governor=None)
        for c in self.components:
            doc.update(c.status() or {})
        doc["coordinator"] = self.orders()
        return doc


def components_of(
    kv: ElasticKV, *, lent: LentPool | None = None, host: HostBufferState | None = None
) -> tuple[Component, ...]:
    """The components of the parts a KV space was built with: its activation balloon (the build
    sets it on the space), the shared pool's link and the host buffer. The pool build adds the
    layer stream cache and the peer tier (``pool_build.finish``); the weights come later, once the
    model is loaded (``WeightLender``, registered by the hooks)."""
    found: list[Component] = []
    balloon = kv.activation
    if lent is not None:
        found.append(SharedPoolLender(kv, lent))
    if balloon is not None:
        found.append(ActivationBalloonPart(kv, balloon, host))
    if host is not None:
        found.append(HostBufferPart(kv, host))
    return tuple(found)


def attach(allocator, kv: ElasticKV, extra: tuple[Component, ...] = (), *, lent: LentPool | None = None,
           host: HostBufferState | None = None) -> Coordinator:  # fmt: skip
    """Make the coordinator of ``kv`` (its components from its parts, ``lent`` and ``host``, then ``extra``)
    and tie it to upstream's allocator, where ``of`` finds it."""
    return tie(allocator, Coordinator(kv, components_of(kv, lent=lent, host=host) + tuple(extra)))


def tie(allocator, coordinator: Coordinator) -> Coordinator:
    """Tie ``coordinator`` to upstream's allocator, where ``of`` finds it."""
    up_kv.attach_memx(allocator, coordinator)
    return coordinator


def of(allocator) -> Coordinator | None:
    """The coordinator tied to this allocator, or None (stock KV)."""
    return up_kv.memx_of(allocator)


def orders_markdown(coordinator: Coordinator) -> str:
    """Both orders of ``coordinator`` as Markdown tables (``docs/architecture.md`` holds them for
    every built-in component; a unit test keeps the two equal)."""
    rows = ["| rank | step | component | when |", "|---|---|---|---|"]
    rows += [f"| {s.rank} | {s.name} | {c.name} | {'in the tick' if s.in_tick else 'after the tick'} |"
             for c, s in coordinator.iteration_order()]  # fmt: skip
    rows += ["", "| rank | source | component |", "|---|---|---|"]
    rows += [f"| {s.rank} | {s.name} | {c.name} |" for c, s in coordinator.short_order()]
    return "\n".join(rows)
