"""The governor's batch decision: may the running batch grow by one request and keep the TPOT SLO?

Numbers in, decisions out; no clock, no I/O (the server and the simulator time the steps and
feed them here, ``observe``).

* ``StepTimeModel`` (``step_time``): decode step time learned online,
  ``t = a + b * batch + c * kv_tokens``. Before ``min_samples`` samples it predicts nothing (the
  prior is "unknown", and the governor then admits as stock would).
* ``BatchGovernor.may_grow(running, kv_tokens, add_kv_tokens, paces=..., pass_tokens=...,
  add_tokens=...)``: FineServe's batch-aware idea (Alg. 2) and the TPOT side of eLLM's Alg. 2:
  admit while no running request is predicted past the TPOT SLO with the newcomer (``<=``:
  exactly at the SLO admits). Two rules, the decision says which (``rule``):

  - ``per_request`` (``request_pace``), when the caller gives the running requests' paces and
    the prefill-time model has learned: each running request on time without the newcomer keeps
    its predicted TPOT (so far, plus this pass's prefill with the newcomer's prompt, plus its
    remaining tokens at the step of the larger batch) within the SLO, and the newcomer's own
    step is within it. Prefills admitted in one pass share one iteration: the second costs its
    tokens, not another intercept.
  - ``batch``, otherwise: the predicted step of the running batch with the request plus the
    prefills a running request waits through in steady state (``prefill_stalls``: a batch of
    ``b`` predicts ``step(b) + b * q``, ``q`` the stalled seconds per decoded token measured).

  No SLO: always admit (stock behaviour). The SLO in force is the one given (a flag, a config
  field, ``set_tpot_slo``), else the measured default when the governor has one
  (``default_slo.SoloStepDefault``: 20 solo decode steps, once measured); ``slo_origin`` says which.
  An empty batch always admits (nothing starves).
  An SLO no batch can meet (one request decoding alone, the lighter of the newcomer and an
  average running one, is predicted over it) admits as stock would: a cap would only queue
  the burst (every TTFT later) for a TPOT no batch size attains, harm with no predicted gain.
  A refusal only leaves the request waiting: nothing is
  ever dropped, a request past its TTFT included; the running batch shrinks as its requests
  finish and admission reopens.

Every decision carries a reason code (``REASONS``) and the predicted vs SLO numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memory_ext.policy._checks import check_int, check_num
from memory_ext.policy.default_slo import SoloStepDefault
from memory_ext.policy.prefill_stalls import PrefillStalls
from memory_ext.policy.request_pace import PrefillTimeModel, RunningPace, worst_tpot
from memory_ext.policy.step_time import StepTimeModel

__all__ = [
    "ADMIT_REASONS",
    "BatchDecision",
    "CAP_REASONS",
    "BatchGovernor",
    "BATCH",
    "PER_REQUEST",
    "REASONS",
    "SLO_INFEASIBLE",
    "SLO_DEFAULT",
    "SLO_GIVEN",
    "StepTimeModel",
    "check_tpot_slo",
]

NO_SLO = "no_slo"  # no TPOT SLO set (nor a default measured yet): never caps
EMPTY_BATCH = "empty_batch"  # nothing runs: one request always joins
LEARNING = "learning"  # too few step samples to predict: admit as stock would
WITHIN_SLO = "within_slo"  # predicted step time with the request <= the SLO
SLO_INFEASIBLE = "slo_infeasible"  # even the request alone is predicted over the SLO: no cap helps, admit
OVER_SLO = "over_slo"  # predicted step time with the request > the SLO: the request waits
ADMIT_REASONS = (NO_SLO, EMPTY_BATCH, LEARNING, WITHIN_SLO, SLO_INFEASIBLE)
REASONS = (*ADMIT_REASONS, OVER_SLO)
# why the status' batch cap is what it is: none without an SLO, while learning or when no batch
# meets the SLO, else the largest batch predicted within the SLO
CAP_WITHIN_SLO = "predicted_tpot_within_slo"
CAP_REASONS = (NO_SLO, LEARNING, SLO_INFEASIBLE, CAP_WITHIN_SLO)
PER_REQUEST = "per_request"  # the decision judged each running request's TPOT (``request_pace``)
BATCH = "batch"  # ... the batch's steady-state TPOT (no paces given, or the prefill time still learning)
SLO_GIVEN = "given"  # the SLO in force was given (a flag, a config field, set at run time)
SLO_DEFAULT = "default"  # ... is the measured default (``default_slo``)


def check_tpot_slo(name: str, value) -> float | None:
    """A TPOT SLO in seconds: None (no SLO) or a positive finite number; else ValueError naming ``name``."""
    if value is None:
        return None
    return check_num(name, value, 0.0, strict=True)


@dataclass(frozen=True)
class BatchDecision:
    admit: bool
    reason: str  # one of REASONS
    running: int  # requests running before this one
    predicted_s: float | None  # the highest predicted TPOT with the request (None: no prediction)
    slo_s: float | None
    rule: str = BATCH  # PER_REQUEST or BATCH: how ``predicted_s`` was predicted


class BatchGovernor:
    """One model's batch decision under its TPOT SLO (module docstring). ``counts``: decisions by reason."""

    def __init__(self, tpot_slo_s: float | None, model: StepTimeModel | None = None,
                 default: SoloStepDefault | None = None):  # fmt: skip
        self.given_slo_s = check_tpot_slo("tpot_slo_s", tpot_slo_s)
        self.default = default  # the SLO held while none is given (None: no default)
        self.model = model if model is not None else StepTimeModel()
        self.prefill = PrefillStalls(self.model.decay)  # the prefills running requests wait through
        self.prefill_time = PrefillTimeModel(self.model.decay)  # seconds of a prefill by its tokens
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.last: BatchDecision | None = None
        # the KV a decoding request held, exponential mean over the decode steps (weight 1 - decay):
        # the status' cap and curve use it when nothing runs
        self.recent_kv_per_request: float | None = None

    @property
    def tpot_slo_s(self) -> float | None:
        """The TPOT SLO in force: the given one, else the measured default (None: neither)."""
        if self.given_slo_s is not None:
            return self.given_slo_s
        return None if self.default is None else self.default.slo_s

    @property
    def slo_origin(self) -> str | None:
        """``SLO_GIVEN``, ``SLO_DEFAULT`` or None: where the SLO in force came from."""
        if self.given_slo_s is not None:
            return SLO_GIVEN
        return None if self.tpot_slo_s is None else SLO_DEFAULT

    def set_tpot_slo(self, tpot_slo_s: float | None) -> None:
        """Hold ``tpot_slo_s`` from now on (None: the default if any, else no SLO, never caps); what
        the models learned stays. Raises ValueError naming ``tpot_slo_s`` and changes nothing when
        it is not a positive number."""
        self.given_slo_s = check_tpot_slo("tpot_slo_s", tpot_slo_s)
        self.last = None  # the last decision was judged against the old SLO

    def observe(self, batch: int, kv_tokens: int, step_s: float) -> None:
        """One pure decode step: a sample of the step-time model, of the default's solo step, and token time."""
        self.model.observe(batch, kv_tokens, step_s)
        if self.default is not None:
            self.default.observe(batch, step_s)
        self.prefill.observe(batch, 0.0)
        per, m = kv_tokens / batch, self.recent_kv_per_request
        self.recent_kv_per_request = per if m is None else m + (1.0 - self.model.decay) * (per - m)

    def observe_iteration(self, seconds: float, decoded: int, kv_tokens: int, stalled: int, prefilled: bool,
                          prefill_tokens: int = 0) -> None:  # fmt: skip
        """Any busy iteration: ``decoded`` requests (holding ``kv_tokens``) got a token, ``stalled``
        running requests waited, ``prefilled``: it computed some prefill, ``prefill_tokens`` of it.
        A pure decode step is a sample (``observe``); prefill and mixed iterations feed the stalled
        share, and the prefill-time model (the time beyond the predicted decode step)."""
        if not prefilled and decoded:
            self.observe(decoded, kv_tokens, seconds)
            return
        step = self.model.predict(decoded, kv_tokens) if decoded else None
        self.prefill.observe_iteration(seconds, decoded, stalled, prefilled, step)
        if prefilled and prefill_tokens > 0 and (step is not None or not decoded):
            self.prefill_time.observe(prefill_tokens, max(0.0, seconds - (step or 0.0)))

    @property
    def judges_paces(self) -> bool:
        """Whether ``decide`` can use the per-request numbers (a TPOT SLO is set): callers skip
        building them otherwise (an admission question is asked at every iteration a request waits)."""
        return self.tpot_slo_s is not None

    def predict_tpot(self, batch: int, kv_tokens: int) -> float | None:
        """The TPOT a running request of a ``batch``-request batch sees: the predicted decode step
        plus the prefills it waits through, ``batch * q`` (None while learning)."""
        return self._with_stalls(self.model.predict(batch, kv_tokens), batch)

    def _with_stalls(self, step_s: float | None, batch: int) -> float | None:
        """A decode step of ``batch`` requests plus their share of the prefill stalls (None stays None)."""
        return None if step_s is None else step_s + batch * self.prefill.per_token()

    def decide(self, running: int, kv_tokens: int, add_kv_tokens: int, *, paces: Sequence[RunningPace] | None = None,
               pass_tokens: int = 0, add_tokens: int = 0) -> BatchDecision:  # fmt: skip
        """The decision without counting it (``may_grow`` counts). ``running``: requests decoding
        after this pass without the newcomer (those admitted earlier in the pass included), holding
        ``kv_tokens``; ``paces``: the decoding ones' (``request_pace.RunningPace``); ``pass_tokens``:
        prompt tokens this pass prefills already, ``add_tokens`` the newcomer's."""
        check_int("running", running, 0)
        check_int("kv_tokens", kv_tokens, 0)
        check_int("add_kv_tokens", add_kv_tokens, 0)
        check_int("pass_tokens", pass_tokens, 0)
        check_int("add_tokens", add_tokens, 0)
        slo = self.tpot_slo_s
        if slo is not None and running and paces is not None and self.prefill_time.coef is not None:
            rule, predicted = PER_REQUEST, self._worst_pace(running, kv_tokens, add_kv_tokens, paces, slo,
                                                             pass_tokens, add_tokens)  # fmt: skip
        else:
            rule, predicted = BATCH, self.predict_tpot(running + 1, kv_tokens + add_kv_tokens)
        if slo is None:
            reason = NO_SLO
        elif running == 0:
            reason = EMPTY_BATCH
        elif predicted is None:
            reason = LEARNING
        elif predicted <= slo:
            reason = WITHIN_SLO
        else:
            # the smallest batch: one request, the lighter of the newcomer and a running one on average
            light = min(add_kv_tokens, kv_tokens // running)
            alone = self.model.predict(1, light) if rule == PER_REQUEST else self.predict_tpot(1, light)
            reason = SLO_INFEASIBLE if alone > slo else OVER_SLO
        return BatchDecision(reason != OVER_SLO, reason, running, predicted, slo, rule)

    def _worst_pace(self, running: int, kv_tokens: int, add_kv_tokens: int, paces: Sequence[RunningPace],
                    slo: float, pass_tokens: int, add_tokens: int) -> float | None:  # fmt: skip
        """The per-request rule's prediction: the newcomer's own step, or the highest TPOT it leaves
        a running request on time without it (``request_pace.worst_tpot``); None while learning."""
        step_with = self.model.predict(running + 1, kv_tokens + add_kv_tokens)
        if step_with is None:
            return None
        step_without = self.model.predict(running, kv_tokens)
        stall_without = self.prefill_time.predict(pass_tokens)
        stall_with = self.prefill_time.predict(pass_tokens + add_tokens)
        worst = worst_tpot(paces, slo, stall_without, stall_with, step_without, step_with)
        return step_with if worst is None else max(step_with, worst)

    def may_grow(self, running: int, kv_tokens: int, add_kv_tokens: int, **pace) -> BatchDecision:
        """May a request holding ``add_kv_tokens`` join ``running`` requests holding ``kv_tokens``?
        ``pace``: ``decide``'s keyword arguments (the per-request rule's numbers)."""
        d = self.decide(running, kv_tokens, add_kv_tokens, **pace)
        self.counts[d.reason] += 1
        self.last = d
        return d

    def status(self, running: int, kv_tokens: int, measured_s: float | None) -> dict:
        """JSON-ready: the SLO in force, the batch cap and why, predicted vs measured TPOT (the
        decode step with the prefills running requests wait through; ``measured_s``: the measured
        decode steps' mean). The cap and the curve are for requests holding the running ones' mean
        KV, or when nothing runs the recent decode steps' (``recent_kv_per_request``)."""
        slo, model = self.tpot_slo_s, self.model
        q = self.prefill.per_token()
        kv_per = kv_tokens / running if running else self.recent_kv_per_request or 0.0
        if slo is None:
            cap, why = None, NO_SLO
        elif model.coef is None:
            cap, why = None, LEARNING
        elif self.predict_tpot(1, round(kv_per)) > slo:
            cap, why = None, SLO_INFEASIBLE
        else:  # each request adds its share of the stalls, q, beside its share of the step
            cap, why = model.cap(slo, kv_per, extra_per_request=q), CAP_WITHIN_SLO
        a, b, c = model.coef if model.coef is not None else (None, None, None)
        return {
            "tpot_slo_ms": None if slo is None else round(slo * 1e3, 9),  # as set: no float noise of the unit change
            "slo_origin": self.slo_origin,
            "default_slo": None if self.default is None else self.default.status(),
            "batch_cap": cap,
            "batch_cap_reason": why,
            "running": running,
            "predicted_tpot_ms": _ms(self.predict_tpot(max(running, 1), kv_tokens if running else round(kv_per))),
            "kv_tokens_per_request": round(kv_per, 1),
            "predicted_tpot_ms_by_batch": self._curve(kv_per, cap, running),
            "measured_tpot_ms": _ms(self._with_stalls(measured_s, max(running, 1))),
            "measured_decode_step_ms": _ms(measured_s),
            "prefill_stalls": self.prefill.status(),
            "prefill_time": self._prefill_time_status(),
            "model": {
                "samples": model.samples,
                "min_samples": model.min_samples,
                "intercept_ms": _ms(a),
                "per_request_ms": _ms(b),
                "per_kv_token_ms": _ms(c),
            },  # fmt: skip
            "decisions": dict(self.counts),
            "last_decision": None
            if self.last is None
            else {
                "admit": self.last.admit,
                "reason": self.last.reason,
                "running": self.last.running,
                "predicted_ms": _ms(self.last.predicted_s),
                "slo_ms": _ms(self.last.slo_s),
                "rule": self.last.rule,
            },  # fmt: skip
        }

    def _prefill_time_status(self) -> dict:
        """The prefill-time model the per-request rule uses: samples, and its fit while learned."""
        coef = self.prefill_time.coef
        return {"samples": self.prefill_time.samples,
                "intercept_ms": None if coef is None else _ms(coef[0]),
                "per_1k_tokens_ms": None if coef is None else _ms(coef[1] * 1000)}  # fmt: skip

    def _curve(self, kv_per_request: float, cap: int | None, running: int) -> dict[str, float]:
        """``{batch: predicted TPOT ms}`` for batches 1, 2, 4, ... of ``kv_per_request`` each, up to the
        first power of two past the cap, the running batch and 8 (at most 1024); empty while learning."""
        if self.model.coef is None:
            return {}
        top = min(1024, max(8, running, 0 if cap is None else cap + 1))
        sizes = [1 << i for i in range(11) if (1 << i) < top] + [1 << max(0, (top - 1).bit_length())]
        return {str(n): _ms(self.predict_tpot(n, round(n * kv_per_request))) for n in sizes}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)
