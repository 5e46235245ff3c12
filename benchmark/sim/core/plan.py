"""What one iteration of one model instance does: the contract between a
scheduler (which decides) and the engine (which executes and times it).

Invariant: when a scheduler returns a ``BatchPlan``, KV blocks for every
token in it are already held (``Instance.reserve`` succeeded for each entry);
the engine never allocates on its own, so a plan cannot fail halfway.

``InstanceView`` is the part of ``engine.Instance`` that schedulers and hooks
may use; it is a structural protocol, so this module does not import the
engine (the engine imports it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from .kvcache import KVCache
from .request import Request
from .roofline import BatchShape, Roofline

__all__ = ["BatchPlan", "InstanceView", "Scheduler", "InstanceHook"]


@dataclass
class BatchPlan:
    """``decodes``: requests producing one token each; ``prefills``:
    (request, chunk tokens); ``transfers``: (link name, bytes) that must
    complete before the iteration ends (they run concurrently with compute);
    ``extra_s``: added compute time (e.g. a non-overlapped copy)."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    transfers: list[tuple[str, float]] = field(default_factory=list)
    extra_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(c for _, c in self.prefills)


class InstanceView(Protocol):
    """The ``Instance`` API for schedulers and hooks (see ``engine.Instance``):
    ``waiting`` (FIFO), ``running`` (admission order), ``kv``, ``cfg``
    (``engine.InstanceConfig``), ``sim`` (the ``Simulator``: ``links``,
    ``arbiter``, ``instances``, ``loop``), ``admit``, ``reserve``, ``unadmit``,
    ``preempt``, ``blocks_needed``, ``roofline``, ``last_shape``,
    ``last_duration``, ``hooks``, ``scheduler``."""

    idx: int
    cfg: Any
    sim: Any
    kv: KVCache
    roofline: Roofline
    waiting: deque[Request]
    running: list[Request]
    hooks: list[Any]
    scheduler: Any
    in_iteration: bool
    last_shape: BatchShape
    last_duration: float

    def blocks_needed(self, req: Request, extra_tokens: int) -> int: ...

    def reserve(self, req: Request, extra_tokens: int) -> bool: ...

    def admit(self, req: Request, now: float) -> None: ...

    def unadmit(self, req: Request) -> None: ...

    def preempt(self, req: Request) -> None: ...

    def kick(self) -> None: ...


class Scheduler(Protocol):
    """Builds each iteration of one instance. Implementations may admit,
    preempt and reserve through the ``Instance`` API (``admit``, ``preempt``,
    ``reserve``); they must return an empty plan when there is nothing to run."""

    def plan(self, inst: InstanceView, now: float) -> BatchPlan: ...


class InstanceHook(Protocol):
    """Optional per-iteration hook (memory managers, link users).

    ``before_iteration`` may append to ``plan.transfers`` / add ``extra_s`` and
    may resize ``inst.kv``; ``after_iteration`` sees the measured duration."""

    def before_iteration(self, inst: InstanceView, plan: BatchPlan, now: float) -> None: ...

    def after_iteration(self, inst: InstanceView, plan: BatchPlan, now: float, duration: float) -> None: ...
