"""Select-N offloading intervals vs a FlexGen-like static split (hook kinds
``select_n`` and ``flexgen_static``, the paper's baseline).

Both keep part of the weights in host memory, stream it over ``h2d:<gpu>``
every iteration and give the freed GPU memory to the KV pool. Both are given
the same SLO: TPOT <= (1 + ``slo_slowdown``) x the no-offload decode step at
the operating point (``batch`` sequences of ``seq`` context tokens), the
paper's relative SLO (Select-N §5.2: "SLO 20 %-50 %"). With ``set_tpot_slo``
the hook writes that SLO into the instance so SLO attainment measures it.

``select_n`` (decisions from ``memory_ext.policy.select_n``):

* performance records (prefill and decode, power-of-two batch x sequence
  grid, every SLO of ``slos``) built by ``analyze_phases`` from the
  simulator's own per-layer times -- the "measured" t_c is
  ``roofline.layer_time`` of that batch shape, t_tr = layer bytes / host link;
* interval = ``PhaseRecords.lookup(phase, slo_slowdown, batch, seq)``, then
  ``LinkCoordinator.decide`` for this GPU (alone on its link here);
* host memory = ``(L // i)`` layers; KV gain = host memory minus one staging
  layer; per iteration: transfer of those layers plus the Fig. 7 stall
  ``(L // i) * max(0, t_tr - (i - 1) * t_c)`` with t_c of *this* iteration.

``flexgen_static`` (baseline, its own cost model, no policy object): a fixed
fraction ``p`` of every layer lives on the host, decided once before serving
from a cost model that uses peak datasheet throughput (no efficiency factors,
no overhead: FlexGen's lower-bound estimate, Select-N §3.3) and the
worst-case link share ``1 / bus_share`` (§3.4): largest ``p`` with
``p * t_tr_est <= (1 + slo) * t_c_est`` (next layer's portion prefetched
while the current layer computes). KV gain = ``p * (L - 1)`` layers; per
iteration: transfer ``p * L`` layers plus stall ``L * max(0, p * t_tr - t_c)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memory_ext.policy.select_n import (
    GpuDemand,
    LayerTiming,
    LinkCoordinator,
    Phase,
    PhaseRecords,
    SloKind,
    analyze_phases,
    iteration_latency,
    max_interval_for_capacity,
    offloaded_layers,
)

from ..core.plan import BatchPlan
from ..core.roofline import BatchShape, Roofline
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance

__all__ = ["SelectNHook", "FlexGenStaticHook", "decode_layer_time", "prefill_layer_time", "build_records"]

_SLOS = (0.2, 0.3, 0.4, 0.5)
_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SEQS = (64, 128, 256, 512, 1024, 2048)


def decode_layer_time(rf: Roofline, batch: int, seq: int) -> float:
    """Per-layer time of one decode step: ``batch`` tokens, each reading ``seq`` + 1 KV tokens."""
    return rf.layer_time(batch, batch * (seq + 1), batch * (seq + 1))


def prefill_layer_time(rf: Roofline, batch: int, seq: int) -> float:
    """Per-layer time of prefilling ``batch`` prompts of ``seq`` tokens."""
    return rf.layer_time(batch * seq, batch * seq * (seq + 1) / 2, batch * seq)


def build_records(
    rf: Roofline,
    layer_bytes: float,
    link_bps: float,
    slos: Sequence[float] = _SLOS,
    batches: Sequence[int] = _BATCHES,
    seqs: Sequence[int] = _SEQS,
) -> PhaseRecords:
    """Select-N's offline analyzer run on the simulator's roofline."""
    t_tr = layer_bytes / link_bps
    return analyze_phases(
        rf.layers,
        lambda b, s: LayerTiming(prefill_layer_time(rf, b, s), t_tr),
        lambda b, s: LayerTiming(decode_layer_time(rf, b, s), t_tr),
        slos,
        batches,
        seqs,
        SloKind.SLOWDOWN,
    )


class _OffloadBase:
    kind = ""

    def __init__(
        self, inst: Instance, slo_slowdown: float, batch: int, seq: int, set_tpot_slo: bool, link: str
    ) -> None:
        if not slo_slowdown >= 0:
            raise ValueError(f"slo_slowdown must be >= 0, got {slo_slowdown}")
        if batch < 1 or seq < 1:
            raise ValueError(f"batch and seq must be >= 1, got {batch}, {seq}")
        cfg = inst.cfg
        self.inst = inst
        self.slo = float(slo_slowdown)
        self.batch, self.seq = int(batch), int(seq)
        self.L = cfg.model.layers
        self.layer_bytes = cfg.model.layer_weight_bytes(cfg.weight_dtype)
        self.link = f"{link}:{cfg.gpu}"
        self.link_bps = inst.roofline.gpu.host_gbps * 1e9
        self.t_tr = self.layer_bytes / self.link_bps
        self.t_ref = inst.roofline.decode_time(self.batch, self.seq)
        self.tpot_slo_s = (1.0 + self.slo) * self.t_ref
        if set_tpot_slo:
            cfg.tpot_slo_s = self.tpot_slo_s
        self.host_bytes = 0.0
        self.gained_blocks = 0
        self._applied = False
        self.iterations = 0
        self.stall_s = 0.0
        self.streamed_bytes = 0.0

    def _grow_kv(self, inst: Instance) -> None:
        if not self._applied:
            arb = getattr(inst.sim, "arbiter", None)
            if arb is not None:  # the node arbiter credits the freed weights to this model's KV
                arb.offload(inst, self.gained_blocks)
            else:
                inst.kv.resize(inst.kv.capacity + self.gained_blocks)
            self._applied = True

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        pass

    def _stats(self, gauges: dict[str, Any], details: dict[str, Any]) -> dict[str, Any]:
        """Common shape (``core.stats``): the parts both kinds share, plus theirs."""
        g = {
            "slo_slowdown": self.slo,
            "t_ref_decode_s": self.t_ref,
            "tpot_slo_s": self.tpot_slo_s,
            "layer_transfer_s": self.t_tr,
            "host_gb": self.host_bytes / 1e9,
            "kv_gain_blocks": self.gained_blocks,
            "layers": self.L,
            **gauges,
        }
        counters = {"iterations": self.iterations, "stall_s": self.stall_s, "streamed_gb": self.streamed_bytes / 1e9}
        details = {"operating_point": {"batch": self.batch, "seq": self.seq}, **details}
        return mechanism_stats("select_n", self.kind, self.inst.cfg.name, counters, g, details)


class SelectNHook(_OffloadBase):
    """Select-N (see module docstring). ``phase``: which record decides the
    interval (``decode`` for a decode-dominated instance)."""

    kind = "select_n"

    def __init__(
        self,
        inst: Instance,
        slo_slowdown: float = 0.5,
        batch: int = 128,
        seq: int = 64,
        phase: str = "decode",
        slos: Sequence[float] = _SLOS,
        set_tpot_slo: bool = True,
        link: str = "h2d",
        report_points: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(inst, slo_slowdown, batch, seq, set_tpot_slo, link)
        slos = tuple(sorted({float(s) for s in slos} | {self.slo}))
        self.phase = Phase(phase)
        self.records = build_records(inst.roofline, self.layer_bytes, self.link_bps, slos)
        i_min = self.records.lookup(self.phase, self.slo, self.batch, self.seq)
        rec_interval = i_min
        cap = max_interval_for_capacity(
            self.L, int(self.layer_bytes), int(inst.cfg.model.weight_bytes(inst.cfg.weight_dtype))
        )
        t_c = (decode_layer_time if self.phase is Phase.DECODE else prefill_layer_time)(
            inst.roofline, self.batch, self.seq
        )
        iter_s = iteration_latency(self.L, i_min, LayerTiming(t_c, self.t_tr)) if i_min else t_c * self.L
        self.decision = LinkCoordinator(self.link_bps).decide(
            GpuDemand(inst.cfg.name, self.L, int(self.layer_bytes), iter_s, i_min, cap)
        )
        self.record_interval = rec_interval
        self.interval = self.decision.intervals.get(inst.cfg.name, self.L + 1) if self.decision.accepted else self.L + 1
        self.n_off = offloaded_layers(self.L, self.interval)
        self.host_bytes = self.n_off * self.layer_bytes
        staging = self.layer_bytes if self.n_off else 0.0
        self.gained_blocks = int((self.host_bytes - staging) // inst.cfg.kv_block_bytes)
        self.report_points = report_points or [
            {"phase": "prefill", "batch": 16, "seq": 64},
            {"phase": "decode", "batch": 128, "seq": 64},
        ]

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        self._grow_kv(inst)
        if not self.n_off:
            return
        self.iterations += 1
        # t_c of this iteration (the engine sets last_shape after hooks; recompute it here)
        s = BatchShape()
        for r in plan.decodes:
            s.add_decode(r.ctx)
        for r, chunk in plan.prefills:
            s.add_prefill(r.ctx, chunk, r.ctx + chunk >= r.target)
        t_c = inst.roofline.layer_time(s.tokens, s.attn_pairs, s.kv_tokens)
        stall = self.n_off * max(0.0, self.t_tr - (self.interval - 1) * t_c)
        nbytes = self.n_off * self.layer_bytes
        plan.transfers.append((self.link, nbytes))
        plan.extra_s += stall
        self.stall_s += stall
        self.streamed_bytes += nbytes

    def interval_table(self) -> dict[str, Any]:
        """Chosen interval per SLO at each report point (Select-N Table 1 style)."""
        out = {}
        for p in self.report_points:
            ph = Phase(p["phase"])
            rec = self.records.prefill if ph is Phase.PREFILL else self.records.decode
            key = f"{ph.value} b={p['batch']} s={p['seq']}"
            out[key] = {f"{s:g}": rec.lookup(s, p["batch"], p["seq"]) for s in rec.slos}
        return out

    def stats(self) -> dict[str, Any]:
        d = self.records.decode
        return self._stats(
            {"interval": self.interval, "offloaded_layers": self.n_off},
            {
                "phase": self.phase.value,
                "record_interval": self.record_interval,
                "coordinator": {
                    "accepted": self.decision.accepted,
                    "rejection": self.decision.rejection.value if self.decision.rejection else None,
                },
                "intervals_per_slo": self.interval_table(),
                "decode_record_grid": {
                    f"{s:g}": {"batches": list(d.batch_sizes), "seqs": list(d.seq_lens), "grid": d.grid(s)}
                    for s in d.slos
                },
            },
        )


def flexgen_fraction(inst: Instance, slo: float, batch: int, seq: int, bus_share: float = 1.0) -> float:
    """FlexGen-like static fraction of every layer kept on the host (module docstring)."""
    peak = inst.roofline.gpu.with_efficiency(1.0, 1.0)
    est = Roofline(inst.cfg.model, peak, inst.cfg.weight_dtype, inst.cfg.kv_dtype, 0.0, inst.cfg.share)
    t_c_est = decode_layer_time(est, batch, seq)
    t_tr_est = inst.cfg.model.layer_weight_bytes(inst.cfg.weight_dtype) / (
        inst.roofline.gpu.host_gbps * 1e9 / bus_share
    )
    return min(1.0, (1.0 + slo) * t_c_est / t_tr_est)


class FlexGenStaticHook(_OffloadBase):
    """FlexGen-like static split (see module docstring)."""

    kind = "flexgen_static"

    def __init__(
        self,
        inst: Instance,
        slo_slowdown: float = 0.5,
        batch: int = 128,
        seq: int = 64,
        bus_share: float = 1.0,
        slos: Sequence[float] = _SLOS,
        set_tpot_slo: bool = True,
        link: str = "h2d",
    ) -> None:
        super().__init__(inst, slo_slowdown, batch, seq, set_tpot_slo, link)
        if not bus_share >= 1:
            raise ValueError(f"bus_share must be >= 1, got {bus_share}")
        self.bus_share = float(bus_share)
        self.fraction = flexgen_fraction(inst, self.slo, self.batch, self.seq, self.bus_share)
        self.host_bytes = self.fraction * self.L * self.layer_bytes
        self.gained_blocks = int(self.fraction * (self.L - 1) * self.layer_bytes // inst.cfg.kv_block_bytes)
        self.per_slo = {f"{s:g}": flexgen_fraction(inst, s, self.batch, self.seq, self.bus_share) for s in slos}

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        self._grow_kv(inst)
        if self.fraction <= 0:
            return
        self.iterations += 1
        s = BatchShape()
        for r in plan.decodes:
            s.add_decode(r.ctx)
        for r, chunk in plan.prefills:
            s.add_prefill(r.ctx, chunk, r.ctx + chunk >= r.target)
        t_c = inst.roofline.layer_time(s.tokens, s.attn_pairs, s.kv_tokens)
        stall = self.L * max(0.0, self.fraction * self.t_tr - t_c)
        nbytes = self.fraction * self.L * self.layer_bytes
        plan.transfers.append((self.link, nbytes))
        plan.extra_s += stall
        self.stall_s += stall
        self.streamed_bytes += nbytes

    def stats(self) -> dict[str, Any]:
        return self._stats(
            {"fraction": self.fraction, "bus_share": self.bus_share},
            {
                "fraction_per_slo": self.per_slo,
                "host_gb_per_slo": {k: v * self.L * self.layer_bytes / 1e9 for k, v in self.per_slo.items()},
            },
        )
