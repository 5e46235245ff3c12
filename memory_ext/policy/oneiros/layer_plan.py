"""Oneiros O4 (how many layers: the compute bound, section 5.3) and O5 (which layers: the shared
layers and their GPU slots, section 5.4, Eq. 1-5) for one model."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import check_int as _int
from ._inputs import leq as _leq
from ._inputs import positive as _pos


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


def unhidden_plan(n_layers: int, alpha: int, reason: str) -> LayerPlan:
    """``alpha`` layers lent with no timing condition: ``alpha`` + 2 layers (or every layer
    through one slot when ``alpha`` = n - 1) rotate through their slots, evenly spaced; the
    copies may lengthen a step (the caller's ``reason`` says why that is accepted)."""
    n_layers = _int("n_layers", n_layers, 1)
    alpha = _int("alpha", alpha, 0)
    if alpha >= n_layers:
        raise ValueError(f"alpha must be < n_layers ({n_layers}): never remap a whole model, got {alpha}")
    if alpha == 0:
        return LayerPlan(n_layers, 0, 0, 0, (), 0, True, "nothing remapped")
    beta = min(2, n_layers - alpha)
    layers = uniform_interval_layers(n_layers, alpha + beta)
    return LayerPlan(n_layers, alpha, beta, alpha + beta, layers, _min_gap(n_layers, layers), True, reason)
