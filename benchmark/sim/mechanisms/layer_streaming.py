"""Generic layer streaming (hook kind ``layer_streaming``): the mechanism
Oneiros remapping and Select-N offloading share, without their control logic.

Keeps ``layers`` decoder layers' weights in host memory and streams them over
the host->GPU link every iteration. At the first iteration the freed weight
memory becomes KV blocks (``inst.kv.resize``, or the node arbiter's
``offload`` under ``arbiter``). Each iteration then adds one transfer of
``layers * layer_weight_bytes`` on ``h2d:<gpu>``; since transfers overlap
compute, the iteration takes ``max(compute, transfer)`` (longer when other
GPUs share the link). Invariant: it never frees more layers than the model
has minus one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.plan import BatchPlan
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance

__all__ = ["LayerStreamingHook"]


class LayerStreamingHook:
    """See the module docstring. Options: ``layers`` (how many), ``link`` (prefix, ``h2d``)."""

    def __init__(self, inst: Instance, layers: int = 1, link: str = "h2d") -> None:
        model = inst.cfg.model
        if not 0 <= layers < model.layers:
            raise ValueError(f"layers must be in [0, {model.layers - 1}], got {layers}")
        self.name = inst.cfg.name
        self.layers = layers
        self.link = f"{link}:{inst.cfg.gpu}"
        self.bytes = layers * model.layer_weight_bytes(inst.cfg.weight_dtype)
        self.gained_blocks = int(self.bytes // inst.cfg.kv_block_bytes)
        self._applied = False
        self.iterations = 0
        self.streamed_bytes = 0.0

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
            self.iterations += 1
            self.streamed_bytes += self.bytes

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        pass

    def stats(self) -> dict:
        return mechanism_stats(
            "layer_streaming",
            "layer_streaming",
            self.name,
            counters={"streaming_iterations": self.iterations, "streamed_gb": self.streamed_bytes / 1e9},
            gauges={"host_layers": self.layers, "kv_gain_blocks": self.gained_blocks},
            details={"link": self.link},
        )
