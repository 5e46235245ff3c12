"""The host KV buffer's state on one scheduler (``--memx-host-buffer-gb``): the buffer, Alg. 2's
rule sizing it, and the offloaded prefills not parked yet. Its mechanism is ``host_buffer``.

Invariant: ``used + pending_bytes`` stays within the buffer's logical size (offload admission).
"""

from __future__ import annotations

from memory_ext.policy.buffer_scaling import HostBufferRule
from memory_ext.pool.host_kv_buffer import HostKVBuffer


class HostBufferState:
    """The host buffer of one scheduler plus the prefills offloaded into it.

    ``pending_bytes``: host bytes promised to offloaded prefills not parked yet (admitted, or
    in ``limbo``); offload admission keeps ``used + pending`` within the logical size.
    ``unit_bytes``: one KV group, the unit of Alg. 2's logical size.
    """

    def __init__(self, buffer: HostKVBuffer, unit_bytes: int, rule: HostBufferRule | None = None):
        self.buffer = buffer
        self.unit_bytes = unit_bytes
        self.rule = rule
        self.limbo: list = []  # offloaded prefills out of every batch, their first token not processed yet
        self.pins: dict = {}  # rid -> radix-cache lock on a fetched prefix, held until the request is admitted
        self.pending_bytes = 0
        self.offload = {"prefill_offloads": 0, "offload_parked": 0, "offload_no_room": 0}
        # why a fetch pass stopped before the end of the queue, and why a parked request was
        # admitted without its KV (its prompt recomputed): diagnosis of wasted prefill work
        self.fetch_stopped = {"batch_limits": 0, "kv_room": 0, "copy_room": 0, "governor": 0, "activation_room": 0}
        self.recomputed = {"not_fetched": 0, "partial_prefix": 0}
        if rule is not None:
            buffer.set_logical_bytes(rule.logical_units * unit_bytes)

    def offload_room(self) -> int:
        return max(0, self.buffer.room() - self.pending_bytes)

    def pinned_tokens(self, rid: str) -> int:
        """Tokens of ``rid``'s parked KV that are back on the device and pinned (0 if none)."""
        entry = self.buffer.peek(rid)
        return len(entry) if entry is not None and rid in self.pins else 0

    def set_logical_units(self, units: int) -> None:
        self.buffer.set_logical_bytes(units * self.unit_bytes)

    def status(self) -> dict:
        out = self.buffer.status()
        out.update(
            self.offload,
            offload_pending=len(self.limbo),
            offload_pending_bytes=self.pending_bytes,
            pinned=len(self.pins),
            fetch_stopped=dict(self.fetch_stopped),
            recomputed=dict(self.recomputed),
        )
        rule = self.rule
        out["slo_scaling"] = None if rule is None else {
            "logical_units": rule.logical_units,
            "unit_bytes": self.unit_bytes,
            "ttft_slo_s": rule.scaler.ttft_slo,
            "tpot_slo_s": rule.scaler.tpot_slo,
            "ttft_events": rule.events["ttft"],
            "tpot_events": rule.events["tpot"],
        }  # fmt: skip
        return out


def build_host_buffer(config, group_bytes: int) -> HostBufferState:
    capacity = int(config.host_buffer_gb * (1 << 30))
    rule = None
    if config.ttft_slo_ms is not None:
        rule = HostBufferRule(max(1, capacity // group_bytes), config.ttft_slo_ms / 1e3, config.tpot_slo_ms / 1e3)
    return HostBufferState(HostKVBuffer(capacity), group_bytes, rule)
