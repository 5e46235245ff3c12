"""The governor as a coordinator component: the batch decision under the TPOT SLO
(``memory_ext.policy.governor.BatchGovernor``) on this server's own measurements.

* its step (``"measure the decode step"``, first in the iteration order): the wall time from the
  previous iteration's tick to this one is the step the previous batch took, which is the
  interval between two tokens of its requests; when that batch was a pure decode batch it is one
  sample of the step-time model (batch size, KV tokens in flight, seconds). A prefill batch is
  time the requests running at the tick before it waited through, and a mixed batch's time beyond
  its predicted decode step too (``memory_ext.policy.prefill_stalls``: the predicted TPOT counts
  them); iterations with no batch (idle) count nothing;
* its tick also notes, per request, the first tick that saw a token of it
  (``memx_state.decoding_since``): the per-request rule's paces count from there;
* admission asks it before a new request joins the running batch
  (``elastic.admission.governor_refusal``, from ``hooks.scheduler.around_add_one_req``) with the
  running requests' paces and the prompt tokens of this pass's prefills
  (``memory_ext.policy.request_pace``), and for
  the numbers of the parking question (``park_tpot``: with a TPOT SLO, a prefill is parked on the
  host only if its own TPOT, its wait for device room included, stays within it);
* at tensor parallel size > 1 every rank reads rank 0's clock once a tick (``tick_time``) and the
  running requests' paces count to that tick, so the measured steps and the decisions are the same
  on every rank;
* its status (``/memx/status`` → ``elastic_kv.governor``): the SLOs in force and where each came
  from (``slos``: the TPOT SLO's flag, or the ``models.yaml`` field ``sglang-memx serve`` passed it
  from; the TTFT SLO when the host buffer has one), the batch cap and why, predicted vs measured
  TPOT, decisions counted by reason (``over_slo``: refusals to grow).

Registered with ``--memx-tpot-slo-ms``, or ``--memx-governor`` without one (then admission's
no-harm rules, and the batch cap at the measured default SLO once the solo decode step is measured,
``memory_ext.policy.default_slo``; ``pool_build.finish``); with neither it is absent and nothing
changes. Invariant: it never drops or aborts a request; a refusal leaves it waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memory_ext.policy.governor import SLO_DEFAULT, BatchGovernor
from memory_ext.policy.no_harm import REASONS as NO_HARM_REASONS
from memory_ext.policy.no_harm import GovernedVerdict
from memory_ext.policy.park_tpot import ParkTpot
from memory_ext.policy.request_pace import RunningPace
from sglang_memx.config import TPOT_SLO_FLAG, TPOT_SLO_SCALE_FLAG
from sglang_memx.coordinator.parts import Iteration, Source, Step, step
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched

MEASURED_WEIGHT = 0.2  # exponential mean of the measured decode steps (the status' measured TPOT)


@dataclass(frozen=True)
class SloInForce:
    """One SLO this server holds (milliseconds) and where it came from (a flag or a config field)."""

    ms: float
    source: str

    def status(self) -> dict[str, Any]:
        return {"ms": self.ms, "source": self.source}


def default_source(governor: BatchGovernor) -> str:
    """The status' source of a measured default SLO: its scale, the solo step it came from and its
    flag (no comma: it is a Prometheus label value that readers split on commas)."""
    d = governor.default
    solo_ms = d.solo_step_s * 1e3
    return f"default: {d.scale:g} x the solo decode step measured at start ({solo_ms:.4g} ms; {TPOT_SLO_SCALE_FLAG})"


def kv_tokens(reqs) -> int:
    """KV tokens the requests hold or will hold at their next step (prompt + generated so far)."""
    return sum(up_req.prompt_len(r) + up_req.output_len(r) for r in reqs)


@dataclass(eq=False)
class GovernorPart:
    """This model's batch governor, fed with the decode steps this server measures."""

    governor: BatchGovernor
    clock: Callable[[], float] = time.perf_counter
    name: str = "governor"
    tpot_source: str = TPOT_SLO_FLAG  # where the governor's TPOT SLO came from (status)
    ttft: SloInForce | None = None  # the server's TTFT SLO (the host buffer's; the governor does not use it)
    measured_s: float | None = None  # exponential mean of the measured decode steps
    last_step_s: float | None = None
    running: int = 0  # the running batch at the last tick (status)
    running_kv_tokens: int = 0
    max_running_seen: int = 0  # the largest running batch any tick saw (status)
    verdicts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NO_HARM_REASONS, 0))  # by reason
    # --tp > 1 (``RankAgreement.tick_time``): every rank reads rank 0's clock, once a tick, and its paces
    # count to that tick: the governor's every input is then the same on every rank
    tick_time: Callable[[], float] | None = None
    _last_tick: float | None = field(default=None, repr=False)

    def steps(self) -> tuple[Step, ...]:
        return (step("measure the decode step", self._measure),)

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        doc = self.governor.status(self.running, self.running_kv_tokens, self.measured_s)
        doc["last_measured_tpot_ms"] = None if self.last_step_s is None else round(self.last_step_s * 1e3, 4)
        doc["max_running_seen"] = self.max_running_seen
        doc["admission_verdicts"] = dict(self.verdicts)  # mechanisms' admissions passed through it, by reason
        tpot_ms = doc["tpot_slo_ms"]
        source = self.tpot_source if self.governor.slo_origin != SLO_DEFAULT else default_source(self.governor)
        doc["slos"] = {"tpot": None if tpot_ms is None else SloInForce(tpot_ms, source).status(),
                       "ttft": None if self.ttft is None else self.ttft.status()}  # fmt: skip
        return {"governor": doc}

    def observe(self, batch: int, kv: int, step_s: float) -> None:
        """One decode step of ``batch`` requests holding ``kv`` tokens took ``step_s`` seconds."""
        self.governor.observe(batch, kv, step_s)
        self.last_step_s = step_s
        m = self.measured_s
        self.measured_s = step_s if m is None else m + MEASURED_WEIGHT * (step_s - m)

    def note_verdict(self, verdict: GovernedVerdict) -> None:
        """Count one admission verdict the governor passed (``memory_ext.policy.no_harm``), by reason."""
        self.verdicts[verdict.reason] += 1

    def may_grow(self, running_reqs, admitted_reqs, req):
        """The decision for ``req`` joining the decoding ``running_reqs`` and the ``admitted_reqs``
        this pass let in before it (counted by reason)."""
        joining = [*running_reqs, *admitted_reqs]
        pace = {}
        if self.governor.judges_paces:
            pace = {"paces": self.paces(running_reqs), "pass_tokens": sum(map(prefill_tokens, admitted_reqs)),
                    "add_tokens": prefill_tokens(req)}  # fmt: skip
        return self.governor.may_grow(len(joining), kv_tokens(joining), kv_tokens((req,)), **pace)

    def paces(self, running_reqs) -> list[RunningPace]:
        """The running requests' paces (``memory_ext.policy.request_pace``): time and tokens since
        the first tick that saw their first token (none yet: just now), ``max_new_tokens`` left."""
        now, out = (self.clock() if self.tick_time is None or self._last_tick is None else self._last_tick), []
        for r in running_reqs:
            seen = up_req.memx_state(r).decoding_since
            elapsed, decoded = (0.0, 0) if seen is None else (max(0.0, now - seen[0]), up_req.output_len(r) - seen[1])
            out.append(RunningPace(elapsed, max(0, decoded), up_req.remaining_new_tokens(r)))
        return out

    def park_tpot(self, running_reqs, req) -> ParkTpot | None:
        """The numbers for the parking question (``memory_ext.policy.park_tpot``): the predicted
        TPOT of ``running_reqs`` with ``req`` and the TPOT SLO; None without an SLO or a prediction
        yet (parking is then judged without it)."""
        slo = self.governor.tpot_slo_s
        if slo is None:
            return None
        step_s = self.governor.predict_tpot(len(running_reqs) + 1, kv_tokens(running_reqs) + kv_tokens((req,)))
        return None if step_s is None else ParkTpot(step_s, slo)

    def would_admit(self, running_reqs, req) -> bool:
        """Whether ``req`` may join ``running_reqs`` now, asked ahead of admission (not counted):
        the host buffer fetches a parked request's KV back only if it will be let in."""
        # a parked request's KV comes back: one token to compute
        pace = {"paces": self.paces(running_reqs), "add_tokens": 1} if self.governor.judges_paces else {}
        return self.governor.decide(len(running_reqs), kv_tokens(running_reqs), kv_tokens((req,)), **pace).admit

    def _measure(self, it: Iteration) -> None:
        now = self.clock() if self.tick_time is None else self.tick_time()  # every tick, on every rank
        if self._last_tick is not None:
            self._count_iteration(it.scheduler, now - self._last_tick)
        self._last_tick = now
        running = up_sched.running_reqs(it.scheduler)
        self.running, self.running_kv_tokens = len(running), kv_tokens(running)
        if self.governor.judges_paces:  # only the per-request rule reads them
            _note_first_tokens(running, now)
            _note_first_tokens(up_sched.batch_reqs(up_sched.unmerged_prefill_batch(it.scheduler)), now)
        self.max_running_seen = max(self.max_running_seen, self.running)

    def _count_iteration(self, scheduler, seconds: float) -> None:
        """The iteration since the last tick: a pure decode batch is a step sample; a prefill batch
        stalled the requests running at the last tick; a mixed one decoded them, slower."""
        mode = up_sched.last_batch_mode(scheduler)
        if mode == "decode":
            reqs = up_sched.batch_reqs(up_sched.last_decode_batch(scheduler))
            if reqs:
                self.observe(len(reqs), kv_tokens(reqs), seconds)
        elif mode is not None:
            mixed = mode == "mixed"
            tokens = up_sched.last_batch_prefill_tokens(scheduler, self.running if mixed else 0)
            self.governor.observe_iteration(seconds, self.running if mixed else 0,
                                            self.running_kv_tokens if mixed else 0,
                                            0 if mixed else self.running, prefilled=True,
                                            prefill_tokens=tokens)  # fmt: skip


def prefill_tokens(req) -> int:
    """Prompt tokens ``req``'s prefill computes: those its prefix match did not find cached (at
    least one: a fully cached prompt still computes its last token)."""
    return max(1, up_req.fill_len(req) - up_req.cached_prefix_len(req))


def _note_first_tokens(reqs, now: float) -> None:
    """Mark the first tick that sees each request with a token (its pace counts from there)."""
    for r in reqs:
        state = up_req.memx_state(r)
        if state.decoding_since is None and up_req.output_len(r) >= 1:
            state.decoding_since = (now, up_req.output_len(r))
