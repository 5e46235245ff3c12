"""Select-N S2: the performance record, one optimal interval per (SLO, batch, sequence) cell
measured offline (§4.4), per phase.

Conservative lookup (ambiguity): the paper says "conservatively choosing from
the nearest combination". The SLO is always rounded down (tighter). For
batch/sequence, the safe direction is the one with more compute per layer
under ABSOLUTE (round up: latency grows with ``t_c``, so an interval that meets
the SLO at the bigger cell meets it at the request) and the one with less
compute under SLOWDOWN (round down: there more compute only helps hide
transfers, which is why Table 1 omits the large cells). Requests off the grid in
the safe direction have no entry and get ``None`` (caller rejects). This assumes
the measured ``t_c`` is non-decreasing in batch and in sequence length.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ._inputs import EPS as _EPS
from ._inputs import positive_int as _pos_int
from ._inputs import positive_number as _pos_num
from .interval_model import LayerTiming, SloKind, optimal_interval


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


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
