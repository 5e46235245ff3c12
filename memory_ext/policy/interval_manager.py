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
  ``max(n t_c, m T_T)``; the answer is the largest ``m`` within ``B``. With no
  slack this is Eq. 5, ``T_T m <= t_c n`` with ``m = alpha + 2``. More slots
  do not help further in this model (the copy stream is already never idle).

Invariants: ``0 <= layers <= n``; the modelled iteration with ``layers``
streamed meets the SLO, with ``layers + 1`` it would not (or ``layers == n``);
``layers == 0`` with ``feasible False`` when compute alone exceeds the SLO.
``interval`` is the largest Select-N interval that streams ``layers`` layers
(``n // layers``; ``n + 1`` = stream nothing), the one ``LinkCoordinator``
keeps among intervals of equal layer count. Memory freed is
``layers - slots`` layers (the streamed layers share ``slots`` buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layer_profile import LayerProfile
from .select_n import GpuDemand, LayerTiming, iteration_latency, no_offload_interval, offloaded_layers

__all__ = ["StreamBudget", "IntervalManager", "stream_budget", "iteration_seconds", "demand_from_profile"]


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
    iteration_s: float  # modelled iteration time with ``layers`` streamed, uncontended
    feasible: bool  # False: not even streaming nothing meets the SLO


def iteration_seconds(n_layers: int, layers: int, t_c: float, t_tr: float, slots: int, fixed_s: float = 0.0) -> float:
    """Modelled iteration time with ``layers`` streamed (module docstring).

    ``slots == 1`` streams every ``n // layers``-th layer (the largest interval
    with that count)."""
    if layers <= 0:
        return n_layers * t_c + fixed_s
    if slots == 1:
        return iteration_latency(n_layers, n_layers // layers, LayerTiming(t_c, t_tr)) + fixed_s
    return max(n_layers * t_c, layers * t_tr) + fixed_s


def stream_budget(
    n_layers: int, t_c: float, t_tr: float, slo_s: float, slots: int = 1, fixed_s: float = 0.0
) -> StreamBudget:
    """The rule of the module docstring for one layer time ``t_c``."""
    n = _int("n_layers", n_layers)
    t_c = _pos("t_c", t_c)
    t_tr = _pos("t_tr", t_tr)
    slo_s = _pos("slo_s", slo_s)
    slots = _int("slots", slots)
    fixed_s = _pos("fixed_s", fixed_s, zero_ok=True)
    base = n * t_c + fixed_s
    tol = 1e-9 * slo_s
    ms = lambda s: f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"  # noqa: E731
    if base > slo_s + tol:
        return StreamBudget(
            0,
            no_offload_interval(n),
            f"SLO {ms(slo_s)} unattainable: compute alone takes {ms(base)}",
            slots,
            base,
            False,
        )
    if slots == 1:
        budget = slo_s - fixed_s
        timing = LayerTiming(t_c, t_tr)
        i = next(i for i in range(1, n + 2) if iteration_latency(n, i, timing) <= budget + tol)
        layers = offloaded_layers(n, i)
        rule = "one slot, Select-N Fig. 7"
    else:
        layers = min(n, int(math.floor((slo_s - fixed_s + tol) / t_tr)))
        rule = f"{slots} slots, Oneiros Eq. 5 with slack"
    it = iteration_seconds(n, layers, t_c, t_tr, slots, fixed_s)
    interval = n // layers if layers else no_offload_interval(n)
    if layers == n:
        why = f"all {n} layers stream within SLO {ms(slo_s)} ({rule}): {ms(it)}"
    else:
        more = next(k for k in range(layers + 1, n + 1) if slots > 1 or n // (n // k) == k)
        nxt = iteration_seconds(n, more, t_c, t_tr, slots, fixed_s)
        why = f"SLO {ms(slo_s)} binds ({rule}): {layers} of {n} layers take {ms(it)}, {more} would take {ms(nxt)}"
    return StreamBudget(layers, interval, why, slots, it, True)


class IntervalManager:
    """Per-iteration streaming budget of one model on one device.

    ``decide(batch)`` for a decode iteration of ``batch`` sequences under the
    TBT SLO; ``decide_prefill(tokens, slo_s)`` for a prefill of ``tokens``
    prompt tokens under its own (TTFT) budget. Stateless beyond its arguments.
    """

    def __init__(self, profile: LayerProfile, tbt_slo_s: float, slots: int = 1, fixed_s: float = 0.0) -> None:
        if not isinstance(profile, LayerProfile):
            raise ValueError(f"profile must be a LayerProfile, got {type(profile).__name__}")
        self.profile = profile
        self.tbt_slo_s = _pos("tbt_slo_s", tbt_slo_s)
        self.slots = _int("slots", slots)
        self.fixed_s = _pos("fixed_s", fixed_s, zero_ok=True)

    def decide(self, batch: int) -> StreamBudget:
        p = self.profile
        t_c = p.decode_layer_seconds(_int("batch", batch))
        return stream_budget(p.n_layers, t_c, p.layer_transfer_s, self.tbt_slo_s, self.slots, self.fixed_s)

    def streamable_layers(self, batch: int) -> int:
        return self.decide(batch).layers

    def decide_prefill(self, tokens: int, slo_s: float) -> StreamBudget:
        p = self.profile
        t_c = p.prefill_layer_seconds(_int("tokens", tokens))
        return stream_budget(p.n_layers, t_c, p.layer_transfer_s, slo_s, self.slots, self.fixed_s)


def demand_from_profile(
    name: str,
    manager: IntervalManager,
    batch: int,
    max_interval: int | None = None,
    link_bytes_per_s: float | None = None,
) -> GpuDemand:
    """A ``LinkCoordinator`` demand for the GPU ``name`` serving ``batch``.

    ``min_interval``: the smallest interval meeting the GPU's SLO (None if
    none does), so a GPU with more SLO slack may take smaller intervals;
    ``iter_times``: the modelled iteration time at every interval, so each
    interval's transfer rate is bytes per *its* iteration (Fig. 8 l. 4-13
    with the per-interval time). ``link_bytes_per_s`` overrides the
    profile's bandwidth (e.g. the share left on a contended link).
    """
    p = manager.profile
    n = p.n_layers
    t_c = p.decode_layer_seconds(_int("batch", batch))
    bw = p.link_bytes_per_s if link_bytes_per_s is None else _pos("link_bytes_per_s", link_bytes_per_s)
    t_tr = p.layer_bytes / bw
    b = stream_budget(n, t_c, t_tr, manager.tbt_slo_s, manager.slots, manager.fixed_s)
    if manager.slots == 1:
        timing = LayerTiming(t_c, t_tr)
        times = {i: iteration_latency(n, i, timing) + manager.fixed_s for i in range(1, n + 2)}
    else:
        times = {i: iteration_seconds(n, n // i, t_c, t_tr, manager.slots, manager.fixed_s) for i in range(1, n + 2)}
    tol = 1e-9 * manager.tbt_slo_s
    ok = [i for i, t in times.items() if t <= manager.tbt_slo_s + tol] if b.feasible else []
    return GpuDemand(name, n, p.layer_bytes, b.iteration_s, min(ok) if ok else None, max_interval, iter_times=times)
