"""eLLM's Alg. 2 (E4): SLO-aware logical CPU buffer scaling, as plain policy objects (numbers
in, sizes out; the caller applies them to its buffer). Readings of the paper, each covered by a test:

* R7 Alg. 2 line 4 reads ``min(B_logic * α, B_logic)``, which can never grow;
  read as ``min(B_logic * α, B_max)``. Sizes are integers: shrink floors,
  growth ceils, both then clamped to [min, max].
* R8 A violation is ≥3 misses among the last 5 iterations of that metric. An
  iteration without a sample of a metric counts as a non-miss. Once a
  violation is detected its window is cleared (whether it was acted on or
  suppressed because TPOT takes priority, Alg. 2 ``if/else if``), so the same
  misses never trigger two events.
* R9 Shrinking the logical buffer below what it already holds evicts nothing
  (§4.4.2): the available buffer is ``max(logical - used, 0)``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._checks import check_int as _check_int

__all__ = ["BufferDecision", "HostBufferRule", "LogicalBufferScaler"]


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class BufferDecision:
    """Result of one iteration of Alg. 2. ``event``: ``"tpot"``, ``"ttft"`` or
    ``None`` (the violation acted on); ``changed``: the size moved (an event at
    a bound leaves it unchanged)."""

    logical_chunks: int
    previous_chunks: int
    event: str | None
    tpot_violation: bool
    ttft_violation: bool

    @property
    def changed(self) -> bool:
        return self.logical_chunks != self.previous_chunks


@dataclass
class LogicalBufferScaler:
    """Alg. 2. ``max_chunks``: B_max (CPU physical buffer); ``min_chunks``: the
    floor (paper: 1); ``initial_chunks`` defaults to ``min_chunks`` (paper:
    initialized to 1). Optional ``ttft_slo``/``tpot_slo`` let ``observe``
    take measured latencies instead of miss flags.

    ``per_sample``: the windows hold the last ``window`` *measurements* of each
    metric instead of the last ``window`` iterations (an iteration without a
    sample adds nothing). The paper's scheduler produces a TTFT sample nearly
    every iteration; SGLang's first tokens are sparse (one prefill among many
    decode steps), so per-iteration windows would almost never see 3 misses."""

    max_chunks: int
    min_chunks: int = 1
    alpha: float = 2.0
    window: int = 5
    misses_to_violate: int = 3
    initial_chunks: int | None = None
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    per_sample: bool = False
    logical_chunks: int = field(init=False)
    _ttft: deque[bool] = field(init=False, repr=False)
    _tpot: deque[bool] = field(init=False, repr=False)

    def __post_init__(self):
        _check_int("min_chunks", self.min_chunks, 1)
        _check_int("max_chunks", self.max_chunks, 1)
        if self.max_chunks < self.min_chunks:
            raise ValueError(f"max_chunks ({self.max_chunks}) must be >= min_chunks ({self.min_chunks})")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not self.alpha > 1
            or not math.isfinite(self.alpha)
        ):
            raise ValueError(f"alpha must be a finite number > 1, got {self.alpha!r}")
        _check_int("window", self.window, 1)
        _check_int("misses_to_violate", self.misses_to_violate, 1)
        _check_bool("per_sample", self.per_sample)
        if self.misses_to_violate > self.window:
            raise ValueError(f"misses_to_violate ({self.misses_to_violate}) must be <= window ({self.window})")
        init = self.min_chunks if self.initial_chunks is None else self.initial_chunks
        _check_int("initial_chunks", init, self.min_chunks)
        if init > self.max_chunks:
            raise ValueError(f"initial_chunks ({init}) must be <= max_chunks ({self.max_chunks})")
        for name in ("ttft_slo", "tpot_slo"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {v!r}")
        self.logical_chunks = init
        self._ttft = deque(maxlen=self.window)
        self._tpot = deque(maxlen=self.window)

    def set_tpot_slo(self, tpot_slo: float) -> None:
        """Judge TPOT samples against ``tpot_slo`` from now on; the samples judged against the old
        one are forgotten. Raises ValueError naming ``tpot_slo`` (a number > 0) and changes nothing."""
        if isinstance(tpot_slo, bool) or not isinstance(tpot_slo, (int, float)) or not tpot_slo > 0 \
                or not math.isfinite(tpot_slo):  # fmt: skip
            raise ValueError(f"tpot_slo must be a finite number > 0, got {tpot_slo!r}")
        self.tpot_slo = tpot_slo
        self._tpot.clear()

    def available(self, used_chunks: int) -> int:
        """Alg. 1's P_B: logical room left given what the buffer holds (R9)."""
        _check_int("used_chunks", used_chunks)
        return max(min(self.logical_chunks, self.max_chunks) - used_chunks, 0)

    def window_misses(self) -> tuple[int, int]:
        """(ttft misses, tpot misses) in the current windows."""
        return sum(self._ttft), sum(self._tpot)

    def observe(self, ttft: float | None = None, tpot: float | None = None) -> BufferDecision:
        """One iteration with measured latencies (None: no sample, R8)."""
        flags = []
        for name, value, slo in (("ttft", ttft, self.ttft_slo), ("tpot", tpot, self.tpot_slo)):
            if value is None:
                flags.append(None if self.per_sample else False)
                continue
            if slo is None:
                raise ValueError(f"{name}_slo must be set to observe {name} latencies")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")
            flags.append(value > slo)
        return self._record(flags[0], flags[1])

    def update(self, ttft_missed: bool = False, tpot_missed: bool = False) -> BufferDecision:
        """One scheduling iteration: record this iteration's misses, detect
        violations (R8) and scale the logical buffer."""
        _check_bool("ttft_missed", ttft_missed)
        _check_bool("tpot_missed", tpot_missed)
        return self._record(ttft_missed, tpot_missed)

    def _record(self, ttft_missed: bool | None, tpot_missed: bool | None) -> BufferDecision:
        """Append the flags given (None: no sample, nothing appended) and act on violations."""
        if ttft_missed is not None:
            self._ttft.append(ttft_missed)
        if tpot_missed is not None:
            self._tpot.append(tpot_missed)
        e_ttft = sum(self._ttft) >= self.misses_to_violate
        e_tpot = sum(self._tpot) >= self.misses_to_violate
        prev = self.logical_chunks
        event = None
        if e_tpot:
            self.logical_chunks = max(math.floor(prev / self.alpha), self.min_chunks)
            event = "tpot"
        elif e_ttft:
            self.logical_chunks = min(math.ceil(prev * self.alpha), self.max_chunks)
            event = "ttft"
        if e_tpot:
            self._tpot.clear()
        if e_ttft:
            self._ttft.clear()
        return BufferDecision(self.logical_chunks, prev, event, e_tpot, e_ttft)


class HostBufferRule:
    """Alg. 2 as the server and the simulator both apply it to their CPU buffer.

    One ``LogicalBufferScaler`` with per-sample windows over ``unit`` chunks: each iteration
    feeds one TTFT sample per request that got its first token in it (its TTFT) and at most one
    TPOT sample; an iteration without a sample leaves the windows as they are (SGLang's first
    tokens are sparse, see ``LogicalBufferScaler.per_sample``). The server measures the samples,
    the simulator models them; the rule and its state are the same."""

    def __init__(
        self,
        max_units: int,
        ttft_slo: float,
        tpot_slo: float,
        *,
        initial_units: int = 1,
        alpha: float = 2.0,
        window: int = 5,
        misses_to_violate: int = 3,
    ):
        self.scaler = LogicalBufferScaler(
            max_chunks=max_units,
            initial_chunks=min(max(initial_units, 1), max_units),
            alpha=alpha,
            window=window,
            misses_to_violate=misses_to_violate,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
            per_sample=True,
        )
        self.events = {"ttft": 0, "tpot": 0}

    @property
    def logical_units(self) -> int:
        return self.scaler.logical_chunks

    def available(self, used_units: int) -> int:
        """Alg. 1's ``P_B``: room the logical size leaves beside ``used_units`` (R9)."""
        return self.scaler.available(used_units)

    def observe_iteration(self, ttfts: Sequence[float] = (), tpot: float | None = None) -> int:
        """Feed one iteration's samples (TTFTs first, then TPOT); return the logical size after."""
        decisions = [self.scaler.observe(ttft=t) for t in ttfts]
        if tpot is not None:
            decisions.append(self.scaler.observe(tpot=tpot))
        for d in decisions:
            if d.event:
                self.events[d.event] += 1
        return self.scaler.logical_chunks
