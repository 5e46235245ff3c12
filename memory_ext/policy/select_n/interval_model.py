"""Select-N S1: the offloading interval's latency model and the optimal interval.

A model has ``L`` decoder layers, every one with the same per-layer compute time
``t_c`` (paper §4.3: identical layers, identical input shape) and the same time
``t_tr`` to copy one layer's weights host -> GPU. Offloading interval ``i >= 1``
means layers ``i, 2i, 3i, ...`` (1-based) live in host memory, so
``n(i) = L // i`` layers are offloaded; ``i > L`` offloads nothing.

Reading of Fig. 7: the copy of a group's offloaded layer (its last layer) starts
when compute of the group's first layer starts and must be complete before the
offloaded layer itself computes. It therefore overlaps the ``i - 1`` resident
layers in front of it. The copy stream is always idle at a group start (the
previous copy finished before the previous offloaded layer could run), so
groups do not interfere and each group stalls independently::

    latency(i) = L * t_c + (L // i) * max(0, t_tr - (i - 1) * t_c)

Layers after the last full group (``L % i`` of them) are resident and only add
compute. Consequences used below and tested: latency is non-increasing in ``i``
(fewer offloaded layers, longer overlap), non-decreasing in ``t_tr`` and
non-decreasing in ``t_c`` for fixed ``i`` (the stall shrinks by at most
``n * (i - 1) < L`` per unit of ``t_c`` while compute grows by ``L``).

Ambiguity: the paper also says interval 1 "reduces to DeepSpeed", which
prefetches during the previous layer (one layer of overlap); Fig. 7 literally
gives ``i - 1`` layers of overlap, i.e. none for ``i = 1``. We follow Fig. 7 (the
single staging buffer is busy until the previous offloaded layer finishes).
The paper's closed form (``L_offload = floor(t_compute(1+delta)/t_trans)``,
interval ``floor(L / L_offload)``) is garbled in the text and its ``floor`` can
offload more layers than ``L_offload``; we do not use it. The analyzer instead
picks the smallest ``i`` whose modelled latency meets the SLO, which is the
paper's definition of the optimal interval (§4.2, §4.3).

SLO meaning (ambiguity, used by S2): the workflow passes an absolute SLO (target minus
waiting time), while the analyzer's formula uses ``delta``, "the SLO quotient
over the computation time without offloading". Both are supported:
``SloKind.ABSOLUTE`` (budget = slo seconds per iteration) and
``SloKind.SLOWDOWN`` (budget = (1 + slo) * L * t_c). Table 1 only has its shape
(interval shrinks as batch/sequence grow, "larger ... omitted, as the optimal
interval is one") under SLOWDOWN: with an absolute budget, bigger inputs grow
the base latency and eventually become infeasible.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._inputs import EPS as _EPS
from ._inputs import positive_int as _pos_int
from ._inputs import positive_number as _pos_num


class SloKind(str, enum.Enum):
    ABSOLUTE = "absolute"  # slo = seconds allowed for one iteration of the phase
    SLOWDOWN = "slowdown"  # slo = delta, allowed fractional slowdown over L * t_c


@dataclass(frozen=True)
class LayerTiming:
    """Measured per-layer compute time and per-layer host->GPU transfer time."""

    compute_s: float
    transfer_s: float

    def __post_init__(self) -> None:
        _pos_num("compute_s", self.compute_s)
        _pos_num("transfer_s", self.transfer_s, allow_zero=True)


def offloaded_layers(num_layers: int, interval: int) -> int:
    """Layers living in host memory at this interval (``i > L`` offloads none)."""
    _pos_int("num_layers", num_layers)
    _pos_int("interval", interval)
    return num_layers // interval


def no_offload_interval(num_layers: int) -> int:
    """The interval value that stands for "offload nothing" (``L + 1``)."""
    return _pos_int("num_layers", num_layers) + 1


def iteration_latency(num_layers: int, interval: int, timing: LayerTiming) -> float:
    """Modelled time of one iteration (see module docstring for the formula)."""
    n = offloaded_layers(num_layers, interval)
    stall = max(0.0, timing.transfer_s - (interval - 1) * timing.compute_s)
    return num_layers * timing.compute_s + n * stall


def _budget(num_layers: int, timing: LayerTiming, slo: float, kind: SloKind) -> float:
    if kind is SloKind.ABSOLUTE:
        return slo
    return (1.0 + slo) * num_layers * timing.compute_s


def meets_slo(
    num_layers: int, interval: int, timing: LayerTiming, slo: float, slo_kind: SloKind = SloKind.ABSOLUTE
) -> bool:
    slo_kind = SloKind(slo_kind)
    _pos_num("slo", slo, allow_zero=slo_kind is SloKind.SLOWDOWN)
    budget = _budget(num_layers, timing, slo, slo_kind)
    return iteration_latency(num_layers, interval, timing) <= budget * (1 + _EPS)


def optimal_interval(
    num_layers: int, timing: LayerTiming, slo: float, slo_kind: SloKind = SloKind.ABSOLUTE
) -> int | None:
    """Smallest interval meeting the SLO; ``L + 1`` if only "no offload" does;
    ``None`` if not even the un-offloaded model meets it."""
    _pos_int("num_layers", num_layers)
    # latency is non-increasing in the interval, so scan upward and stop at the first hit
    for i in range(1, num_layers + 2):
        if meets_slo(num_layers, i, timing, slo, slo_kind):
            return i
    return None
