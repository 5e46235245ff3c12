"""Synthetic workloads generated offline from documented parameters.

Everything is drawn from ``numpy.random.Generator`` streams derived from one
seed (``numpy.random.SeedSequence(seed).spawn``), one stream per workload, so
adding a workload never changes the requests of another.

Length distributions (``LengthDist``):

* ``fixed``: always ``value`` (e.g. eLLM's 2k-2k, OPT 1024-512).
* ``lognormal``: mean ``mean`` and log-space std ``sigma``
  (``mu = ln(mean) - sigma^2/2``), rounded, clipped to [min, max].
* presets ``sharegpt_input`` / ``sharegpt_output`` / ``alpaca_input`` /
  ``alpaca_output``: lognormals whose means are the per-dataset averages
  published in Kwon et al., "Efficient Memory Management for LLM Serving with
  PagedAttention", SOSP 2023, §6.1 / Fig. 11 (ShareGPT: 161.31 input, 337.99
  output tokens; Alpaca: 19.31 input, 58.45 output). The spreads (``sigma``)
  are our assumption (the paper gives histograms, not moments), chosen so the
  long tail reaches a few thousand tokens for ShareGPT.

Arrival processes (``ArrivalSpec``), ``rate`` in requests/s:

* ``poisson``: exponential inter-arrival times (CV = 1).
* ``gamma``: gamma inter-arrival times with coefficient of variation ``cv``
  (CV > 1 is burstier than Poisson). We use it as the "Azure-like" bursty
  process: the Azure LLM inference traces used by Oneiros are bursty but not
  available offline, so ``cv`` is a parameter (default 2.0, our assumption).
* ``onoff``: Poisson at ``rate`` during ON periods, nothing during OFF
  periods; period lengths exponential with means ``on_s`` / ``off_s``.
* ``batch``: ``count`` requests all at ``start_s`` (offline inference).

Multi-turn sessions (``SessionSpec``): each arrival opens a session of
``turns`` turns (geometric, mean ``turns_mean``); turn k+1 is released
``think`` seconds (exponential, mean ``think_s``) after turn k finishes, and
its prompt is the whole history (previous prompt + previous output) plus a new
input draw, so consecutive turns share a growing prefix. A session stops
before its context exceeds ``max_context``.

Shared system prompt: the first ``system_prompt_tokens`` of every request of
a workload have the same content (one key per workload).

Idle windows (``idle``): arrivals inside any [start, end) window are dropped,
so the model is idle there (the process itself keeps running).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .request import Request

__all__ = [
    "LengthDist",
    "ArrivalSpec",
    "SessionSpec",
    "WorkloadSpec",
    "Workload",
    "LENGTH_PRESETS",
    "generate",
    "arrival_times",
    "sample_lengths",
]


@dataclass(frozen=True)
class LengthDist:
    kind: str = "lognormal"  # "lognormal" | "fixed"
    mean: float = 100.0
    sigma: float = 1.0
    value: int = 0
    min: int = 1
    max: int = 1 << 20

    def expected_mean(self) -> float:
        """Mean before clipping/rounding (what the parameters promise)."""
        return float(self.value) if self.kind == "fixed" else self.mean


LENGTH_PRESETS: dict[str, LengthDist] = {
    "sharegpt_input": LengthDist("lognormal", mean=161.31, sigma=1.0, min=4, max=4096),
    "sharegpt_output": LengthDist("lognormal", mean=337.99, sigma=0.9, min=1, max=4096),
    "alpaca_input": LengthDist("lognormal", mean=19.31, sigma=0.6, min=2, max=1024),
    "alpaca_output": LengthDist("lognormal", mean=58.45, sigma=0.8, min=1, max=1024),
}


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str = "poisson"  # "poisson" | "gamma" | "onoff" | "batch"
    rate: float = 1.0
    cv: float = 2.0
    on_s: float = 60.0
    off_s: float = 60.0
    count: int = 0


@dataclass(frozen=True)
class SessionSpec:
    turns_mean: float = 4.0
    think_s: float = 10.0
    max_context: int = 32768


@dataclass(frozen=True)
class WorkloadSpec:
    """Requests for one model instance (by name)."""

    model: str
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    input: LengthDist = LENGTH_PRESETS["sharegpt_input"]
    output: LengthDist = LENGTH_PRESETS["sharegpt_output"]
    sessions: SessionSpec | None = None
    system_prompt_tokens: int = 0
    start_s: float = 0.0
    end_s: float | None = None  # default: the scenario duration
    idle: tuple[tuple[float, float], ...] = ()


@dataclass
class Workload:
    """All requests (``requests[i].rid == i``). ``initial``: rids released by
    the arrival processes, sorted by arrival; follow-up turns are released by
    the engine when their previous turn finishes."""

    requests: list[Request]
    initial: list[int]


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    if dist.kind == "fixed":
        return np.full(n, int(dist.value), dtype=np.int64)
    mu = math.log(dist.mean) - dist.sigma**2 / 2
    x = np.rint(rng.lognormal(mu, dist.sigma, size=n))
    return np.clip(x, dist.min, dist.max).astype(np.int64)


def arrival_times(
    spec: ArrivalSpec, start: float, end: float, rng: np.random.Generator, rate_scale: float = 1.0
) -> np.ndarray:
    """Sorted arrival times in [start, end)."""
    if spec.kind == "batch":
        return np.full(spec.count, start, dtype=float)
    rate = spec.rate * rate_scale
    span = end - start
    if rate <= 0 or span <= 0:
        return np.empty(0)
    if spec.kind == "onoff":
        times, t, on = [], start, True
        while t < end:
            dur = rng.exponential(spec.on_s if on else spec.off_s)
            if on:
                n = rng.poisson(rate * min(dur, end - t))
                times.append(t + np.sort(rng.uniform(0, min(dur, end - t), size=n)))
            t += dur
            on = not on
        return np.concatenate(times) if times else np.empty(0)
    n_guess = int(rate * span * 1.2 + 10 * math.sqrt(rate * span) + 20)
    out = []
    t = start
    while t < end:
        if spec.kind == "poisson":
            gaps = rng.exponential(1.0 / rate, size=n_guess)
        elif spec.kind == "gamma":
            k = 1.0 / spec.cv**2
            gaps = rng.gamma(k, 1.0 / (rate * k), size=n_guess)
        else:
            raise ValueError(f"unknown arrival kind {spec.kind!r}")
        ts = t + np.cumsum(gaps)
        out.append(ts)
        t = ts[-1]
    ts = np.concatenate(out)
    return ts[ts < end]


def _drop_idle(ts: np.ndarray, idle: Sequence[tuple[float, float]]) -> np.ndarray:
    keep = np.ones(len(ts), dtype=bool)
    for a, b in idle:
        keep &= ~((ts >= a) & (ts < b))
    return ts[keep]


def generate(
    specs: Sequence[WorkloadSpec], model_index: dict[str, int], duration_s: float, seed: int, rate_scale: float = 1.0
) -> Workload:
    """Draw every request of every workload (see module docstring)."""
    streams = np.random.SeedSequence(seed).spawn(len(specs))
    drafts: list[tuple] = []  # (arrival, model, prompt, output, lineage, sys_key, sys_len, turns)
    for wi, (spec, ss) in enumerate(zip(specs, streams)):
        rng = np.random.default_rng(ss)
        m = model_index[spec.model]
        end = duration_s if spec.end_s is None else min(spec.end_s, duration_s)
        ts = _drop_idle(arrival_times(spec.arrival, spec.start_s, end, rng, rate_scale), spec.idle)
        n = len(ts)
        inp = sample_lengths(spec.input, n, rng)
        out = sample_lengths(spec.output, n, rng)
        sys_len = spec.system_prompt_tokens
        sys_key = ("sys", wi) if sys_len else None
        for i in range(n):
            turns = [(int(inp[i]) + sys_len, int(out[i]), 0.0)]
            if spec.sessions is not None:
                s = spec.sessions
                n_turns = int(rng.geometric(1.0 / max(s.turns_mean, 1.0)))
                hist = turns[0][0] + turns[0][1]
                for _ in range(n_turns - 1):
                    new_in = int(sample_lengths(spec.input, 1, rng)[0])
                    new_out = int(sample_lengths(spec.output, 1, rng)[0])
                    if hist + new_in + new_out > s.max_context:
                        break
                    turns.append((hist + new_in, new_out, float(rng.exponential(s.think_s))))
                    hist += new_in + new_out
            drafts.append((float(ts[i]), m, wi, i, sys_key, sys_len, turns))
    drafts.sort(key=lambda d: (d[0], d[1], d[2], d[3]))
    requests: list[Request] = []
    initial: list[int] = []
    for arrival, m, wi, i, sys_key, sys_len, turns in drafts:
        lineage = ("s", wi, i)
        first = len(requests)
        initial.append(first)
        for k, (p, o, _think) in enumerate(turns):
            rid = len(requests)
            nxt = rid + 1 if k + 1 < len(turns) else -1
            think_next = turns[k + 1][2] if nxt >= 0 else 0.0
            requests.append(
                Request(
                    rid,
                    m,
                    arrival if k == 0 else float("nan"),
                    p,
                    o,
                    lineage=lineage,
                    sys_key=sys_key,
                    sys_len=sys_len,
                    next_turn=nxt,
                    think_s=think_next,
                    turn=k,
                )
            )
    return Workload(requests, initial)
