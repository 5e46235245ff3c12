"""What a coordinator component is: the steps it adds to each scheduler iteration and the
sources it adds to the short-allocation order, both as data.

* ``Step(name, rank, run)``: ``run(it)`` once per iteration; steps of every present component
  run in ascending ``rank`` (``ITERATION_RANKS`` lists the built-in ones). ``in_tick=False``
  steps run after the tick's window (its ``phase``, its ``tick_seconds``), in rank order too.
* ``Source(name, rank, take)``: when an allocation upstream already decided on finds fewer free
  pages than it needs, ``take(allocator, pages)`` of each present component runs in ascending
  ``rank`` while the free list is still short (``SOURCE_RANKS``).

A new mechanism is one class with ``name``, ``steps()``, ``sources()`` and ``status()``,
registered with the coordinator (``Coordinator.register``); nothing else changes.
Invariant: ranks are unique within each order (``Coordinator`` refuses a duplicate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# The per-iteration order (built-in steps). Gaps leave room for new components.
ITERATION_RANKS = {
    "new tick for the ranks": 1,  # --tp > 1: this tick's rank 0 clock is read afresh (``rank_agreement``)
    "measure the decode step": 5,  # the governor: first, so the interval it times is tick to tick
    "cap request lengths": 10,
    "park offloaded prefills": 20,
    "end the activation's iteration": 30,
    "consume wake-ups": 40,
    "answer reclaims": 50,
    "work?": 60,
    "deflate": 70,
    "deflate the sliding-window space": 71,  # a hybrid sliding-window model's second space (``swa_spaces``)
    "host buffer size (Alg. 2)": 80,
    "give back, borrow": 90,
    "even the ranks' pools": 95,  # --tp > 1 on a shared pool: after the tick's one borrow (``rank_pools``)
    "report to the arbiter": 100,
    "fetch parked KV": 110,
    "reopen admission for offload": 120,
    # after the reclaims and borrows: the demand the weights steps see is this iteration's
    "sleep or wake": 130,
    "Oneiros step": 140,
    "hold the head's activation": 150,
    "premap": 160,
    "premap the sliding-window space": 161,
    "reopen admission when the head fits": 170,  # after every step that adds memory
    "agree across ranks": 180,  # --tp > 1: last in the tick, what upstream reads next is checked equal
    "peer tier step": 200,  # outside the tick's window
}

# The short-allocation order (built-in sources).
SOURCE_RANKS = {
    "map from the local pool": 10,  # FREE chunks and idle activation chunks (``ElasticKV.grow``)
    "borrow from the shared pool": 20,  # urgent borrow of the shortfall, then map it
    "over the activation balloon": 30,  # lend live activation chunks (no arena only)
}


@dataclass
class Iteration:
    """One tick's values: ``tree`` read at its start, ``busy`` set by its "work?" step (after the
    reclaims) and read by deflation and the premap."""

    scheduler: object
    allocator: object
    kv: object
    tree: object
    coordinator: Any  # the coordinator running the tick: its parts, for a step that depends on others
    busy: bool = False


@dataclass(frozen=True)
class Step:
    name: str
    rank: int
    run: Callable[[Iteration], None]
    in_tick: bool = True


@dataclass(frozen=True)
class Source:
    name: str
    rank: int
    take: Callable[[object, int], None]  # (allocator, pages wanted)


def step(name: str, run: Callable[[Iteration], None], *, in_tick: bool = True) -> Step:
    """A built-in step, ranked by ``ITERATION_RANKS``."""
    return Step(name, ITERATION_RANKS[name], run, in_tick)


def source(name: str, take: Callable[[object, int], None]) -> Source:
    """A built-in source, ranked by ``SOURCE_RANKS``."""
    return Source(name, SOURCE_RANKS[name], take)


@runtime_checkable
class Component(Protocol):
    """A mechanism on the device, present or absent as a whole."""

    name: str

    def steps(self) -> tuple[Step, ...]: ...

    def sources(self) -> tuple[Source, ...]: ...

    def status(self) -> dict[str, Any] | None: ...
