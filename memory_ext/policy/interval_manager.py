"""How many decoder layers may stream from host memory per iteration (S1/S2, O4/O5).

``IntervalManager(profile, tbt_slo_s, slots)`` answers, from a ``LayerProfile``
and a per-iteration SLO, how many layers may be streamed host -> device in one
decode iteration without the iteration exceeding the SLO. Numbers in,
decisions out; standard library only.

Notation: ``n`` layers, ``t_c`` one layer's compute at this batch
(``profile.decode_layer_seconds``), ``T_T`` one layer's transfer
(``profile.layer_transfer_s``, uncontended), ``f`` the per-iteration time
outside the decoder layers (LM head, sampling, scheduling; ``fixed_s``: the
profile does not measure it), budget ``B = tbt_slo_s - f``.

Rule applied, by the number of device slots the streamed layers rotate through:

* ``slots == 1`` (one staging buffer): Select-N's latency model (Fig. 7, the
  existing ``select_n.optimal_interval`` / ``iteration_latency``): with
  interval ``i`` the ``m = n // i`` streamed layers each stall
  ``max(0, T_T - (i - 1) t_c)``; the answer is the smallest interval meeting
  ``B``. Why: with one slot a copy can only start once the previous streamed
  layer has computed, which is exactly Fig. 7. With no slack (``B = n t_c``)
  and ``i`` dividing ``n`` this is Oneiros Eq. 4 with ``m = alpha + 1``:
  ``T_T m <= t_c (n - m)``.
* ``slots >= 2`` (double buffering): Oneiros Eq. 5 generalised to a slack: the
  copy stream may run for the whole iteration, so ``m`` layers take
  ``max(n t_c, m T_T)``; the answer is the largest such ``m`` within ``B``. With no
  slack this is Eq. 5, ``T_T m <= t_c n`` with ``m = alpha + 2``. More slots
  do not help further in this model (the copy stream is already never idle).
  Any ``m`` is allowed (Oneiros places them by ``uniform_interval_layers``);
  ``interval`` is then the mean spacing ``n // m``.

* ``copies_share_compute`` (a CPU device: the copies run on the cores that compute, and one
  OpenMP thread delayed by a copy holds every other one at the next barrier): the copies add to
  the iteration instead of overlapping it, whatever the slots: ``m`` layers take
  ``n t_c + m T_T``; the answer is the largest ``m`` within ``B``, ``interval`` again ``n // m``.
  On a GPU the copy engine runs beside the kernels, and the two rules above apply.

Invariants: ``0 <= layers <= n`` and the modelled iteration with ``layers``
streamed meets the SLO, while the next larger choice would not (one more
layer with two slots, the next smaller interval with one) or ``layers == n``.
With one slot ``interval`` is the smallest Select-N interval (every
``interval``-th layer streams) meeting the SLO, the paper's optimal interval,
and ``layers = n // interval``; ``n + 1`` = stream nothing. ``layers == 0``
with ``feasible False`` when compute alone exceeds the SLO. Memory freed is
``layers - slots`` layers (the streamed layers share ``slots`` buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layer_profile import LayerProfile
from .select_n import GpuDemand, LayerTiming, iteration_latency, no_offload_interval, offloaded_layers

__all__ = [
    "StreamBudget",
    "IntervalManager",
    "stream_budget",
    "iteration_seconds",
    "demand_from_timings",
    "demand_from_profile",
]


def _pos(name: str, v, zero_ok: bool = False) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or v < 0
        or (v == 0 and not zero_ok)
    ):
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v!r}")
    return float(v)


def _int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


@dataclass(frozen=True)
class StreamBudget:
    """One decision: stream ``layers`` per iteration (see module docstring)."""

    layers: int
    interval: int
    reason: str
    slots: int
    iteration_s: float  # modelled iteration time at ``interval``, uncontended
    feasible: bool  # False: not even streaming nothing meets the SLO


def iteration_seconds(
    n_layers: int,
    interval: int,
    t_c: float,
    t_tr: float,
    slots: int = 1,
    fixed_s: float = 0.0,
    copies_share_compute: bool = False,
) -> float:
    """Modelled iteration time when every ``interval``-th layer streams (module docstring)."""
    layers = offloaded_layers(n_layers, interval)
    if copies_share_compute:
        return n_layers * t_c + layers * t_tr + fixed_s
    if slots == 1:
        return iteration_latency(n_layers, interval, LayerTiming(t_c, t_tr)) + fixed_s
    return max(n_layers * t_c, layers * t_tr) + fixed_s


def stream_budget(
    n_layers: int,
    t_c: float,
    t_tr: float,
    slo_s: float,
    slots: int = 1,
    fixed_s: float = 0.0,
    copies_share_compute: bool = False,
) -> StreamBudget:
    """The rule of the module docstring for one layer time ``t_c``: the smallest
    interval whose modelled iteration meets ``slo_s`` (Select-N's optimal
    interval), and the ``n // interval`` layers it streams."""
    n = _int("n_layers", n_layers)
    t_c = _pos("t_c", t_c)
    t_tr = _pos("t_tr", t_tr)
    slo_s = _pos("slo_s", slo_s)
    slots = _int("slots", slots)
    fixed_s = _pos("fixed_s", fixed_s, zero_ok=True)
    none = no_offload_interval(n)
    base = n * t_c + fixed_s
    tol = 1e-9 * slo_s
    ms = lambda s: f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"  # noqa: E731
    if base > slo_s + tol:
        why = f"SLO {ms(slo_s)} unattainable: compute alone takes {ms(base)}"
        return StreamBudget(0, none, why, slots, base, False)
    if copies_share_compute:
        return _serial_budget(n, t_c, t_tr, slo_s, slots, fixed_s, tol, ms)
    if slots == 1:  # latency is non-increasing in the interval: the first hit is the smallest
        i = next(i for i in range(1, none + 1) if iteration_seconds(n, i, t_c, t_tr, 1, fixed_s) <= slo_s + tol)
        layers, it = offloaded_layers(n, i), iteration_seconds(n, i, t_c, t_tr, 1, fixed_s)
        if i == 1:
            why = f"all {n} layers stream within SLO {ms(slo_s)} (one slot, Select-N Fig. 7): {ms(it)}"
        else:
            nxt = iteration_seconds(n, i - 1, t_c, t_tr, 1, fixed_s)
            why = (
                f"SLO {ms(slo_s)} binds (one slot, Select-N Fig. 7): interval {i} streams {layers} of {n} "
                f"layers in {ms(it)}, interval {i - 1} ({n // (i - 1)} layers) would take {ms(nxt)}"
            )
        return StreamBudget(layers, i, why, slots, it, True)
    # slots >= 2: any count m, placed by Oneiros's uniform_interval_layers(n, m)
    layers = min(n, int(math.floor((slo_s - fixed_s + tol) / t_tr)))
    it = max(n * t_c, layers * t_tr) + fixed_s
    i = n // layers if layers else none
    if layers == n:
        why = f"all {n} layers stream within SLO {ms(slo_s)} ({slots} slots, Oneiros Eq. 5 with slack): {ms(it)}"
    else:
        nxt = max(n * t_c, (layers + 1) * t_tr) + fixed_s
        why = (
            f"SLO {ms(slo_s)} binds ({slots} slots, Oneiros Eq. 5 with slack): {layers} of {n} layers take "
            f"{ms(it)}, {layers + 1} would take {ms(nxt)}"
        )
    return StreamBudget(layers, i, why, slots, it, True)


def _serial_budget(n: int, t_c: float, t_tr: float, slo_s: float, slots: int, fixed_s: float, tol: float, ms):
    """``stream_budget`` when the copies take the compute's time (module docstring)."""
    layers = min(n, max(0, int(math.floor((slo_s - fixed_s - n * t_c + tol) / t_tr))))
    it = n * t_c + layers * t_tr + fixed_s
    i = n // layers if layers else no_offload_interval(n)
    if layers == n:
        why = f"all {n} layers stream within SLO {ms(slo_s)} (copies on the compute's cores): {ms(it)}"
    else:
        nxt = it + t_tr
        why = (
            f"SLO {ms(slo_s)} binds (copies on the compute's cores, added to it): {layers} of {n} layers take "
            f"{ms(it)}, {layers + 1} would take {ms(nxt)}"
        )
    return StreamBudget(layers, i, why, slots, it, True)


class IntervalManager:
    """Per-iteration streaming budget of one model on one device.

    ``decide(batch)`` for a decode iteration of ``batch`` sequences under the
    TBT SLO; ``decide_prefill(tokens, slo_s)`` for a prefill of ``tokens``
    prompt tokens under its own (TTFT) budget. Stateless beyond its arguments.
    """

    def __init__(
        self,
        profile: LayerProfile,
        tbt_slo_s: float,
        slots: int = 1,
        fixed_s: float = 0.0,
        copies_share_compute: bool = False,
    ) -> None:
        if not isinstance(profile, LayerProfile):
            raise ValueError(f"profile must be a LayerProfile, got {type(profile).__name__}")
        self.profile = profile
        self.tbt_slo_s = _pos("tbt_slo_s", tbt_slo_s)
        self.slots = _int("slots", slots)
        self.fixed_s = _pos("fixed_s", fixed_s, zero_ok=True)
        self.copies_share_compute = bool(copies_share_compute)

    def decide(self, batch: int) -> StreamBudget:
        p = self.profile
        t_c = p.decode_layer_seconds(_int("batch", batch))
        return stream_budget(p.n_layers, t_c, p.layer_transfer_s, self.tbt_slo_s, self.slots, self.fixed_s,
                             self.copies_share_compute)  # fmt: skip

    def streamable_layers(self, batch: int) -> int:
        return self.decide(batch).layers

    def decide_prefill(self, tokens: int, slo_s: float) -> StreamBudget:
        p = self.profile
        t_c = p.prefill_layer_seconds(_int("tokens", tokens))
        return stream_budget(p.n_layers, t_c, p.layer_transfer_s, slo_s, self.slots, self.fixed_s,
                             self.copies_share_compute)  # fmt: skip


def demand_from_timings(
    name: str,
    n_layers: int,
    layer_bytes: int,
    t_c: float,
    t_tr: float,
    slo_s: float,
    slots: int = 1,
    fixed_s: float = 0.0,
    max_interval: int | None = None,
    copies_share_compute: bool = False,
) -> GpuDemand:
    """A ``LinkCoordinator`` demand for the GPU ``name``: ``n_layers`` of ``layer_bytes``,
    one layer's compute ``t_c`` at the batch it serves, one layer's uncontended copy
    ``t_tr``, under ``slo_s`` per iteration.

    ``min_interval``: the smallest interval meeting the SLO (None if none does), so a GPU
    with more SLO slack may take smaller intervals; ``iter_times``: the modelled iteration
    time at every interval, so each interval's transfer rate is bytes per *its* iteration
    (Fig. 8 l. 4-13 with the per-interval time).
    """
    n = _int("n_layers", n_layers)
    b = stream_budget(n, t_c, t_tr, slo_s, slots, fixed_s, copies_share_compute)
    times = {i: iteration_seconds(n, i, t_c, t_tr, slots, fixed_s, copies_share_compute) for i in range(1, n + 2)}
    min_i = b.interval if b.feasible else None
    return GpuDemand(name, n, _int("layer_bytes", layer_bytes), b.iteration_s, min_i, max_interval, iter_times=times)


def demand_from_profile(
    name: str,
    manager: IntervalManager,
    batch: int,
    max_interval: int | None = None,
    link_bytes_per_s: float | None = None,
) -> GpuDemand:
    """``demand_from_timings`` from a performance record at ``batch``. ``link_bytes_per_s``
    overrides the profile's bandwidth (e.g. the share left on a contended link)."""
    p = manager.profile
    t_c = p.decode_layer_seconds(_int("batch", batch))
    bw = p.link_bytes_per_s if link_bytes_per_s is None else _pos("link_bytes_per_s", link_bytes_per_s)
    return demand_from_timings(name, p.n_layers, p.layer_bytes, t_c, p.layer_bytes / bw, manager.tbt_slo_s,
                               manager.slots, manager.fixed_s, max_interval,
                               manager.copies_share_compute)  # fmt: skip
