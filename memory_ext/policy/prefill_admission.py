"""One prefill's admission question (eLLM Alg. 1 lines 5-11), asked once per request.

Numbers in, one verdict out: ``judge_prefill(PrefillAsk) -> PrefillVerdict``. The verdict holds
every branch its caller may take, so the caller asks once and then acts:

* ``action``: ``ON_GPU`` (its KV and the batch's activation fit beside what is reserved),
  ``OFFLOAD`` (the prefill fits physically now and its KV fits the host buffer) or ``DEFER``
  (neither; an FCFS caller stops its scan, ``ellm`` R3).
* ``if_refused``: what to do when the device admission ``ON_GPU`` chose is refused further on
  (the server's engine has its own request and token caps): ``OFFLOAD`` if the host buffer
  alone could take the request, else ``DEFER``. Always ``DEFER`` unless ``action`` is ``ON_GPU``.
* ``buffer_full``: the request is deferred only because the host buffer lacks room (it would be
  offloaded with room); the caller counts it. Never true unless ``action`` is ``DEFER``.

A parked request ahead (``PrefillAsk.parked_ahead``: a request whose KV waits on the host for
room to decode) keeps later requests off the device (first come, first served); they may still
prefill into the buffer.

The one admission rule: ``ellm.ElasticAdmissionPolicy`` (the simulator's eLLM scheduler) scans
its queue with it, and the server's admission hook (``sglang_memx.elastic.admission``) asks it
once per request its engine's scheduler offers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ON_GPU", "OFFLOAD", "DEFER", "PrefillAsk", "PrefillVerdict", "judge_prefill"]

ON_GPU = "gpu"
OFFLOAD = "offload"
DEFER = "defer"


@dataclass(frozen=True)
class PrefillAsk:
    """What admitting one more prefill would cost, in one unit (chunks, blocks or tokens).

    ``budget``: Alg. 1's ``P_kv + P_act - θ`` (free + evictable KV plus idle activation,
    minus the threshold). ``reserved``: what admitted work already holds against that budget,
    now *and* for its future decode growth (the running requests' decode reservation and the
    batch formed so far); ``reserved_now``: the part of ``reserved`` that occupies memory
    during this iteration. ``kv``: the request's KV on the device if it stays (prompt + its
    own decode reservation); ``kv_now``: device KV its prefill needs if its KV is offloaded
    (0 when the offload is layer-wise, the paper's pipelining; the prompt's KV plus headroom
    when it lands on the device before the copy); ``act``: the batch's activation with this
    request in it; ``offload_kv``: what parking its KV costs the buffer (0: it cannot be
    parked); ``buffer_room``: Alg. 1's ``P_B`` left. ``parked_ahead``: a parked request is
    ahead of this one in the queue, so this one may not go on the device."""

    budget: int
    reserved: int
    reserved_now: int
    kv: int
    kv_now: int
    act: int
    offload_kv: int = 0
    buffer_room: int = 0
    parked_ahead: bool = False

    def __post_init__(self):
        if not isinstance(self.parked_ahead, bool):
            raise ValueError(f"parked_ahead must be a bool, got {self.parked_ahead!r}")


@dataclass(frozen=True)
class PrefillVerdict:
    """One request's answer (module docstring). Invariants: ``if_refused`` is ``OFFLOAD`` only
    when ``action`` is ``ON_GPU``; ``buffer_full`` only when ``action`` is ``DEFER``."""

    action: str
    if_refused: str = DEFER
    buffer_full: bool = False

    def __post_init__(self):
        if self.action not in (ON_GPU, OFFLOAD, DEFER):
            raise ValueError(f"action must be {ON_GPU!r}, {OFFLOAD!r} or {DEFER!r}, got {self.action!r}")
        if self.if_refused not in (OFFLOAD, DEFER) or (self.if_refused == OFFLOAD and self.action != ON_GPU):
            raise ValueError(f"if_refused must be {DEFER!r} or, after {ON_GPU!r}, {OFFLOAD!r}; got {self.if_refused!r}")
        if self.buffer_full and self.action != DEFER:
            raise ValueError(f"buffer_full is only for {DEFER!r}, got action {self.action!r}")


def judge_prefill(ask: PrefillAsk) -> PrefillVerdict:
    """Alg. 1 lines 5-11 for one request, with the host-buffer-only answer and the buffer-full
    reason in the verdict (module docstring)."""
    fits_device = ask.reserved + ask.kv + ask.act <= ask.budget
    parkable = ask.offload_kv > 0 and ask.reserved_now + ask.kv_now + ask.act <= ask.budget
    buffered = parkable and ask.offload_kv <= ask.buffer_room
    if fits_device and not ask.parked_ahead:
        return PrefillVerdict(ON_GPU, if_refused=OFFLOAD if buffered else DEFER)
    if buffered:
        return PrefillVerdict(OFFLOAD)
    return PrefillVerdict(DEFER, buffer_full=parkable)
