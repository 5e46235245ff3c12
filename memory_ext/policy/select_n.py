"""Select-N decision logic (S1-S3): offloading interval, performance record, link coordinator.

Numbers in, decisions out. Standard library only: no torch, no sglang, nothing
here touches memory. Units are the caller's, used consistently: seconds for
times, bytes for sizes, bytes/second for bandwidth.

S1 offloading interval -- latency model
=======================================
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

S2 SLO meaning (ambiguity): the workflow passes an absolute SLO (target minus
waiting time), while the analyzer's formula uses ``delta``, "the SLO quotient
over the computation time without offloading". Both are supported:
``SloKind.ABSOLUTE`` (budget = slo seconds per iteration) and
``SloKind.SLOWDOWN`` (budget = (1 + slo) * L * t_c). Table 1 only has its shape
(interval shrinks as batch/sequence grow, "larger ... omitted, as the optimal
interval is one") under SLOWDOWN: with an absolute budget, bigger inputs grow
the base latency and eventually become infeasible.

Conservative lookup (ambiguity): the paper says "conservatively choosing from
the nearest combination". The SLO is always rounded down (tighter). For
batch/sequence, the safe direction is the one with more compute per layer
under ABSOLUTE (round up: latency grows with ``t_c``, so an interval that meets
the SLO at the bigger cell meets it at the request) and the one with less
compute under SLOWDOWN (round down: there more compute only helps hide
transfers, which is why Table 1 omits the large cells). Requests off the grid in
the safe direction have no entry and get ``None`` (caller rejects). This assumes
the measured ``t_c`` is non-decreasing in batch and in sequence length.

S3 coordinator: Fig. 8 generalised from two GPUs to any number sharing one link.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Phase",
    "SloKind",
    "LayerTiming",
    "offloaded_layers",
    "no_offload_interval",
    "iteration_latency",
    "meets_slo",
    "optimal_interval",
    "PerformanceRecord",
    "PhaseRecords",
    "analyze",
    "analyze_phases",
    "max_interval_for_capacity",
    "GpuDemand",
    "Rejection",
    "CoordinatorDecision",
    "LinkCoordinator",
]

# Relative slack for float comparisons of modelled latency against a budget.
_EPS = 1e-9


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class SloKind(str, enum.Enum):
    ABSOLUTE = "absolute"  # slo = seconds allowed for one iteration of the phase
    SLOWDOWN = "slowdown"  # slo = delta, allowed fractional slowdown over L * t_c


# --------------------------------------------------------------------------- validation


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _pos_num(name: str, v, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)


def _pow2_grid(name: str, values: Iterable[int]) -> tuple[int, ...]:
    vals = tuple(values)
    if not vals:
        raise ValueError(f"{name} must not be empty")
    for v in vals:
        _pos_int(name, v)
        if v & (v - 1):
            raise ValueError(f"{name} must hold powers of two, got {v!r}")
    if len(set(vals)) != len(vals):
        raise ValueError(f"{name} must not repeat values, got {vals!r}")
    return tuple(sorted(vals))


# --------------------------------------------------------------------------- S1 model


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


# --------------------------------------------------------------------------- S2 record


@dataclass(frozen=True)
class PerformanceRecord:
    """Optimal interval per (SLO, batch, seq) cell for one model and one phase.

    ``table[(slo, batch, seq)]`` is an interval in ``1..L+1`` (``L+1`` = no
    offload) or ``None`` (no interval meets that SLO).
    """

    phase: Phase
    num_layers: int
    slo_kind: SloKind
    slos: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    table: Mapping[tuple[float, int, int], int | None] = field(repr=False)

    def cell(self, slo: float, batch: int, seq: int) -> int | None:
        return self.table[(slo, batch, seq)]

    def grid(self, slo: float) -> list[list[int | None]]:
        """Rows = batch sizes, columns = sequence lengths (Table 1 layout)."""
        return [[self.table[(slo, b, s)] for s in self.seq_lens] for b in self.batch_sizes]

    def lookup(self, slo: float, batch: int, seq: int) -> int | None:
        """Interval for an arbitrary request, from the nearest conservative cell.

        Returns ``None`` when no conservative cell exists or the cell is
        infeasible; the caller must then reject (hand back to the upper level).
        """
        slo_f = _pos_num("slo", slo, allow_zero=self.slo_kind is SloKind.SLOWDOWN)
        _pos_int("batch", batch)
        _pos_int("seq", seq)
        key = self.conservative_key(slo_f, batch, seq)
        return None if key is None else self.table[key]

    def conservative_key(self, slo: float, batch: int, seq: int) -> tuple[float, int, int] | None:
        slo_keys = [s for s in self.slos if s <= slo * (1 + _EPS)]
        if not slo_keys:
            return None
        round_up = self.slo_kind is SloKind.ABSOLUTE
        b = _round(self.batch_sizes, batch, round_up)
        s = _round(self.seq_lens, seq, round_up)
        if b is None or s is None:
            return None
        return (max(slo_keys), b, s)


def _round(grid: Sequence[int], v: int, up: bool) -> int | None:
    if up:
        cands = [g for g in grid if g >= v]
        return min(cands) if cands else None
    cands = [g for g in grid if g <= v]
    return max(cands) if cands else None


TimingFn = Callable[[int, int], LayerTiming]


def analyze(
    num_layers: int,
    timing_fn: TimingFn,
    slos: Iterable[float],
    batch_sizes: Iterable[int],
    seq_lens: Iterable[int],
    phase: Phase = Phase.DECODE,
    slo_kind: SloKind = SloKind.ABSOLUTE,
) -> PerformanceRecord:
    """Offline analyzer (§4.4): one measurement per (batch, seq), one cell per SLO.

    ``timing_fn(batch, seq)`` returns the per-layer compute and transfer time
    measured for that phase with no link contention.
    """
    _pos_int("num_layers", num_layers)
    phase = Phase(phase)
    slo_kind = SloKind(slo_kind)
    slo_t = tuple(slos)
    if not slo_t:
        raise ValueError("slos must not be empty")
    for s in slo_t:
        _pos_num("slos", s, allow_zero=slo_kind is SloKind.SLOWDOWN)
    slo_t = tuple(sorted({float(s) for s in slo_t}))
    bs = _pow2_grid("batch_sizes", batch_sizes)
    ss = _pow2_grid("seq_lens", seq_lens)
    if not callable(timing_fn):
        raise ValueError("timing_fn must be callable")
    table: dict[tuple[float, int, int], int | None] = {}
    for b in bs:
        for s in ss:
            t = timing_fn(b, s)
            if not isinstance(t, LayerTiming):
                raise ValueError(f"timing_fn must return LayerTiming, got {type(t).__name__}")
            for slo in slo_t:
                table[(slo, b, s)] = optimal_interval(num_layers, t, slo, slo_kind)
    return PerformanceRecord(phase, num_layers, slo_kind, slo_t, bs, ss, table)


@dataclass(frozen=True)
class PhaseRecords:
    """Separate prefill and decode records (§4.4, disaggregated serving)."""

    prefill: PerformanceRecord
    decode: PerformanceRecord

    def __post_init__(self) -> None:
        if self.prefill.phase is not Phase.PREFILL:
            raise ValueError("prefill must be a PREFILL record")
        if self.decode.phase is not Phase.DECODE:
            raise ValueError("decode must be a DECODE record")

    def lookup(self, phase: Phase, slo: float, batch: int, seq: int) -> int | None:
        rec = self.prefill if Phase(phase) is Phase.PREFILL else self.decode
        return rec.lookup(slo, batch, seq)


def analyze_phases(
    num_layers: int,
    prefill_timing_fn: TimingFn,
    decode_timing_fn: TimingFn,
    slos: Iterable[float],
    batch_sizes: Iterable[int],
    seq_lens: Iterable[int],
    slo_kind: SloKind = SloKind.ABSOLUTE,
) -> PhaseRecords:
    slos = tuple(slos)
    batch_sizes = tuple(batch_sizes)
    seq_lens = tuple(seq_lens)
    return PhaseRecords(
        analyze(num_layers, prefill_timing_fn, slos, batch_sizes, seq_lens, Phase.PREFILL, slo_kind),
        analyze(num_layers, decode_timing_fn, slos, batch_sizes, seq_lens, Phase.DECODE, slo_kind),
    )


# --------------------------------------------------------------------------- S3 coordinator


def max_interval_for_capacity(num_layers: int, layer_bytes: int, gpu_weight_budget_bytes: int) -> int | None:
    """Largest interval whose GPU-resident weights fit the budget (§4.5).

    ``None`` means unbounded (the whole model fits). ``0`` means nothing fits,
    not even interval 1. An offloaded layer needs one staging buffer on the GPU
    while it computes (our reading of Fig. 7), counted when ``L // i > 0``.
    """
    _pos_int("num_layers", num_layers)
    _pos_int("layer_bytes", layer_bytes)
    _pos_num("gpu_weight_budget_bytes", gpu_weight_budget_bytes, allow_zero=True)
    if num_layers * layer_bytes <= gpu_weight_budget_bytes:
        return None
    best = 0
    for i in range(1, num_layers + 1):
        n = num_layers // i
        resident = (num_layers - n + (1 if n else 0)) * layer_bytes
        if resident <= gpu_weight_budget_bytes:
            best = i
    return best


@dataclass(frozen=True)
class GpuDemand:
    """One GPU on the link, with the request it currently serves.

    ``min_interval``: from the performance record (``None`` = record says no
    interval meets the SLO). ``max_interval``: from GPU capacity (``None`` =
    unbounded). ``iter_time_s``: iteration time used to turn bytes per
    iteration into a rate, as in Fig. 8 lines 4-13. ``iter_times``: optional
    iteration time per interval (an interval's rate is then its bytes over its
    own iteration time; intervals not listed use ``iter_time_s``).
    """

    name: str
    num_layers: int
    layer_bytes: int
    iter_time_s: float
    min_interval: int | None
    max_interval: int | None = None
    iter_times: Mapping[int, float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        _pos_int("num_layers", self.num_layers)
        _pos_int("layer_bytes", self.layer_bytes)
        _pos_num("iter_time_s", self.iter_time_s)
        if self.min_interval is not None:
            _pos_int("min_interval", self.min_interval)
        if self.max_interval is not None:
            if isinstance(self.max_interval, bool) or not isinstance(self.max_interval, int) or self.max_interval < 0:
                raise ValueError(f"max_interval must be a non-negative int or None, got {self.max_interval!r}")
        if self.iter_times is not None:
            if not isinstance(self.iter_times, Mapping):
                raise ValueError(f"iter_times must be a mapping interval -> seconds, got {self.iter_times!r}")
            for i, t in self.iter_times.items():
                _pos_int("iter_times", i)
                _pos_num("iter_times", t)

    def offloaded_bytes(self, interval: int) -> int:
        return offloaded_layers(self.num_layers, interval) * self.layer_bytes

    def transfer_rate(self, interval: int) -> float:
        """Bytes/second this GPU pulls over the link at this interval.

        Fig. 8 divides ``layers * mem_per_layer`` by the interval; we use the
        whole number of offloaded layers ``L // i`` (what actually moves).
        """
        t = self.iter_time_s if self.iter_times is None else self.iter_times.get(interval, self.iter_time_s)
        return self.offloaded_bytes(interval) / t

    def candidate_intervals(self) -> list[int]:
        """Valid intervals, one per distinct offloaded-layer count.

        Among intervals with equal ``L // i`` (same bytes, same rate), the
        largest is kept: it has the longest overlap, hence the lowest latency.
        """
        if self.min_interval is None:
            return []
        cap = no_offload_interval(self.num_layers)
        hi = cap if self.max_interval is None else min(self.max_interval, cap)
        by_count: dict[int, int] = {}
        for i in range(self.min_interval, hi + 1):
            by_count[self.num_layers // i] = i
        return sorted(by_count.values())


class Rejection(str, enum.Enum):
    SLO_UNATTAINABLE = "slo_unattainable"  # no interval meets the SLO (record says None)
    EXCEEDS_GPU_CAPACITY = "exceeds_gpu_capacity"  # min interval > max interval (Fig. 8 l.34)
    LINK_BANDWIDTH = "link_bandwidth"  # no joint choice fits under the link bandwidth


@dataclass(frozen=True)
class CoordinatorDecision:
    accepted: bool
    intervals: Mapping[str, int]  # per GPU; empty when rejected (nothing changes)
    host_bytes: int
    total_rate: float
    rejection: Rejection | None = None
    reason: str = ""


class LinkCoordinator:
    """Per-link bandwidth coordinator (§4.5, Fig. 8) for any number of GPUs.

    ``decide(new, others)`` admits ``new`` (the GPU the request is scheduled
    on) together with the busy GPUs ``others`` sharing the link, choosing every
    interval jointly to maximise offloaded (host) bytes subject to
    ``sum(rate) <= bandwidth``. Idle GPUs are simply not passed; alone, the new
    request gets its minimum interval whenever that fits the link (the paper's
    special case). Ties: lower total rate, then smaller intervals in input order.
    Paper uses a strict ``<`` against bandwidth; we allow equality ("never exceeds").
    """

    def __init__(self, bandwidth_bytes_per_s: float) -> None:
        self.bandwidth = _pos_num("bandwidth_bytes_per_s", bandwidth_bytes_per_s)

    def decide(self, new: GpuDemand, others: Sequence[GpuDemand] = ()) -> CoordinatorDecision:
        if not isinstance(new, GpuDemand):
            raise ValueError("new must be a GpuDemand")
        others = tuple(others)
        for o in others:
            if not isinstance(o, GpuDemand):
                raise ValueError("others must hold GpuDemand")
        names = [new.name] + [o.name for o in others]
        if len(set(names)) != len(names):
            raise ValueError(f"name must be unique per link, got {names!r}")

        if new.min_interval is None:
            return _reject(Rejection.SLO_UNATTAINABLE, f"{new.name}: no offloading interval meets the SLO")
        if new.max_interval is not None and new.min_interval > new.max_interval:
            return _reject(
                Rejection.EXCEEDS_GPU_CAPACITY,
                f"{new.name}: SLO needs interval >= {new.min_interval} but GPU "
                f"capacity allows at most {new.max_interval}",
            )
        demands = (new,) + others
        cands = [d.candidate_intervals() for d in demands]
        for d, c in zip(demands, cands):
            if not c:
                return _reject(
                    Rejection.SLO_UNATTAINABLE if d.min_interval is None else Rejection.EXCEEDS_GPU_CAPACITY,
                    f"{d.name}: has no valid interval",
                )

        best = None
        best_key = None
        limit = self.bandwidth * (1 + _EPS)
        for combo in itertools.product(*cands):
            rate = sum(d.transfer_rate(i) for d, i in zip(demands, combo))
            if rate > limit:
                continue
            host = sum(d.offloaded_bytes(i) for d, i in zip(demands, combo))
            key = (-host, rate, combo)
            if best_key is None or key < best_key:
                best, best_key = (combo, host, rate), key
        if best is None:
            return _reject(
                Rejection.LINK_BANDWIDTH,
                f"no combination of valid intervals keeps the link under {self.bandwidth:g} B/s",
            )
        combo, host, rate = best
        return CoordinatorDecision(True, {d.name: i for d, i in zip(demands, combo)}, host, rate)


def _reject(kind: Rejection, reason: str) -> CoordinatorDecision:
    return CoordinatorDecision(False, {}, 0, 0.0, kind, reason)
