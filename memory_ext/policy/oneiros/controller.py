"""Oneiros O2 (section 5.1, Alg. 1): when to remap a layer and when to restore one, one decision
per step from the last observation."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._checks import check_int as _int
from .layer_plan import BufferMode, LayerPlan, plan_layers, unhidden_plan
from .models import ModelState, model_limit, remap_order


class Action(str, enum.Enum):
    HOLD = "hold"  # change nothing
    REMAP = "remap"  # lend one more layer of ``model`` to the KV cache
    RESTORE = "restore"  # give KV memory back to ``model``'s weights


@dataclass(frozen=True)
class RemapDecision:
    """One step's decision.

    For REMAP/RESTORE, ``model`` is set and ``target_remapped`` is that
    model's alpha after the step, with ``plan`` the O5 layer plan for it.
    For HOLD, ``model``/``plan`` are None. ``reason`` is always set;
    ``limits`` gives each model's current alpha limit and its binding rule.
    """

    action: Action
    model: str | None
    target_remapped: int
    plan: LayerPlan | None
    reason: str
    limits: dict[str, tuple[int, str]] = field(default_factory=dict)


class OneirosController:
    """O2 (section 5.1, Alg. 1): remap one layer when KV blocks run out,
    restore one when the KV memory it lent is empty.

    One decision per call, checked in this order:

    * ``free_kv_blocks < low_watermark`` (Alg. 1 l. 3-5) -> REMAP one more
      layer of the first model in ``remap_order`` below its limit; none ->
      HOLD with a reason. A starved model (``ModelState.starved``) is bounded
      by n - 1 and its cap only, its plan streams even where Eq. 4/5 fail.
      A model whose (re-measured) limit fell below its remapped count is
      simply not remapped further: nothing is taken back because of the limit.
    * Alg. 1 l. 6-12, "foreach tensor in added KV cache: if tensor is empty,
      update the remapping": among remapped models in *reverse*
      ``remap_order`` (active models get their weights back first), the
      first whose lent layer is empty -> RESTORE one layer of it, its plan
      from ``restore_plan`` (feasible even where Eq. 4/5 no longer hold for
      the alpha left: those layers keep streaming, unhidden).
    * otherwise HOLD.

    Reading of "the lent tensor is empty", engine-agnostic: the pool holding
    the layer (``ModelState.lent_free_blocks``, else the observed pool) has
    ``free >= blocks_per_layer`` blocks not in use, so it can shrink by one
    layer without touching a block any request holds (unreferenced prefix
    cache counts as not in use, as in the remap trigger: a radix-cache engine
    keeps its pool full of it, so "free without evicting" would never come),
    and ``free - blocks_per_layer >= high_watermark`` so the restore cannot
    re-trigger a remap on the next step (``high_watermark >= low_watermark``;
    the default ``high_watermark = low_watermark`` is Alg. 1 with no extra
    hysteresis). The engine applies a RESTORE only if that still holds when
    it shrinks the pool; that is mechanism, not policy. Remapping is enabled
    (``remap_enabled``, Alg. 1's ``enable_remap``) iff some model has alpha > 0;
    when every lent tensor is empty all come back, one per call.

    The controller holds no state beyond its configuration and the last
    observation: the engine reports applied alphas in ``observe``.
    """

    def __init__(
        self, low_watermark: int, high_watermark: int | None = None, mode: BufferMode = BufferMode.AUTO
    ) -> None:
        self.low_watermark = _int("low_watermark", low_watermark, 0)
        if high_watermark is None:
            high_watermark = self.low_watermark
        self.high_watermark = _int("high_watermark", high_watermark, 0)
        if self.high_watermark < self.low_watermark:
            raise ValueError(f"high_watermark must be >= low_watermark ({low_watermark}), got {high_watermark}")
        try:
            self.mode = BufferMode(mode)
        except ValueError:
            raise ValueError(f"mode must be one of {[m.value for m in BufferMode]}, got {mode!r}") from None
        self._free: int | None = None
        self._models: tuple[ModelState, ...] = ()

    def observe(self, free_kv_blocks: int, models: Sequence[ModelState]) -> None:
        """Record the pool's free KV blocks and every model's state."""
        free = _int("free_kv_blocks", free_kv_blocks, 0)
        models = tuple(models)
        for m in models:
            if not isinstance(m, ModelState):
                raise ValueError(f"models must hold ModelState items, got {type(m).__name__}")
        remap_order(models)  # validates names and priorities
        self._free, self._models = free, models

    @property
    def remap_enabled(self) -> bool:
        return any(m.remapped > 0 for m in self._models)

    def _plan(self, model: ModelState, alpha: int) -> LayerPlan:
        if alpha == 0:
            return plan_layers(model.n_layers, 0, model.layer_transfer_s, 1.0, self.mode)
        if model.compute_s is None:
            plan = LayerPlan(model.n_layers, alpha, 0, 0, (), 0, False, "infeasible: no T_compute measured")
        else:
            t_layer = model.compute_s / model.n_layers
            plan = plan_layers(model.n_layers, alpha, model.layer_transfer_s, t_layer, self.mode)
        if model.starved and not plan.feasible:
            return unhidden_plan(model.n_layers, alpha, f"starved: no step runs to hide copies behind ({plan.reason})")
        return plan

    def restore_plan(self, model: ModelState, alpha: int) -> LayerPlan:
        """The plan a RESTORE to ``alpha`` lent layers streams: the O5 plan, or, where Eq. 4/5 no
        longer hold for ``alpha`` (the layers were lent while starved, or the timings were
        re-measured), ``unhidden_plan``: one layer comes back and the rest keep streaming through
        two slots. Always feasible: a restore never waits for every lent layer to fit at once."""
        plan = self._plan(model, alpha)
        if plan.feasible:
            return plan
        return unhidden_plan(model.n_layers, alpha, f"restore one layer: {plan.reason}")

    def lent_layer_empty(self, model: ModelState) -> bool:
        """Alg. 1's "tensor is empty" for ``model``'s newest lent layer (class docstring)."""
        if self._free is None:
            raise RuntimeError("lent_layer_empty() called before observe()")
        vacant = self._free if model.lent_free_blocks is None else model.lent_free_blocks
        return model.remapped > 0 and vacant - model.blocks_per_layer >= self.high_watermark

    def decide(self) -> RemapDecision:
        """Decide one step from the last observation (see class docstring)."""
        if self._free is None:
            raise RuntimeError("decide() called before observe()")
        by_name = {m.name: m for m in self._models}
        limits = {m.name: model_limit(m, self.mode) for m in self._models}
        order = remap_order(self._models)

        if self._free < self.low_watermark:
            for name in order:
                m, (lim, _) = by_name[name], limits[name]
                if m.remapped < lim:
                    target = m.remapped + 1
                    return RemapDecision(
                        Action.REMAP,
                        name,
                        target,
                        self._plan(m, target),
                        f"KV blocks running out: free {self._free} < low watermark {self.low_watermark}",
                        limits,
                    )
            detail = "; ".join(f"{n}: {limits[n][0]} ({limits[n][1]})" for n in order) or "no models"
            return RemapDecision(
                Action.HOLD, None, 0, None, f"KV blocks running out but no model can remap further: {detail}", limits
            )

        for name in reversed(order):
            m = by_name[name]
            if self.lent_layer_empty(m):
                vacant = self._free if m.lent_free_blocks is None else m.lent_free_blocks
                target = m.remapped - 1
                return RemapDecision(
                    Action.RESTORE,
                    name,
                    target,
                    self.restore_plan(m, target),
                    f"lent layer empty: {vacant} free blocks hold its {m.blocks_per_layer} and leave "
                    f">= {self.high_watermark}",
                    limits,
                )
        if self.remap_enabled:
            return RemapDecision(Action.HOLD, None, 0, None, "lent KV memory still in use", limits)
        return RemapDecision(Action.HOLD, None, 0, None, "KV pool within watermarks", limits)
