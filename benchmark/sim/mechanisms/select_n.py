"""Select-N offloading intervals vs a FlexGen-like static split (hook kinds
``select_n`` and ``flexgen_static``, the paper's baseline).

Both keep part of the weights in host memory, stream it every iteration and
give the freed device memory to the KV pool. Both get the same TPOT SLO: an
absolute ``tpot_slo_s``, or ``(1 + slo_slowdown)`` x the no-offload decode step
at the operating point (``batch`` sequences of ``seq`` context tokens), the
paper's relative SLO (§5.2 "SLO 20 %-50 %"). ``set_tpot_slo`` writes it into
the instance so SLO attainment measures it.

``select_n`` -- decided by the code the server uses:

* a ``memory_ext.policy.layer_profile.LayerProfile`` -- the record
  ``sglang-memx profile`` writes -- either loaded (option ``profile``: a JSON
  file) or "measured" on the simulated hardware by ``profile_from_roofline``
  (decode layer time at batches 1-256 at context ``profile_seq``, prefill time
  per token, the host link's bandwidth);
* ``memory_ext.policy.interval_manager.IntervalManager`` on that profile picks
  the streamed layers (one staging slot: Select-N Fig. 7; ``slots`` 2:
  Oneiros Eq. 5 with slack); the time outside the layers (``fixed_s``) is the
  no-offload step minus its layers;
* with ``bus`` (GPUs sharing one host link) and ``coordinate: true``, before
  every iteration of a member the bus's ``LinkCoordinator`` re-decides the
  intervals of every member with work, from ``demand_from_profile`` (minimum
  interval from each one's SLO at its current batch); device memory follows
  the interval: a smaller interval grows the KV pool at once; a larger one
  needs blocks back, so it applies as far as the KV in use allows (the
  paper's maximum interval "from the model memory on the GPU") and the rest
  drains: blocks freed by an iteration go back to the weights before the
  next plan can admit into them. A rejection (no joint choice fits) targets
  "no offload" for every busy member and is counted.

Execution (the check, not the policy's formula): each iteration streams the
chosen layers (every ``interval``-th) over the link and waits as
``core.pipeline.pipeline_seconds`` says for this iteration's per-layer time
(roofline of its actual batch) and the link's bandwidth divided among the
transfers active on it when the iteration starts (processor sharing), plus the
link's own fair-share completion. Host memory = streamed layers; KV gain =
streamed layers minus ``slots`` staging buffers.

``flexgen_static`` (baseline, its own cost model, no policy object): a fixed
fraction ``p`` of every layer lives on the host, decided once from peak
datasheet throughput (no efficiency factors, no overhead: FlexGen's lower-bound
estimate, Select-N §3.3) and the worst-case link share ``1 / bus_share``
(§3.4): largest ``p`` with ``L * (p * t_tr_est - t_c_est) <= slack_est``
(next layer's portion prefetched while the current layer computes). KV gain =
``p * (L - 1)`` layers; per iteration: transfer ``p * L`` layers plus stall
``L * max(0, p * t_tr - t_c)`` at the link share of that iteration.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memory_ext.policy.interval_manager import IntervalManager, StreamBudget, demand_from_profile, stream_budget
from memory_ext.policy.layer_profile import LayerProfile
from memory_ext.policy.oneiros import uniform_interval_layers
from memory_ext.policy.select_n import LinkCoordinator, no_offload_interval

from ..core.pipeline import pipeline_seconds
from ..core.plan import BatchPlan
from ..core.roofline import BatchShape, Roofline
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance, Simulator

__all__ = [
    "SelectNHook",
    "FlexGenStaticHook",
    "decode_layer_time",
    "prefill_layer_time",
    "profile_from_roofline",
]

_SLOS = (0.2, 0.3, 0.4, 0.5)
_PROFILE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SIM_TIME = "1970-01-01T00:00:00+00:00"  # a simulated profile is measured at no time


def decode_layer_time(rf: Roofline, batch: int, seq: int) -> float:
    """Per-layer time of one decode step: ``batch`` tokens, each reading ``seq`` + 1 KV tokens."""
    return rf.layer_time(batch, batch * (seq + 1), batch * (seq + 1))


def prefill_layer_time(rf: Roofline, batch: int, seq: int) -> float:
    """Per-layer time of prefilling ``batch`` prompts of ``seq`` tokens."""
    return rf.layer_time(batch * seq, batch * seq * (seq + 1) / 2, batch * seq)


def _prefill_step(rf: Roofline, batch: int, seq: int) -> float:
    s = BatchShape()
    for _ in range(batch):
        s.add_prefill(0, seq, True)
    return rf.iteration_time(s)


def profile_from_roofline(
    inst: Instance,
    seq_len: int,
    prefill_tokens: int = 2048,
    batches: Sequence[int] = _PROFILE_BATCHES,
    link_bytes_per_s: float | None = None,
) -> LayerProfile:
    """What ``sglang-memx profile`` would measure on the simulated hardware:
    decode layer time per batch at context ``seq_len``, prefill time per token
    (``prefill_tokens // seq_len`` prompts of ``seq_len``), host link bandwidth."""
    rf, cfg = inst.roofline, inst.cfg
    b_pre = max(1, prefill_tokens // seq_len)
    return LayerProfile(
        model=cfg.model.name,
        device=f"sim:{rf.gpu.name}",
        dtype=cfg.weight_dtype,
        n_layers=rf.layers,
        layer_bytes=int(cfg.model.layer_weight_bytes(cfg.weight_dtype)),
        link_bytes_per_s=link_bytes_per_s or rf.gpu.host_gbps * 1e9,
        decode_layer_s={b: decode_layer_time(rf, b, seq_len) for b in batches},
        prefill_layer_s_per_token=prefill_layer_time(rf, b_pre, seq_len) / (b_pre * seq_len),
        seq_len=seq_len,
        measured_at=_SIM_TIME,
        command="benchmark.sim profile_from_roofline (simulated, not measured)",
    )


def _shape(plan: BatchPlan) -> BatchShape:
    s = BatchShape()
    for r in plan.decodes:
        s.add_decode(r.ctx)
    for r, chunk in plan.prefills:
        s.add_prefill(r.ctx, chunk, r.ctx + chunk >= r.target)
    return s


class _Bus:
    """The offloading hooks of GPUs sharing one host link, and its coordinator."""

    def __init__(self, name: str, link: str, bandwidth: float, members: list[_OffloadBase]) -> None:
        self.name, self.link, self.bandwidth, self.members = name, link, bandwidth, members
        self.coordinator = LinkCoordinator(bandwidth)
        self.decisions = 0
        self.rejections: dict[str, int] = {}
        self._cache: dict[tuple, Any] = {}

    def coordinate(self, me: SelectNHook, plan: BatchPlan, now: float) -> None:
        """Fig. 8 for every member with work, ``me`` being the one about to run."""
        busy = [h for h in self.members if isinstance(h, SelectNHook) and h.coordinated and h.busy()]
        if me not in busy:
            busy.append(me)
        key = tuple((h.inst.idx, h.current_batch(plan if h is me else None)) for h in busy)
        dec = self._cache.get(key)
        if dec is None:
            demands = [h.demand(b) for h, (_, b) in zip(busy, key)]
            me_d = demands[busy.index(me)]
            dec = self.coordinator.decide(me_d, [d for d in demands if d is not me_d])
            self._cache[key] = dec
        self.decisions += 1
        if not dec.accepted:
            r = dec.rejection.value
            self.rejections[r] = self.rejections.get(r, 0) + 1
        for h in busy:
            h.set_target(dec.intervals[h.inst.cfg.name] if dec.accepted else no_offload_interval(h.L), now)


_BUSES: weakref.WeakKeyDictionary[Simulator, dict[str, _Bus]] = weakref.WeakKeyDictionary()


def _bus_of(hook: _OffloadBase) -> _Bus:
    sim = hook.inst.sim
    per = _BUSES.setdefault(sim, {})
    bus = per.get(hook.bus)
    if bus is None:
        members = [h for i in sim.instances for h in i.hooks if isinstance(h, _OffloadBase) and h.bus == hook.bus]
        gbps = {h.bus_gbps for h in members}
        if len(gbps) > 1:
            raise ValueError(f"bus {hook.bus}: members disagree on bus_gbps: {sorted(gbps, key=str)}")
        bw = (members[0].bus_gbps or hook.inst.roofline.gpu.host_gbps) * 1e9
        link = f"bus:{hook.bus}"
        if link not in sim.links:
            sim.links.add(link, bw)
        bus = per[hook.bus] = _Bus(hook.bus, link, bw, members)
    return bus


class _OffloadBase:
    kind = ""

    def __init__(
        self,
        inst: Instance,
        slo_slowdown: float,
        batch: int,
        seq: int,
        set_tpot_slo: bool,
        link: str,
        tpot_slo_s: float | None = None,
        bus: str | None = None,
        bus_gbps: float | None = None,
    ) -> None:
        if not slo_slowdown >= 0:
            raise ValueError(f"slo_slowdown must be >= 0, got {slo_slowdown}")
        if batch < 1 or seq < 1:
            raise ValueError(f"batch and seq must be >= 1, got {batch}, {seq}")
        if tpot_slo_s is not None and not tpot_slo_s > 0:
            raise ValueError(f"tpot_slo_s must be > 0, got {tpot_slo_s}")
        if bus_gbps is not None and (bus is None or not bus_gbps > 0):
            raise ValueError(f"bus_gbps needs a bus and must be > 0, got {bus_gbps}")
        cfg = inst.cfg
        self.inst = inst
        self.slo = float(slo_slowdown)
        self.batch, self.seq = int(batch), int(seq)
        self.L = cfg.model.layers
        self.layer_bytes = cfg.model.layer_weight_bytes(cfg.weight_dtype)
        self.bus, self.bus_gbps = bus, bus_gbps
        self.link = f"{link}:{cfg.gpu}"
        self.link_bps = (bus_gbps or inst.roofline.gpu.host_gbps) * 1e9
        self.t_tr = self.layer_bytes / self.link_bps
        self.t_ref = inst.roofline.decode_time(self.batch, self.seq)
        self.tpot_slo_s = float(tpot_slo_s) if tpot_slo_s is not None else (1.0 + self.slo) * self.t_ref
        if set_tpot_slo:
            cfg.tpot_slo_s = self.tpot_slo_s
        self.host_bytes = 0.0
        self.gained_blocks = 0
        self._applied = False
        self._bus: _Bus | None = None
        self.iterations = 0
        self.stall_s = 0.0
        self.streamed_bytes = 0.0

    def _bind(self) -> None:
        if self.bus is not None and self._bus is None:
            self._bus = _bus_of(self)
            self.link = self._bus.link

    def _t_tr_now(self) -> float:
        """One layer's load time at the share of the link left when this iteration starts."""
        link = self.inst.sim.links[self.link]
        return self.layer_bytes / (link.bandwidth / (len(link.active) + 1))

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

    def _stats(self, gauges: dict[str, Any], details: dict[str, Any], counters=None) -> dict[str, Any]:
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
        c = {"iterations": self.iterations, "stall_s": self.stall_s, "streamed_gb": self.streamed_bytes / 1e9}
        c.update(counters or {})
        details = {"operating_point": {"batch": self.batch, "seq": self.seq}, "bus": self.bus, **details}
        return mechanism_stats("select_n", self.kind, self.inst.cfg.name, c, g, details)


class SelectNHook(_OffloadBase):
    """Select-N (module docstring). Options beyond the common ones: ``phase``
    (which phase's budget sizes the deployment), ``slots``, ``profile`` (JSON
    path), ``profile_seq`` (context of a simulated profile; default ``seq``),
    ``interval`` (force one, e.g. 1 = DeepSpeed-like), ``coordinate`` (per
    iteration, with ``bus``), ``report_points`` / ``report_batches`` (tables)."""

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
        report_batches: Sequence[int] = (4, 8, 16, 32),
        tpot_slo_s: float | None = None,
        slots: int = 1,
        profile: str | None = None,
        profile_seq: int | None = None,
        interval: int | None = None,
        bus: str | None = None,
        bus_gbps: float | None = None,
        coordinate: bool = False,
    ) -> None:
        super().__init__(inst, slo_slowdown, batch, seq, set_tpot_slo, link, tpot_slo_s, bus, bus_gbps)
        if phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be decode or prefill, got {phase!r}")
        if coordinate and bus is None:
            raise ValueError("coordinate needs a bus")
        rf = inst.roofline
        self.phase, self.slots, self.coordinated = phase, int(slots), bool(coordinate)
        self.slos = tuple(sorted({float(s) for s in slos} | {self.slo}))
        if profile is not None:
            self.profile = LayerProfile.load(Path(profile))
            if self.profile.n_layers != self.L or self.profile.layer_bytes != int(self.layer_bytes):
                raise ValueError(f"profile {profile}: n_layers/layer_bytes do not match {inst.cfg.model.name}")
        else:
            self.profile = profile_from_roofline(inst, int(profile_seq or seq), link_bytes_per_s=self.link_bps)
        self.fixed_s = max(0.0, self.t_ref - self.L * decode_layer_time(rf, self.batch, self.seq))
        self.manager = IntervalManager(self.profile, self.tpot_slo_s, self.slots, self.fixed_s)
        if phase == "decode":
            self.budget = self.manager.decide(self.batch)
        else:
            self.budget = self._prefill_budget(self.batch, self.seq, self.slo)
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval must be an int >= 1, got {interval!r}")
        self.record_interval = self.budget.interval
        self.base_blocks = inst.cfg.kv_blocks
        self._host_t = (0.0, 0.0)  # (last change time, host-byte-seconds so far)
        self.interval_changes = 0
        self.target = no_offload_interval(self.L)
        # coordinated: no memory until the first joint decision; else the deployment's
        self._set_interval(no_offload_interval(self.L) if self.coordinated else interval or self.budget.interval)
        self.gained_blocks = self._gain(self.n_off)
        self.report_points = report_points or [
            {"phase": "prefill", "batch": 16, "seq": 64},
            {"phase": "decode", "batch": 128, "seq": 64},
        ]
        self.report_batches = tuple(report_batches)
        self._demands: dict[tuple, Any] = {}

    # ---- decisions ---------------------------------------------------------------------
    def _prefill_budget(self, batch: int, seq: int, slo: float) -> StreamBudget:
        rf = self.inst.roofline
        t_ref = _prefill_step(rf, batch, seq)
        fixed = max(0.0, t_ref - self.L * prefill_layer_time(rf, batch, seq))
        t_c = self.profile.prefill_layer_seconds(batch * seq)
        return stream_budget(self.L, t_c, self.profile.layer_transfer_s, (1.0 + slo) * t_ref, self.slots, fixed)

    def _decode_budget(self, batch: int, seq: int, slo: float) -> StreamBudget:
        rf = self.inst.roofline
        t_ref = rf.decode_time(batch, seq)
        fixed = max(0.0, t_ref - self.L * decode_layer_time(rf, batch, seq))
        return IntervalManager(self.profile, (1.0 + slo) * t_ref, self.slots, fixed).decide(batch)

    def _set_interval(self, interval: int) -> None:
        """Stream every ``interval``-th layer (one slot, Select-N's layout), or as
        many layers placed by Oneiros's uniform interval (two or more slots)."""
        self.interval = min(int(interval), no_offload_interval(self.L))
        self.n_off = self.L // self.interval if self.interval <= self.L else 0
        if self.slots == 1:
            self.streamed = tuple(k * self.interval - 1 for k in range(1, self.n_off + 1))
        else:
            self.streamed = uniform_interval_layers(self.L, self.n_off)
        self.host_bytes = self.n_off * self.layer_bytes

    def _gain(self, n_off: int) -> int:
        return int(max(0, n_off - self.slots) * self.layer_bytes // self.inst.cfg.kv_block_bytes)

    # ---- bus coordination (members with work, per iteration) ----------------------------
    def busy(self) -> bool:
        return bool(self.inst.waiting or self.inst.running)

    def current_batch(self, plan: BatchPlan | None = None) -> int:
        if plan is not None:
            return max(1, len(plan.decodes) + len(plan.prefills))
        return max(1, sum(1 for r in self.inst.running if r.decoding))

    def capacity_interval(self) -> int | None:
        """Largest interval whose freed memory still holds the KV in use beyond
        the base pool (None: any interval)."""
        need = self.inst.kv.used - self.base_blocks
        if need <= 0:
            return None
        fits = [i for i in range(1, self.L + 1) if self._gain(self.L // i) >= need]
        return max(fits) if fits else 1

    def demand(self, batch: int):
        d = self._demands.get(batch)
        if d is None:
            d = self._demands[batch] = demand_from_profile(self.inst.cfg.name, self.manager, batch)
        return d

    def set_target(self, interval: int, now: float) -> None:
        """The coordinator's interval for this GPU; applied as far as the KV in
        use allows (``_settle``), the rest as blocks free up (``after_iteration``)."""
        self.target = interval
        self._settle(now)

    def _settle(self, now: float) -> None:
        cap = self.capacity_interval()
        interval = self.target if cap is None else min(self.target, cap)
        if interval == self.interval:
            return
        t0, acc = self._host_t
        self._host_t = (now, acc + self.host_bytes * (now - t0))
        self._set_interval(interval)
        kv = self.inst.kv
        kv.resize(self.base_blocks + self._gain(self.n_off))  # never below the blocks in use
        self.gained_blocks = kv.capacity - self.base_blocks
        self.interval_changes += 1

    # ---- hook API ------------------------------------------------------------------------
    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        if self.coordinated and self.interval < self.target:
            self._settle(now)  # blocks freed by this iteration go back to the weights first

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        self._bind()
        if self.coordinated:
            if getattr(inst.sim, "arbiter", None) is not None:
                raise ValueError("select_n coordinate is not supported under the node arbiter")
            self._applied = True
            self._bus.coordinate(self, plan, now)
        else:
            self._grow_kv(inst)
        if not self.n_off:
            return
        self.iterations += 1
        s = _shape(plan)
        t_c = inst.roofline.layer_time(s.tokens, s.attn_pairs, s.kv_tokens)
        stall = pipeline_seconds(self.L, self.streamed, t_c, self._t_tr_now(), self.slots) - self.L * t_c
        nbytes = self.n_off * self.layer_bytes
        plan.transfers.append((self.link, nbytes))
        plan.extra_s += max(0.0, stall)
        self.stall_s += max(0.0, stall)
        self.streamed_bytes += nbytes

    # ---- reports -------------------------------------------------------------------------
    def interval_table(self) -> dict[str, Any]:
        """Select-N's interval (smallest with the chosen layer count) per SLO at each report point."""
        out = {}
        for p in self.report_points:
            key = f"{p['phase']} b={p['batch']} s={p['seq']}"
            fn = self._prefill_budget if p["phase"] == "prefill" else self._decode_budget
            out[key] = {f"{s:g}": fn(p["batch"], p["seq"], s).interval for s in self.slos}
        return out

    def host_gb_by_batch(self) -> dict[str, float]:
        """Host memory the deployment would use at each decode batch (SLO ``slo_slowdown``)."""
        return {
            str(b): self._decode_budget(b, self.seq, self.slo).layers * self.layer_bytes / 1e9
            for b in self.report_batches
        }

    def stats(self) -> dict[str, Any]:
        counters: dict[str, Any] = {"interval_changes": self.interval_changes}
        details: dict[str, Any] = {
            "phase": self.phase,
            "slots": self.slots,
            "record_interval": self.record_interval,
            "budget_reason": self.budget.reason,
            "intervals_per_slo": self.interval_table(),
            "host_gb_by_batch": self.host_gb_by_batch(),
            "profile": self.profile.to_json(),
        }
        gauges = {"interval": self.interval, "offloaded_layers": self.n_off, "record_interval": self.record_interval}
        if self.coordinated and self._bus is not None:
            end = self.inst.sim.loop.now if self.inst.sim is not None else 0.0
            t0, acc = self._host_t
            total = acc + self.host_bytes * (end - t0)
            gauges["host_gb_mean"] = total / end / 1e9 if end > 0 else self.host_bytes / 1e9
            counters["bus_decisions"] = self._bus.decisions
            counters.update({f"bus_rejections.{k}": v for k, v in sorted(self._bus.rejections.items())})
        return self._stats(gauges, details, counters)


def flexgen_fraction(
    inst: Instance,
    slo: float,
    batch: int,
    seq: int,
    bus_share: float = 1.0,
    tpot_slo_s: float | None = None,
    link_bps: float | None = None,
) -> float:
    """FlexGen-like static fraction of every layer kept on the host (module docstring).

    Slack: ``slo * t_c_est * L`` (relative SLO) or ``tpot_slo_s`` minus the
    estimated no-offload step (absolute), both from peak datasheet figures."""
    peak = inst.roofline.gpu.with_efficiency(1.0, 1.0)
    est = Roofline(inst.cfg.model, peak, inst.cfg.weight_dtype, inst.cfg.kv_dtype, 0.0, inst.cfg.share)
    t_c_est = decode_layer_time(est, batch, seq)
    link_bps = link_bps or inst.roofline.gpu.host_gbps * 1e9
    t_tr_est = inst.cfg.model.layer_weight_bytes(inst.cfg.weight_dtype) / (link_bps / bus_share)
    L = inst.cfg.model.layers
    slack = slo * t_c_est * L if tpot_slo_s is None else max(0.0, tpot_slo_s - est.decode_time(batch, seq))
    return min(1.0, (t_c_est + slack / L) / t_tr_est)


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
        report_batches: Sequence[int] = (4, 8, 16, 32),
        tpot_slo_s: float | None = None,
        bus: str | None = None,
        bus_gbps: float | None = None,
    ) -> None:
        super().__init__(inst, slo_slowdown, batch, seq, set_tpot_slo, link, tpot_slo_s, bus, bus_gbps)
        if not bus_share >= 1:
            raise ValueError(f"bus_share must be >= 1, got {bus_share}")
        self.bus_share = float(bus_share)
        self.abs_slo = tpot_slo_s
        self.fraction = flexgen_fraction(
            inst, self.slo, self.batch, self.seq, self.bus_share, tpot_slo_s, self.link_bps
        )
        self.host_bytes = self.fraction * self.L * self.layer_bytes
        self.gained_blocks = int(self.fraction * (self.L - 1) * self.layer_bytes // inst.cfg.kv_block_bytes)
        self.per_slo = {
            f"{s:g}": flexgen_fraction(inst, s, self.batch, self.seq, self.bus_share, None, self.link_bps) for s in slos
        }
        self.report_batches = tuple(report_batches)

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        self._bind()
        self._grow_kv(inst)
        if self.fraction <= 0:
            return
        self.iterations += 1
        s = _shape(plan)
        t_c = inst.roofline.layer_time(s.tokens, s.attn_pairs, s.kv_tokens)
        stall = self.L * max(0.0, self.fraction * self._t_tr_now() - t_c)
        nbytes = self.fraction * self.L * self.layer_bytes
        plan.transfers.append((self.link, nbytes))
        plan.extra_s += stall
        self.stall_s += stall
        self.streamed_bytes += nbytes

    def stats(self) -> dict[str, Any]:
        by_batch = {
            str(b): flexgen_fraction(self.inst, self.slo, b, self.seq, self.bus_share, None, self.link_bps)
            * self.L
            * self.layer_bytes
            / 1e9
            for b in self.report_batches
        }
        return self._stats(
            {"fraction": self.fraction, "bus_share": self.bus_share},
            {
                "fraction_per_slo": self.per_slo,
                "host_gb_per_slo": {k: v * self.L * self.layer_bytes / 1e9 for k, v in self.per_slo.items()},
                "host_gb_by_batch": by_batch,
            },
        )
