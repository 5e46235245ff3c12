"""Per-iteration instance hooks (memory managers, link users) and their registry.

A hook implements ``before_iteration(inst, plan, now)`` and
``after_iteration(inst, plan, now, duration)`` (see ``plan.InstanceHook``).
Scenario files attach hooks with ``models[i].hooks: [{kind, options}]``;
register new kinds with ``register_hook(kind, factory)`` where
``factory(inst, **options) -> hook`` (called once the instance exists).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .plan import BatchPlan

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Instance

__all__ = ["LayerStreamingHook", "HOOKS", "register_hook"]


class LayerStreamingHook:
    """Keep ``layers`` decoder layers' weights in host memory and stream them
    over the host->GPU link every iteration (the mechanism behind Oneiros
    remapping and Select-N offloading, without their control logic).

    At the first iteration the freed weight memory becomes KV blocks
    (``inst.kv.resize``). Each iteration then adds one transfer of
    ``layers * layer_weight_bytes`` on ``h2d:<gpu>``; since transfers overlap
    compute, the iteration takes ``max(compute, transfer)`` (longer when other
    GPUs share the link). Invariant: it never frees more layers than the model has
    minus one."""

    def __init__(self, inst: Instance, layers: int = 1, link: str = "h2d") -> None:
        model = inst.cfg.model
        if not 0 <= layers < model.layers:
            raise ValueError(f"layers must be in [0, {model.layers - 1}], got {layers}")
        self.layers = layers
        self.link = f"{link}:{inst.cfg.gpu}"
        self.bytes = layers * model.layer_weight_bytes(inst.cfg.weight_dtype)
        self.gained_blocks = int(self.bytes // inst.cfg.kv_block_bytes)
        self._applied = False

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        if not self._applied:
            arb = getattr(inst.sim, "arbiter", None)
            if arb is not None:
                arb.offload(inst, self.gained_blocks)
            else:
                inst.kv.resize(inst.kv.capacity + self.gained_blocks)
            self._applied = True
        if self.bytes:
            plan.transfers.append((self.link, self.bytes))

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        pass


HOOKS: dict[str, Callable[..., Any]] = {"layer_streaming": LayerStreamingHook}


def register_hook(kind: str, factory: Callable[..., Any]) -> None:
    """Make ``kind`` usable in ``models[i].hooks``; ``factory(inst, **options)``."""
    if kind in HOOKS:
        raise ValueError(f"hook kind {kind!r} already registered")
    HOOKS[kind] = factory
