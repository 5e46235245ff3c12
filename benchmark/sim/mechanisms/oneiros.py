"""Oneiros parameter remapping (hook kind ``oneiros``).

Mechanism only; every decision comes from
``memory_ext.policy.oneiros.OneirosController`` (when to remap / restore,
which model, how many layers, m = alpha + beta via Eq. 4-5).

Memory model (per GPU, time-sliced models):

* Every instance with an ``oneiros`` hook on a GPU takes part; they share a
  ledger (one per simulator and GPU) holding each model's remapped layer
  count ``alpha``, its current ``LayerPlan`` and its *loans*: one loan per
  remapped layer, ``(borrower instance, KV blocks)``.
* REMAP: the instance whose hook observed the shortage (free KV below the
  low watermark) borrows one layer of the model the controller names
  (inactive models first, MRU, per-model cap, never a whole model): its KV
  pool grows by ``floor(layer_weight_bytes(lender) / borrower_block_bytes)``.
* RESTORE (Alg. 1 l. 6-12, "a tensor of the added KV cache is empty"): the
  controller is told, per lender, the free blocks of the pool holding its
  newest loan (``ModelState.lent_free_blocks``: the borrower's blocks not in
  use, ``kv.available``: free plus unreferenced prefix cache, which a
  restore may evict); it restores a layer when that pool can
  give the loan back and keep the controller's high watermark (by default
  the low one: no re-trigger). The hook shrinks the borrower only if that
  still holds, else the restore is deferred (counted) and the lender keeps
  streaming. A lender whose limit fell below its remapped count (it became
  active) is not remapped further and keeps streaming until its loans are
  empty, as in the paper; it streams ``plan_layers`` for its alpha at its
  current T_compute, or double buffering when no plan is feasible.
* Streaming cost: every iteration of a lender with ``alpha > 0`` moves
  ``m = alpha + beta`` of its layers over ``h2d:<gpu>`` (host -> GPU only:
  parameters never go back). Transfers overlap compute, so the iteration
  takes ``max(compute, transfer)``; the finer in-iteration pipelining limits
  of Eq. 4/5 are enforced by the controller's limit, not re-timed here.

Controller inputs (``ModelState``): ``layer_transfer_s`` = layer bytes /
host-link bandwidth (profiled, no contention); ``compute_s`` for an active
model (has waiting or running requests) = roofline time of its current decode
step (batch = decoding requests, their mean context), or of one prefill chunk
of ``prefill_tokens`` if nothing decodes yet; for an inactive model = that
prefill time (§5.3). ``last_activated`` = simulated time of the latest
idle -> active transition (MRU). ``cap`` = ``floor(cap_fraction * layers)``,
or ``layers - 1`` with ``cap_fraction`` None (then only O4/O5 bound it).
One controller decision per iteration of a participating instance, taken
after the iteration (so the next plan sees the new capacity), like Alg. 1's
per-step call.

Under the node arbiter (scenario key ``arbiter``, ``mechanisms/arbiter.py``) a
shortage is first served from idle memory (free budget, idle borrowed KV,
idle KV of models with no work); REMAP and RESTORE move weights through the
arbiter (a restore takes the layer back from any idle borrowed KV, not only
the original borrower's), and a REMAP naming the borrower itself is held.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

from memory_ext.policy.oneiros import (
    Action,
    BufferMode,
    LayerPlan,
    ModelState,
    OneirosController,
)

from ..core.plan import BatchPlan
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance, Simulator

__all__ = ["OneirosHook", "ledger_of"]


class _Ledger:
    """Shared remapping state of the participating instances of one GPU."""

    def __init__(self, members: list[Instance]) -> None:
        self.members = members
        self.alpha: dict[int, int] = {i.idx: 0 for i in members}
        self.plan: dict[int, LayerPlan | None] = {i.idx: None for i in members}
        self.loans: dict[int, list[tuple[Instance, int]]] = {i.idx: [] for i in members}
        self.active: dict[int, bool] = {i.idx: False for i in members}
        self.last_activated: dict[int, float] = {i.idx: 0.0 for i in members}
        self.max_alpha: dict[int, int] = {i.idx: 0 for i in members}
        self.remaps = 0
        self.restores = 0
        self.deferred_restores = 0
        self.holds_blocked = 0
        self.streamed_bytes = 0.0

    def refresh_activity(self, now: float) -> None:
        """Active = has work; on a GPU shared in ``turns`` mode, only the model
        holding the turn (§5.2: "models scheduled for future execution are
        considered inactive")."""
        for inst in self.members:
            if inst.gpu.mode == "turns":
                act = inst.gpu.current is inst
            else:
                act = bool(inst.waiting or inst.running)
            if act and not self.active[inst.idx]:
                self.last_activated[inst.idx] = now
            self.active[inst.idx] = act

    def lent_blocks_to(self, borrower: Instance) -> int:
        return sum(b for loans in self.loans.values() for (inst, b) in loans if inst is borrower)


_LEDGERS: weakref.WeakKeyDictionary[Simulator, dict[int, _Ledger]] = weakref.WeakKeyDictionary()


def ledger_of(inst: Instance) -> _Ledger:
    """The ledger of ``inst``'s GPU in its simulator (created on first use)."""
    sim = inst.sim
    per = _LEDGERS.setdefault(sim, {})
    led = per.get(inst.cfg.gpu)
    if led is None:
        members = [
            i for i in sim.instances if i.cfg.gpu == inst.cfg.gpu and any(isinstance(h, OneirosHook) for h in i.hooks)
        ]
        led = per[inst.cfg.gpu] = _Ledger(members)
    return led


class OneirosHook:
    """See module docstring. Options: ``low_watermark_frac`` / ``high_watermark_frac``
    (of the instance's initial KV blocks; ``high_watermark_frac`` None = the low
    one, Alg. 1 with no hysteresis), ``cap_fraction`` (per-model cap on
    remapped layers as a fraction of its layers; None: n - 1, only the O4/O5
    limit binds), ``mode`` (auto | single | double), ``prefill_tokens``
    (T_compute of an inactive model; default ``max_batched_tokens``), ``link``,
    ``restore_all`` (false: at most one RESTORE per decision; true: Alg. 1
    l. 6-12 literally, every empty lent layer comes back in the same step;
    without the node arbiter only)."""

    def __init__(
        self,
        inst: Instance,
        low_watermark_frac: float = 0.03,
        high_watermark_frac: float | None = None,
        cap_fraction: float | None = 0.5,
        mode: str = "auto",
        prefill_tokens: int | None = None,
        link: str = "h2d",
        restore_period_s: float = 0.05,
        restore_all: bool = False,
    ) -> None:
        if high_watermark_frac is None:
            high_watermark_frac = low_watermark_frac
        if not 0 <= low_watermark_frac <= high_watermark_frac < 1:
            raise ValueError(
                "need 0 <= low_watermark_frac <= high_watermark_frac < 1, got "
                f"{low_watermark_frac}, {high_watermark_frac}"
            )
        if cap_fraction is not None and (
            isinstance(cap_fraction, bool) or not isinstance(cap_fraction, (int, float)) or not 0 <= cap_fraction < 1
        ):
            raise ValueError(f"cap_fraction must be in [0, 1) or null, got {cap_fraction!r}")
        if not isinstance(restore_all, bool):
            raise ValueError(f"restore_all must be true or false, got {restore_all!r}")
        self.restore_all = restore_all
        cfg = inst.cfg
        base = cfg.kv_blocks
        low = max(1, int(math.ceil(low_watermark_frac * base)))
        high = max(low, int(math.ceil(high_watermark_frac * base)))
        self.controller = OneirosController(low, high, BufferMode(mode))
        self.inst = inst
        self.layer_bytes = cfg.model.layer_weight_bytes(cfg.weight_dtype)
        self.n_layers = cfg.model.layers
        n_cap = self.n_layers - 1 if cap_fraction is None else int(cap_fraction * self.n_layers)
        self.cap = min(n_cap, self.n_layers - 1)
        self.prefill_tokens = int(prefill_tokens or cfg.max_batched_tokens)
        self.link_prefix = link
        self.link = f"{link}:{cfg.gpu}"
        self.restore_period_s = float(restore_period_s)
        self._last_decision = -math.inf
        self.decisions: dict[str, int] = {}
        self.skipped = 0

    # ---- helpers ------------------------------------------------------------
    def _t_transfer(self) -> float:
        link = self.inst.sim.links[self.link]
        return self.layer_bytes / link.bandwidth

    def _compute_s(self, active: bool) -> float:
        inst = self.inst
        rf = inst.roofline
        if active:
            dec = [r for r in inst.running if r.decoding]
            if dec:
                return rf.decode_time(len(dec), sum(r.ctx for r in dec) / len(dec))
        return rf.prefill_time(self.prefill_tokens)

    def _state(self, led: _Ledger, observer: Instance) -> ModelState:
        i = self.inst.idx
        active = led.active[i]
        loans = led.loans[i]
        bpl = max(1, int(self.layer_bytes // observer.cfg.kv_block_bytes))
        lent_free = None
        if loans and getattr(observer.sim, "arbiter", None) is None:
            borrower, bpl = loans[-1]
            lent_free = borrower.kv.available
        return ModelState(
            name=self.inst.cfg.name,
            n_layers=self.n_layers,
            layer_transfer_s=self._t_transfer(),
            compute_s=self._compute_s(active),
            active=active,
            cap=self.cap,
            remapped=led.alpha[i],
            blocks_per_layer=max(1, bpl),
            last_activated=led.last_activated[i],
            lent_free_blocks=lent_free,
        )

    @staticmethod
    def _hook(inst: Instance) -> OneirosHook:
        return next(h for h in inst.hooks if isinstance(h, OneirosHook))

    # ---- hook API -----------------------------------------------------------
    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        led = ledger_of(inst)
        p = led.plan[inst.idx]
        if led.alpha[inst.idx] > 0 and p is not None and p.feasible and p.m:
            nbytes = p.m * self.layer_bytes
            plan.transfers.append((self.link, nbytes))
            led.streamed_bytes += nbytes

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        # The controller is asked every iteration while KV is short. Otherwise
        # it can only HOLD (nothing remapped: exact) or RESTORE, which is not
        # urgent: then it is asked at most every ``restore_period_s``
        # (``max_feasible_alpha`` costs O(n) plan_layers calls per model).
        arb = getattr(inst.sim, "arbiter", None)
        if arb is not None and inst.kv.available < self.controller.low_watermark:
            # node arbiter: idle memory first (free, returned, idle peers' KV);
            # the controller may remap only what that leaves short
            arb.grow(inst, arb.high[inst.idx] - inst.kv.available)
        if inst.kv.available >= self.controller.low_watermark:
            led = ledger_of(inst)
            if not any(led.alpha.values()) or now - self._last_decision < self.restore_period_s:
                self.skipped += 1
                return
        self.step(now)

    def step(self, now: float) -> Action:
        """One controller decision with this instance as the observer/borrower;
        with ``restore_all`` (no arbiter), decisions repeat while each is an
        applied RESTORE (Alg. 1's "foreach tensor in added KV cache")."""
        led = ledger_of(self.inst)
        before = led.restores
        action = self._step(now)
        if self.restore_all and getattr(self.inst.sim, "arbiter", None) is None:
            while action is Action.RESTORE and led.restores > before and any(led.alpha.values()):
                before = led.restores
                action = self._step(now)
        return action

    def _step(self, now: float) -> Action:
        inst = self.inst
        self._last_decision = now
        led = ledger_of(inst)
        led.refresh_activity(now)
        by_name = {m.cfg.name: m for m in led.members}
        states = [self._hook(m)._state(led, inst) for m in led.members]
        self.controller.observe(inst.kv.available, states)
        d = self.controller.decide()
        self.decisions[d.action.value] = self.decisions.get(d.action.value, 0) + 1
        arb = getattr(inst.sim, "arbiter", None)
        if d.action is Action.REMAP and arb is not None and by_name[d.model] is inst:
            arb.self_remaps_held += 1  # the arbiter never remaps a model into its own KV
        elif d.action is Action.REMAP:
            lender = by_name[d.model]
            if arb is not None:
                blocks = arb.remap(lender, inst)
            else:
                blocks = int(self._hook(lender).layer_bytes // inst.cfg.kv_block_bytes)
                inst.kv.resize(inst.kv.capacity + blocks)
            if blocks == 0 and arb is not None:  # refused by the arbiter: a HOLD
                return Action.HOLD
            led.loans[lender.idx].append((inst, blocks))
            led.alpha[lender.idx] = d.target_remapped
            led.plan[lender.idx] = d.plan
            led.max_alpha[lender.idx] = max(led.max_alpha[lender.idx], d.target_remapped)
            led.remaps += 1
        elif d.action is Action.RESTORE:
            lender = by_name[d.model]
            borrower, blocks = led.loans[lender.idx][-1]
            if arb is not None and led.active[lender.idx]:
                ok = False  # drained below
            elif arb is not None:
                # from free budget or idle borrowed KV of any model, all or nothing,
                # every participating model keeping its high watermark free
                ok = arb.restore(lender, lambda i: self._hook(i).controller.high_watermark if i in led.members else 0)
            else:
                kv = borrower.kv
                ok = kv.available - blocks >= self._hook(borrower).controller.high_watermark
                if ok:
                    kv.resize(kv.capacity - blocks)
            if ok:
                self._restored(led, lender, d.plan)
            elif arb is None or not led.active[lender.idx]:
                led.deferred_restores += 1
        elif d.reason.startswith("KV blocks running out"):
            led.holds_blocked += 1
        if arb is not None:
            self._drain_active_lenders(led, arb)
        return d.action

    def _drain_active_lenders(self, led: _Ledger, arb) -> None:
        """X1 rule of the node arbiter (not Oneiros's): a lender that has work
        takes its layers back by draining -- borrowed memory is gathered as it
        frees up, before every plan on the GPU, so a borrower that fills every
        free block cannot hold the layer forever; a lender that falls idle
        again gives up its drain (its layers may stay lent)."""
        for m in led.members:
            if led.alpha[m.idx] > 0 and led.active[m.idx]:
                if arb.restore(m, drain=True):
                    self._restored(led, m, None)
            elif m in arb.restoring[m.cfg.gpu]:
                arb.cancel_restore(m)

    def _restored(self, led: _Ledger, lender: Instance, plan: LayerPlan | None) -> None:
        """Bookkeeping of one restored layer; the lender then streams ``plan``: the
        controller's ``restore_plan`` for the alpha left (asked here when None), which
        streams unhidden where that alpha no longer meets Eq. 4/5."""
        led.loans[lender.idx].pop()
        led.alpha[lender.idx] -= 1
        led.restores += 1
        a = led.alpha[lender.idx]
        if plan is None:
            plan = self.controller.restore_plan(self._hook(lender)._state(led, lender), a)
        led.plan[lender.idx] = plan

    def stats(self) -> dict[str, Any]:
        """Common shape (``core.stats``). ``gpu_*`` counters are the GPU's shared
        ledger (the same on every participating instance of that GPU)."""
        counters: dict[str, Any] = {f"decisions.{k}": v for k, v in sorted(self.decisions.items())}
        counters["decisions_skipped"] = self.skipped
        gauges: dict[str, Any] = {
            "cap_layers": self.cap,
            "low_watermark_blocks": self.controller.low_watermark,
            "high_watermark_blocks": self.controller.high_watermark,
        }
        if self.inst.sim is not None:
            led = ledger_of(self.inst)
            i = self.inst.idx
            counters.update(
                {
                    "gpu_remaps": led.remaps,
                    "gpu_restores": led.restores,
                    "gpu_deferred_restores": led.deferred_restores,
                    "gpu_streamed_gb": led.streamed_bytes / 1e9,
                }
            )
            gauges.update(
                {
                    "alpha_final": led.alpha[i],
                    "alpha_max": led.max_alpha[i],
                    "borrowed_blocks_final": led.lent_blocks_to(self.inst),
                }
            )
        return mechanism_stats("oneiros", "oneiros", self.inst.cfg.name, counters, gauges)
