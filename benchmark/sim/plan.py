"""What one iteration of one model instance does: the contract between a
scheduler (which decides) and the engine (which executes and times it).

Invariant: when a scheduler returns a ``BatchPlan``, KV blocks for every
token in it are already held (``Instance.reserve`` succeeded for each entry);
the engine never allocates on its own, so a plan cannot fail halfway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .request import Request

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Instance

__all__ = ["BatchPlan", "Scheduler", "InstanceHook"]


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


class Scheduler(Protocol):
    """Builds each iteration of one instance. Implementations may admit,
    preempt and reserve through the ``Instance`` API (``admit``, ``preempt``,
    ``reserve``); they must return an empty plan when there is nothing to run."""

    def plan(self, inst: Instance, now: float) -> BatchPlan: ...


class InstanceHook(Protocol):
    """Optional per-iteration hook (memory managers, link users).

    ``before_iteration`` may append to ``plan.transfers`` / add ``extra_s`` and
    may resize ``inst.kv``; ``after_iteration`` sees the measured duration."""

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None: ...

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None: ...
