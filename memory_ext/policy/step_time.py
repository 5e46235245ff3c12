"""Decode step time learned online: ``t = a + b * batch + c * kv_tokens`` (seconds).

An exponentially weighted least-squares fit (each new sample multiplies the older ones' weights by
``decay``; ``kv_tokens`` in thousands inside the fit). A slope the data makes negative (noise) is
dropped from the fit (fixed at 0): growth never looks free. Before ``min_samples`` samples it
predicts nothing; with one batch size only, a small ridge term keeps the slopes near 0.

The governor's batch decision (``governor``) and the prefill-time model (``request_pace``) use it.
Numbers in, numbers out; no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memory_ext.policy._checks import check_int, check_num

__all__ = ["KV_UNIT", "RIDGE", "StepTimeModel"]

KV_UNIT = 1000.0  # kv tokens per fit unit (keeps the normal equations well scaled)
RIDGE = 1e-6  # per unit of total weight, on the slopes only


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
