"""The governor's batch decision: may the running batch grow by one request and keep the TPOT SLO?

Numbers in, decisions out; no clock, no I/O (the server and the simulator time the steps and
feed them here, ``observe``).

* ``StepTimeModel``: decode step time learned online, ``t = a + b * batch + c * kv_tokens``
  (seconds; ``kv_tokens`` in thousands inside the fit), an exponentially weighted least-squares
  fit (each new sample multiplies the older ones' weights by ``decay``). A slope the data
  makes negative (noise) is dropped from the fit (fixed at 0): growth never looks free.
  Before ``min_samples`` samples it predicts nothing (the prior is "unknown", and the governor
  then admits as stock would); with one batch size only, a small ridge term keeps the slopes
  near 0 (the step is taken as a fixed cost until the batch varies).
* ``BatchGovernor.may_grow(running, kv_tokens, add_kv_tokens)``: FineServe's batch-aware idea
  (Alg. 2) and the TPOT side of eLLM's Alg. 2: admit while the predicted step time of the
  running batch with the request stays within the TPOT SLO (``<=``: exactly at the SLO admits).
  The step counts the prefills a running request waits through (``prefill_stalls``: a batch of
  ``b`` predicts ``step(b) + b * q``, ``q`` the stalled seconds per decoded token measured).
  No SLO: always admit (stock behaviour). An empty batch always admits (nothing starves).
  An SLO no batch can meet (one request decoding alone, the lighter of the newcomer and an
  average running one, is predicted over it) admits as stock would: a cap would only queue
  the burst (every TTFT later) for a TPOT no batch size attains, harm with no predicted gain.
  A refusal only leaves the request waiting: nothing is
  ever dropped, a request past its TTFT included; the running batch shrinks as its requests
  finish and admission reopens.

Every decision carries a reason code (``REASONS``) and the predicted vs SLO numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memory_ext.policy._checks import check_int, check_num
from memory_ext.policy.prefill_stalls import PrefillStalls

__all__ = [
    "ADMIT_REASONS",
    "BatchDecision",
    "CAP_REASONS",
    "BatchGovernor",
    "REASONS",
    "SLO_INFEASIBLE",
    "StepTimeModel",
    "check_tpot_slo",
]

NO_SLO = "no_slo"  # no TPOT SLO set: never caps
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

KV_UNIT = 1000.0  # kv tokens per fit unit (keeps the normal equations well scaled)
RIDGE = 1e-6  # per unit of total weight, on the slopes only


def check_tpot_slo(name: str, value) -> float | None:
    """A TPOT SLO in seconds: None (no SLO) or a positive finite number; else ValueError naming ``name``."""
    if value is None:
        return None
    return check_num(name, value, 0.0, strict=True)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


@dataclass
class StepTimeModel:
    """Decode step time by batch size and KV tokens in flight (module docstring).
    Invariant: ``coef`` is None until ``samples >= min_samples``; then both slopes are >= 0.
    The fit is solved when ``coef`` is read after new samples, not at each sample: a decode step
    is observed every iteration, a prediction is asked only when a request waits (or for status)."""

    decay: float = 0.98  # weight kept by the older samples at each new one (half-life ~34 samples)
    min_samples: int = 8
    use_kv: bool = True  # False: t = a + b * batch
    samples: int = 0
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xt: list[float] = field(default_factory=lambda: [0.0] * 3)
    _w: float = 0.0
    _coef: tuple[float, float, float] | None = None  # the last fit (valid unless ``_stale``)
    _stale: bool = False

    def __post_init__(self):
        check_num("decay", self.decay, 0.0, strict=True)
        if self.decay > 1:
            raise ValueError(f"decay must be <= 1, got {self.decay}")
        check_int("min_samples", self.min_samples, 1)

    def observe(self, batch: int, kv_tokens: int, step_s: float) -> None:
        """One decode step of ``batch`` requests holding ``kv_tokens`` took ``step_s`` seconds."""
        check_int("batch", batch, 1)
        check_int("kv_tokens", kv_tokens, 0)
        check_num("step_s", step_s, 0.0)
        x = (1.0, float(batch), kv_tokens / KV_UNIT if self.use_kv else 0.0)
        d = self.decay
        for i in range(3):
            self._xt[i] = d * self._xt[i] + x[i] * step_s
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]
        self._w = d * self._w + 1.0
        self.samples += 1
        self._stale = True

    @property
    def coef(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, per request, per KV token; None while learning."""
        if self.samples < self.min_samples:
            return None
        if self._stale:
            self._coef, self._stale = self._fit(), False
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        active = [0, 1, 2] if self.use_kv else [0, 1]
        while True:
            m = [[self._xx[i][j] + (RIDGE * self._w if i == j and i else 0.0) for j in active] for i in active]
            sol = _solve(m, [self._xt[i] for i in active])
            if sol is None:  # cannot happen with the ridge term; fall back to the weighted mean
                sol = [self._xt[0] / self._w] + [0.0] * (len(active) - 1)
            coef = dict(zip(active, sol))
            negative = [i for i in active[1:] if coef[i] < 0]
            if not negative:
                return (coef[0], coef.get(1, 0.0), coef.get(2, 0.0) / KV_UNIT)
            active.remove(min(negative, key=lambda i: coef[i]))

    def predict(self, batch: int, kv_tokens: int) -> float | None:
        """Predicted step time (s) of ``batch`` requests holding ``kv_tokens``; None while learning."""
        if self.coef is None:
            return None
        a, b, c = self.coef
        return max(0.0, a + b * batch + c * kv_tokens)

    def cap(
        self, slo_s: float, kv_per_request: float, limit: int = 1 << 16, extra_per_request: float = 0.0
    ) -> int | None:
        """The largest batch (>= 1) predicted within ``slo_s`` at ``kv_per_request`` each, each request
        adding ``extra_per_request`` seconds beside the fit's (the prefill stalls); None while learning."""
        if self.coef is None:
            return None
        a, b, c = self.coef
        per = b + c * kv_per_request + extra_per_request
        if per <= 0:
            return limit if a <= slo_s else 1
        return max(1, min(limit, math.floor((slo_s - a) / per + 1e-9)))


@dataclass(frozen=True)
class BatchDecision:
    admit: bool
    reason: str  # one of REASONS
    running: int  # requests running before this one
    predicted_s: float | None  # predicted step time with the request (None: no prediction)
    slo_s: float | None


class BatchGovernor:
    """One model's batch decision under its TPOT SLO (module docstring). ``counts``: decisions by reason."""

    def __init__(self, tpot_slo_s: float | None, model: StepTimeModel | None = None):
        self.tpot_slo_s = check_tpot_slo("tpot_slo_s", tpot_slo_s)
        self.model = model if model is not None else StepTimeModel()
        self.prefill = PrefillStalls(self.model.decay)  # the prefills running requests wait through
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.last: BatchDecision | None = None
        # the KV a decoding request held, exponential mean over the decode steps (weight 1 - decay):
        # the status' cap and curve use it when nothing runs
        self.recent_kv_per_request: float | None = None

    def observe(self, batch: int, kv_tokens: int, step_s: float) -> None:
        """One pure decode step: a sample of the step-time model, and token time."""
        self.model.observe(batch, kv_tokens, step_s)
        self.prefill.observe(batch, 0.0)
        per, m = kv_tokens / batch, self.recent_kv_per_request
        self.recent_kv_per_request = per if m is None else m + (1.0 - self.model.decay) * (per - m)

    def observe_iteration(self, seconds: float, decoded: int, kv_tokens: int, stalled: int, prefilled: bool) -> None:
        """Any busy iteration: ``decoded`` requests (holding ``kv_tokens``) got a token, ``stalled``
        running requests waited, ``prefilled``: it computed some prefill. A pure decode step is a
        sample (``observe``); prefill and mixed iterations feed the stalled share."""
        if not prefilled and decoded:
            self.observe(decoded, kv_tokens, seconds)
            return
        step = self.model.predict(decoded, kv_tokens) if decoded else None
        self.prefill.observe_iteration(seconds, decoded, stalled, prefilled, step)

    def predict_tpot(self, batch: int, kv_tokens: int) -> float | None:
        """The TPOT a running request of a ``batch``-request batch sees: the predicted decode step
        plus the prefills it waits through, ``batch * q`` (None while learning)."""
        return self._with_stalls(self.model.predict(batch, kv_tokens), batch)

    def _with_stalls(self, step_s: float | None, batch: int) -> float | None:
        """A decode step of ``batch`` requests plus their share of the prefill stalls (None stays None)."""
        return None if step_s is None else step_s + batch * self.prefill.per_token()

    def decide(self, running: int, kv_tokens: int, add_kv_tokens: int) -> BatchDecision:
        """The decision without counting it (``may_grow`` counts)."""
        check_int("running", running, 0)
        check_int("kv_tokens", kv_tokens, 0)
        check_int("add_kv_tokens", add_kv_tokens, 0)
        slo = self.tpot_slo_s
        predicted = self.predict_tpot(running + 1, kv_tokens + add_kv_tokens)
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
            alone = self.predict_tpot(1, min(add_kv_tokens, kv_tokens // running))
            reason = SLO_INFEASIBLE if alone > slo else OVER_SLO
        return BatchDecision(reason != OVER_SLO, reason, running, predicted, slo)

    def may_grow(self, running: int, kv_tokens: int, add_kv_tokens: int) -> BatchDecision:
        """May a request holding ``add_kv_tokens`` join ``running`` requests holding ``kv_tokens``?"""
        d = self.decide(running, kv_tokens, add_kv_tokens)
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
            "tpot_slo_ms": None if slo is None else slo * 1e3,
            "batch_cap": cap,
            "batch_cap_reason": why,
            "running": running,
            "predicted_tpot_ms": _ms(self.predict_tpot(max(running, 1), kv_tokens if running else round(kv_per))),
            "kv_tokens_per_request": round(kv_per, 1),
            "predicted_tpot_ms_by_batch": self._curve(kv_per, cap, running),
            "measured_tpot_ms": _ms(self._with_stalls(measured_s, max(running, 1))),
            "measured_decode_step_ms": _ms(measured_s),
            "prefill_stalls": self.prefill.status(),
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
            },  # fmt: skip
        }

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
