"""eLLM scheduling decisions (E4): ballooning admission (Alg. 1) and SLO-aware
logical CPU buffer scaling (Alg. 2), as plain policy objects.

Numbers in, decisions out: nothing here allocates, maps or moves memory; the
caller applies the returned amounts (inflate/deflate chunk counts, offload and
fetch lists) with whatever pool it drives. All amounts are in physical chunks.

Readings of the paper (where it is ambiguous) -- each is covered by a test:

* R1 ``P_T`` ("total physical chunks") is read as the chunks this iteration may
  use at all: ``free_kv_chunks + idle_act_chunks``. Chunks held by resident
  KV caches or live activations are not counterable, so the literal device
  total would over-admit.
* R2 Activation need is per batch, not a per-request sum: the caller supplies
  ``act_chunks_for_tokens(total_batch_tokens)`` and ``M_act`` is that function
  of the admitted tokens; the marginal ``ACT_r`` of a candidate is
  ``f(T + t_r) - f(T)``. A batch with no admitted request needs no activation.
* R3 Admission is FCFS with the paper's ``break``: the first request that fits
  neither on the GPU nor (prefill) in the CPU buffer stops the scan; later
  requests are deferred, not skipped over.
* R4 Phase: one iteration is either prefill or decode. With ``phase=None``
  prefill runs when prefills wait, and if none of them can be admitted the
  iteration falls back to decode so that running decodes never starve behind
  a prefill that cannot fit.
* R5 Decode ``KV_r`` is the new KV for this step plus the request's KV that
  sits in the CPU buffer (fetched back, line 17). Fetching only adds GPU
  demand; the CPU-buffer space it vacates is reported (``fetch_chunks``) for
  the caller to return to its buffer accounting.
* R6 Deflation is lazy (§4.3.1): KV chunks go back to activation only when the
  activation need exceeds idle activation chunks, and only by that shortfall
  (line 26-27); otherwise borrowed chunks stay with KV.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._checks import check_int as _check_int
from .prefill_admission import DEFER, OFFLOAD, ON_GPU, PrefillAsk, PrefillVerdict, judge_prefill

__all__ = [
    "PREFILL",
    "DECODE",
    "PrefillRequest",
    "DecodeRequest",
    "AdmissionDecision",
    "ElasticAdmissionPolicy",
    "ON_GPU",
    "OFFLOAD",
    "DEFER",
    "PrefillAsk",
    "PrefillVerdict",
    "judge_prefill",
    "HostBufferRule",
    "BufferDecision",
    "LogicalBufferScaler",
]

PREFILL = "prefill"
DECODE = "decode"


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


# --------------------------------------------------------------------------
# Alg. 1: scheduling with elastic memory
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillRequest:
    """A waiting prefill: ``tokens`` prompt tokens whose KV needs ``kv_chunks`` on the device if it
    stays there, ``decode_chunks`` of them reserved for its future decode (not occupied during the
    prefill). ``kv_now_chunks``: device KV its prefill needs if its KV is offloaded instead (0:
    layer-wise offload, the paper's pipelining); ``offload_chunks``: what parking its KV costs the
    CPU buffer (default ``kv_chunks - decode_chunks``)."""

    rid: str
    tokens: int
    kv_chunks: int
    kv_now_chunks: int = 0
    offload_chunks: int | None = None
    decode_chunks: int = 0

    def __post_init__(self):
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty str, got {self.rid!r}")
        _check_int("tokens", self.tokens, 1)
        _check_int("kv_chunks", self.kv_chunks, 0)
        _check_int("kv_now_chunks", self.kv_now_chunks, 0)
        _check_int("decode_chunks", self.decode_chunks, 0)
        if self.decode_chunks > self.kv_chunks:
            raise ValueError(f"decode_chunks ({self.decode_chunks}) must be <= kv_chunks ({self.kv_chunks})")
        if self.offload_chunks is not None:
            _check_int("offload_chunks", self.offload_chunks, 0)

    @property
    def parked_chunks(self) -> int:
        return self.kv_chunks - self.decode_chunks if self.offload_chunks is None else self.offload_chunks


@dataclass(frozen=True)
class DecodeRequest:
    """A running decode. ``kv_chunks``: new KV chunks this step needs on GPU;
    ``offloaded_chunks``: its KV in the CPU buffer, fetched back if scheduled."""

    rid: str
    kv_chunks: int = 0
    offloaded_chunks: int = 0
    tokens: int = 1

    def __post_init__(self):
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty str, got {self.rid!r}")
        _check_int("kv_chunks", self.kv_chunks, 0)
        _check_int("offloaded_chunks", self.offloaded_chunks, 0)
        _check_int("tokens", self.tokens, 1)

    @property
    def gpu_kv_chunks(self) -> int:
        return self.kv_chunks + self.offloaded_chunks


@dataclass(frozen=True)
class AdmissionDecision:
    """What one iteration does. ``inflation`` is Alg. 1's ``I``: > 0 moves that
    many idle activation chunks to KV, < 0 returns that many KV chunks to
    activation. ``kv_chunks``/``act_chunks`` are ``M_kv``/``M_act``: GPU chunks
    the batch takes, all allocated together (no hold-and-wait)."""

    phase: str
    admitted: tuple[str, ...]
    deferred: tuple[str, ...]
    offloaded: tuple[str, ...]
    fetched: tuple[str, ...]
    kv_chunks: int
    act_chunks: int
    tokens: int
    offload_chunks: int
    fetch_chunks: int
    inflation: int
    kv_free_after: int
    act_idle_after: int
    cpu_buffer_free_after: int

    @property
    def inflate_chunks(self) -> int:
        return max(self.inflation, 0)

    @property
    def deflate_chunks(self) -> int:
        return max(-self.inflation, 0)


@dataclass(frozen=True)
class ElasticAdmissionPolicy:
    """Alg. 1. ``act_chunks_for_tokens(n)``: activation chunks a batch of ``n``
    tokens needs (R2). ``threshold_chunks``: θ, chunks kept free."""

    act_chunks_for_tokens: Callable[[int], int]
    threshold_chunks: int = 0

    def __post_init__(self):
        if not callable(self.act_chunks_for_tokens):
            raise ValueError("act_chunks_for_tokens must be callable")
        _check_int("threshold_chunks", self.threshold_chunks, 0)

    def _act(self, tokens: int) -> int:
        if tokens == 0:
            return 0
        need = self.act_chunks_for_tokens(tokens)
        if isinstance(need, bool) or not isinstance(need, int) or need < 0:
            raise ValueError(f"act_chunks_for_tokens({tokens}) must return an int >= 0, got {need!r}")
        return need

    def decide(
        self,
        free_kv_chunks: int,
        idle_act_chunks: int,
        prefills: Sequence[PrefillRequest] = (),
        decodes: Sequence[DecodeRequest] = (),
        cpu_buffer_free_chunks: int = 0,
        phase: str | None = None,
        reserved_chunks: int = 0,
        reserved_now_chunks: int = 0,
    ) -> AdmissionDecision:
        """``reserved_chunks``: chunks the running requests' future decode growth keeps out of a
        prefill's reach (the decode reservation SGLang's admission makes; 0 is the paper's
        Alg. 1, which admits whole prompts with no reserve and preempts when decodes outgrow
        memory). Decode iterations are not limited by it: they are what it was kept for.
        ``reserved_now_chunks``: what the running requests' next decode step takes, which an
        offloaded prefill's device KV must leave free (``PrefillAsk.reserved_now``)."""
        _check_int("free_kv_chunks", free_kv_chunks)
        _check_int("idle_act_chunks", idle_act_chunks)
        _check_int("cpu_buffer_free_chunks", cpu_buffer_free_chunks)
        _check_int("reserved_chunks", reserved_chunks)
        _check_int("reserved_now_chunks", reserved_now_chunks)
        if phase not in (None, PREFILL, DECODE):
            raise ValueError(f"phase must be None, {PREFILL!r} or {DECODE!r}, got {phase!r}")
        prefills = tuple(prefills)
        decodes = tuple(decodes)
        seen = set()
        for name, reqs, kind in (("prefills", prefills, PrefillRequest), ("decodes", decodes, DecodeRequest)):
            for r in reqs:
                if not isinstance(r, kind):
                    raise ValueError(f"{name} must hold {kind.__name__}, got {r!r}")
                if r.rid in seen:
                    raise ValueError(f"rid {r.rid!r} appears twice")
                seen.add(r.rid)

        args = (free_kv_chunks, idle_act_chunks, cpu_buffer_free_chunks)
        if phase == PREFILL or (phase is None and prefills):
            decision = self._prefill(prefills, *args, reserved_chunks, reserved_now_chunks)
            if phase is None and not decision.admitted and decodes:  # R4
                return self._decode(decodes, *args)
            return decision
        return self._decode(decodes, *args)

    # Alg. 1 lines 2-13, one ``judge_prefill`` per request
    def _prefill(self, queue, p_kv, p_act, p_b, reserved=0, reserved_now=0) -> AdmissionDecision:
        budget = p_kv + p_act - self.threshold_chunks  # R1
        m_kv = m_now = tokens = offload = 0
        admitted, offloaded = [], []
        n = 0
        for r in queue:
            act = self._act(tokens + r.tokens)
            action = judge_prefill(
                PrefillAsk(
                    budget=budget,
                    reserved=reserved + m_kv,
                    reserved_now=reserved_now + m_now,
                    kv=r.kv_chunks,
                    kv_now=r.kv_now_chunks,
                    act=act,
                    offload_kv=r.parked_chunks,
                    buffer_room=p_b - offload,
                )
            ).action
            if action == ON_GPU:
                m_kv += r.kv_chunks
                m_now += r.kv_chunks - r.decode_chunks
            elif action == OFFLOAD:  # its prompt's KV passes through the device (none if layer-wise)
                m_kv += r.kv_now_chunks
                m_now += r.kv_now_chunks
                offload += r.parked_chunks
                offloaded.append(r.rid)
            else:
                break  # R3
            tokens += r.tokens
            admitted.append(r.rid)
            n += 1
        return self._finish(PREFILL, queue, n, admitted, offloaded, [], m_kv, tokens, offload, 0, p_kv, p_act, p_b)

    # Alg. 1 lines 14-22
    def _decode(self, queue, p_kv, p_act, p_b) -> AdmissionDecision:
        budget = p_kv + p_act - self.threshold_chunks
        m_kv = tokens = fetch = 0
        admitted, fetched = [], []
        n = 0
        for r in queue:
            act = self._act(tokens + r.tokens)
            if m_kv + r.gpu_kv_chunks + act > budget:
                break
            m_kv += r.gpu_kv_chunks
            tokens += r.tokens
            admitted.append(r.rid)
            if r.offloaded_chunks:
                fetched.append(r.rid)
                fetch += r.offloaded_chunks
            n += 1
        return self._finish(DECODE, queue, n, admitted, [], fetched, m_kv, tokens, 0, fetch, p_kv, p_act, p_b)

    def _finish(
        self, phase, queue, n, admitted, offloaded, fetched, m_kv, tokens, offload, fetch, p_kv, p_act, p_b
    ) -> AdmissionDecision:
        m_act = self._act(tokens)
        # Alg. 1 lines 23-27 (memory ballooning)
        if p_kv < m_kv and p_act > m_act:
            inflation = m_kv - p_kv
        elif p_act < m_act and p_kv > m_kv:
            inflation = p_act - m_act  # R6: lazy, only the shortfall
        else:
            inflation = 0
        kv_after = p_kv + inflation - m_kv
        act_after = p_act - inflation - m_act
        assert kv_after >= 0 and act_after >= 0, "Alg. 1 admitted beyond the budget"
        return AdmissionDecision(
            phase=phase,
            admitted=tuple(admitted),
            deferred=tuple(r.rid for r in queue[n:]),
            offloaded=tuple(offloaded),
            fetched=tuple(fetched),
            kv_chunks=m_kv,
            act_chunks=m_act,
            tokens=tokens,
            offload_chunks=offload,
            fetch_chunks=fetch,
            inflation=inflation,
            kv_free_after=kv_after,
            act_idle_after=act_after,
            cpu_buffer_free_after=p_b - offload,
        )


# --------------------------------------------------------------------------
# Alg. 2: SLO-aware logical buffer scaling
# --------------------------------------------------------------------------


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
