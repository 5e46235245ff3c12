"""eLLM scheduling decisions (E4): ballooning admission (Alg. 1) and SLO-aware
logical CPU buffer scaling (Alg. 2, ``buffer_scaling``, re-exported here), as plain policy objects.

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._checks import check_int as _check_int
from .buffer_scaling import BufferDecision, HostBufferRule, LogicalBufferScaler
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
