"""Oneiros remapping controller (features O2-O5) as a plain policy object.

Numbers in, decisions out: this module never touches memory, tensors or an
engine. The engine reports KV-pool occupancy and per-model timings with
``OneirosController.observe`` and applies the ``RemapDecision`` returned by
``OneirosController.decide``; it reports the applied state back on the next
``observe``. Standard library only.

Paper: "Oneiros: parameter remapping" (shared/seeds), sections 5.1-5.5, 7.5.

Vocabulary (paper symbols):
  n        layers of a model (all layers identical, paper footnote 4)
  alpha    remapped layers: their weight memory is lent to the KV cache
  beta     GPU slots (one layer each) shared by the rotating layers
  m        layers transferred CPU->GPU per token, m = alpha + beta
  T_T      transfer time of one layer, profiled offline
  T_c      compute time of one layer = T_compute / n
  T_compute  measured run time of one pass: a decode step for an active
           model, a prefill for an inactive one (section 5.3)

Invariants enforced everywhere:
  * 0 <= alpha <= n - 1: no model is ever remapped in its entirety;
  * alpha <= the model's profiled cap;
  * a REMAP is only ever offered if its plan's timing condition (Eq. 4 or
    Eq. 5) holds; otherwise the answer is "no remap" with a reason. A RESTORE
    carries the plan for the alpha left, which is infeasible (``feasible``
    False, with a reason) when the model's limit fell below it since.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._checks import check_int as _int

__all__ = [
    "BufferMode",
    "Action",
    "LayerPlan",
    "ModelState",
    "RemapDecision",
    "OneirosController",
    "max_layers_by_compute",
    "uniform_interval_layers",
    "plan_layers",
    "max_feasible_alpha",
    "model_limit",
    "remap_order",
]

# Relative slack for the timing inequalities so that exact paper boundaries
# (e.g. 3.0 * 10 <= 1.0 * 30) are not lost to float rounding.
_REL_EPS = 1e-12


def _leq(a: float, b: float) -> bool:
    return a <= b + _REL_EPS * max(abs(a), abs(b), 1.0)


# --------------------------------------------------------------------------
# Input validation: every error is a ValueError whose message starts with
# the offending field's name.
# --------------------------------------------------------------------------


def _pos(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _num(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------
# O4 -- how many layers
# --------------------------------------------------------------------------


def max_layers_by_compute(t_transfer: float, t_compute: float) -> int:
    """O4 (section 5.3): the largest N with ``T_T * N <= T_compute``.

    ``t_compute`` is the measured decode-step time for an active model and
    the prefill time for an inactive one. This is a necessary bound only;
    Eq. 4/5 (``plan_layers``) are stricter and also apply.
    """
    t_transfer = _pos("t_transfer", t_transfer)
    t_compute = _pos("t_compute", t_compute)
    n = int(math.floor(t_compute / t_transfer))
    # guard the floor against rounding just below an exact boundary
    if _leq(t_transfer * (n + 1), t_compute):
        n += 1
    return n


# --------------------------------------------------------------------------
# O5 -- which layers
# --------------------------------------------------------------------------


class BufferMode(str, enum.Enum):
    """How many shared slots (beta) the rotating layers get.

    AUTO is the paper's dynamic scheme (C in section 7.5): beta = 1 while
    Eq. 4 holds, else beta = 2 if Eq. 5 holds. SINGLE (A) and DOUBLE (B)
    force one rule.
    """

    AUTO = "auto"
    SINGLE = "single"
    DOUBLE = "double"


def uniform_interval_layers(n_layers: int, m: int, offset: int = 0) -> tuple[int, ...]:
    """Evenly spaced ``m`` of ``n_layers`` layer indices (0-based) on the circle.

    Index i is ``(offset + floor(i * n / m)) mod n``; consecutive gaps
    (including the wrap-around gap from the last back to the first) differ by
    at most one layer, which maximises the minimum gap (Eq. 3). Sorted.
    """
    n_layers = _int("n_layers", n_layers, 1)
    m = _int("m", m, 0)
    offset = _int("offset", offset, 0)
    if m > n_layers:
        raise ValueError(f"m must be <= n_layers ({n_layers}), got {m}")
    return tuple(sorted((offset + (i * n_layers) // m) % n_layers for i in range(m)))


def _min_gap(n_layers: int, layers: Sequence[int]) -> int:
    """Smallest circular distance between consecutive selected layers."""
    if not layers:
        return 0
    gaps = [b - a for a, b in zip(layers, layers[1:])]
    gaps.append(layers[0] + n_layers - layers[-1])
    return min(gaps)


@dataclass(frozen=True)
class LayerPlan:
    """Result of O5 for one model and one alpha.

    If ``feasible``: ``m = alpha + beta`` layers in ``shared_layers`` rotate
    through ``beta`` GPU slots, ``n - m`` layers stay resident, so the GPU
    holds ``n - alpha`` layers' worth of weights. If not feasible: ``beta``
    and ``m`` are 0, ``shared_layers`` is empty and ``reason`` says why.
    For alpha == 0 the plan is trivially feasible with no shared layers.
    """

    n_layers: int
    alpha: int
    beta: int
    m: int
    shared_layers: tuple[int, ...]
    min_gap: int
    feasible: bool
    reason: str

    @property
    def resident_layers(self) -> int:
        return self.n_layers - self.m if self.feasible else self.n_layers


def _eq4(n: int, alpha: int, t_transfer: float, t_layer: float) -> bool:
    # Eq. 4, one slot: T_T (alpha+1) <= T_c (n - alpha - 1)
    return alpha + 1 <= n and _leq(t_transfer * (alpha + 1), t_layer * (n - alpha - 1))


def _eq5(n: int, alpha: int, t_transfer: float, t_layer: float) -> bool:
    # Eq. 5, double buffering: T_T (alpha+2) <= T_c n
    return alpha + 2 <= n and _leq(t_transfer * (alpha + 2), t_layer * n)


def plan_layers(
    n_layers: int,
    alpha: int,
    t_transfer: float,
    t_layer_compute: float,
    mode: BufferMode = BufferMode.AUTO,
    offset: int = 0,
) -> LayerPlan:
    """O5 (section 5.4, Eq. 1-5): choose m and the shared layers for ``alpha``.

    AUTO prefers m = alpha + 1 (least CPU->GPU traffic, objective 2) when
    Eq. 4 holds, else m = alpha + 2 when Eq. 5 holds, else infeasible.
    ``alpha >= n_layers`` raises (never a whole model).
    """
    n_layers = _int("n_layers", n_layers, 1)
    alpha = _int("alpha", alpha, 0)
    t_transfer = _pos("t_transfer", t_transfer)
    t_layer_compute = _pos("t_layer_compute", t_layer_compute)
    try:
        mode = BufferMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {[m.value for m in BufferMode]}, got {mode!r}") from None
    if alpha >= n_layers:
        raise ValueError(f"alpha must be < n_layers ({n_layers}): never remap a whole model, got {alpha}")
    if alpha == 0:
        return LayerPlan(n_layers, 0, 0, 0, (), 0, True, "nothing remapped")

    beta = 0
    if mode in (BufferMode.AUTO, BufferMode.SINGLE) and _eq4(n_layers, alpha, t_transfer, t_layer_compute):
        beta = 1
    elif mode in (BufferMode.AUTO, BufferMode.DOUBLE) and _eq5(n_layers, alpha, t_transfer, t_layer_compute):
        beta = 2
    if beta == 0:
        checked = {BufferMode.AUTO: "Eq. 4 and Eq. 5", BufferMode.SINGLE: "Eq. 4", BufferMode.DOUBLE: "Eq. 5"}[mode]
        return LayerPlan(
            n_layers,
            alpha,
            0,
            0,
            (),
            0,
            False,
            f"infeasible: {checked} violated for n={n_layers}, alpha={alpha}, "
            f"T_T={t_transfer:g}, T_c={t_layer_compute:g}",
        )
    m = alpha + beta
    layers = uniform_interval_layers(n_layers, m, offset)
    eq = "Eq. 4 (single slot)" if beta == 1 else "Eq. 5 (double buffering)"
    return LayerPlan(n_layers, alpha, beta, m, layers, _min_gap(n_layers, layers), True, f"{eq} holds")


def max_feasible_alpha(
    n_layers: int,
    t_transfer: float,
    t_layer_compute: float,
    mode: BufferMode = BufferMode.AUTO,
) -> int:
    """Largest alpha (<= n-1) that ``plan_layers`` accepts; 0 if none.

    Both Eq. 4 and Eq. 5 get harder as alpha grows, so the feasible set is
    an interval starting at 0.
    """
    n_layers = _int("n_layers", n_layers, 1)
    for alpha in range(n_layers - 1, 0, -1):
        if plan_layers(n_layers, alpha, t_transfer, t_layer_compute, mode).feasible:
            return alpha
    return 0


# --------------------------------------------------------------------------
# O3 -- which model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelState:
    """What the engine reports about one model at one step.

    name            unique id
    n_layers        decoder layers
    layer_transfer_s  T_T, profiled CPU->GPU time of one layer
    compute_s       T_compute measured at run time: decode step if
                    ``active``, prefill if inactive; None = not measured yet
                    (then the model is not remapped further)
    active          currently generating tokens
    cap             profiled per-model maximum of remapped layers; clamped to
                    n_layers - 1 (never a whole model)
    remapped        alpha currently applied by the engine
    blocks_per_layer  KV blocks gained by releasing one layer's weights
    priority        scheduler priority, larger = more important (remapped
                    later); None = scheduler gave none
    last_activated  time/sequence of the model's latest activation (MRU)
    lent_free_blocks  KV blocks not in use (free, or holding only
                    unreferenced prefix cache) of the pool that holds this
                    model's most recently lent layer; None = that pool is the
                    observed one, read ``free_kv_blocks`` (the restore rule,
                    Alg. 1 l. 6-12)
    """

    name: str
    n_layers: int
    layer_transfer_s: float
    compute_s: float | None
    active: bool
    cap: int
    remapped: int = 0
    blocks_per_layer: int = 1
    priority: float | None = None
    last_activated: float = 0.0
    lent_free_blocks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        _int("n_layers", self.n_layers, 1)
        _pos("layer_transfer_s", self.layer_transfer_s)
        if self.compute_s is not None:
            _pos("compute_s", self.compute_s)
        if not isinstance(self.active, bool):
            raise ValueError(f"active must be a bool, got {self.active!r}")
        _int("cap", self.cap, 0)
        _int("remapped", self.remapped, 0)
        if self.remapped >= self.n_layers:
            raise ValueError(f"remapped must be < n_layers ({self.n_layers}), got {self.remapped}")
        _int("blocks_per_layer", self.blocks_per_layer, 1)
        if self.priority is not None:
            _num("priority", self.priority)
        _num("last_activated", self.last_activated)
        if self.lent_free_blocks is not None:
            _int("lent_free_blocks", self.lent_free_blocks, 0)


def model_limit(model: ModelState, mode: BufferMode = BufferMode.AUTO) -> tuple[int, str]:
    """Largest alpha allowed for ``model`` now, and which rule bounds it.

    limit = min(n - 1, cap, O4 bound, O5 bound) with T_c = T_compute / n.
    """
    bounds = [(model.n_layers - 1, "never a whole model"), (model.cap, "profiled cap")]
    if model.compute_s is None:
        bounds.append((0, "no T_compute measured"))
    else:
        bounds.append((max_layers_by_compute(model.layer_transfer_s, model.compute_s), "O4 T_T*N <= T_compute"))
        t_layer = model.compute_s / model.n_layers
        bounds.append((max_feasible_alpha(model.n_layers, model.layer_transfer_s, t_layer, mode), "O5 Eq. 4/5"))
    return min(bounds, key=lambda b: b[0])


def remap_order(models: Iterable[ModelState]) -> list[str]:
    """O3 (section 5.2): the order in which models give up layers.

    Inactive models first, then active ones (inactive-before-active holds
    even without priorities; see the reading note below). Within each group:
    if every model of the group has a priority, lowest priority first (ties:
    most recently activated first); if none has one, most recently activated
    first (MRU, the round-robin default). A group mixing priorities and None
    raises ValueError. Remaining ties break by name, so the order is total.

    Reading: section 5.2 says "if the scheduler does not specify priorities
    or all models are active ... round-robin with MRU". Taken literally MRU
    over all models would pick the running model first, contradicting the
    section's first rule (inactive before active). We keep inactive-first and
    apply MRU inside each group. The round robin itself is the scheduler's
    serving order; MRU is the controller's consequence of it.
    """
    models = list(models)
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"name must be unique per model, got {names}")
    order: list[str] = []
    for group in ([m for m in models if not m.active], [m for m in models if m.active]):
        given = [m.priority is not None for m in group]
        if any(given) and not all(given):
            raise ValueError("priority must be given for all models of a group or for none")
        if group and all(given):
            key = lambda m: (m.priority, -m.last_activated, m.name)  # noqa: E731
        else:
            key = lambda m: (-m.last_activated, m.name)  # noqa: E731
        order += [m.name for m in sorted(group, key=key)]
    return order


# --------------------------------------------------------------------------
# O2 -- when to remap: the controller
# --------------------------------------------------------------------------


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
      HOLD with a reason. A model whose (re-measured) limit fell below its
      remapped count is simply not remapped further: nothing is taken back
      because of the limit.
    * Alg. 1 l. 6-12, "foreach tensor in added KV cache: if tensor is empty,
      update the remapping": among remapped models in *reverse*
      ``remap_order`` (active models get their weights back first), the
      first whose lent layer is empty -> RESTORE one layer of it.
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
            return LayerPlan(model.n_layers, alpha, 0, 0, (), 0, False, "infeasible: no T_compute measured")
        return plan_layers(model.n_layers, alpha, model.layer_transfer_s, model.compute_s / model.n_layers, self.mode)

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
                    self._plan(m, target),
                    f"lent layer empty: {vacant} free blocks hold its {m.blocks_per_layer} and leave "
                    f">= {self.high_watermark}",
                    limits,
                )
        if self.remap_enabled:
            return RemapDecision(Action.HOLD, None, 0, None, "lent KV memory still in use", limits)
        return RemapDecision(Action.HOLD, None, 0, None, "KV pool within watermarks", limits)
