"""Metrics of a finished simulation, and the one shape of a mechanism's statistics.

Definitions (all times in seconds):

* TTFT = first token time - arrival (the arrival of a follow-up turn is when
  it was released, i.e. previous finish + think time).
* TBT: every gap between consecutive tokens of a request, including the long
  gap around a preemption. Stored as weighted (gap, count) pairs because all
  requests decoding in the same iteration share one gap; percentiles are
  weighted nearest-rank.
* TPOT = (finish - first token) / (output tokens - 1), requests with > 1 token.
* e2e = finish - arrival.
* SLO attainment: fraction of *arrived* requests that finished with
  TTFT <= ttft_slo and TPOT <= tpot_slo (unfinished and rejected requests
  count as misses). Goodput: SLO-meeting requests (and their output tokens)
  per second of ``makespan``.
* Throughput: output tokens (and requests) finished per second of
  ``makespan`` = time of the last finish (or the horizon if work remained).
* KV utilisation: blocks held by running requests / capacity, sampled every
  ``sample_period_s``.
* Prefix hit fraction: prompt tokens found in the prefix cache by the
  admission that produced each request's first token, over the prompt
  tokens of finished requests (<= 1: re-admissions after a preemption, whose
  hits include the request's own generated tokens, and admissions undone
  before the first token are not counted again).

Mechanism statistics (``MECHANISM_STATS_KEYS``): every mechanism object --
a scheduler or hook of ``benchmark.sim.mechanisms``, and the node arbiter --
has ``stats() -> dict`` returning ``mechanism_stats(...)``::

    {"mechanism": str,   # the paper / component: "ellm", "oneiros", "arbiter", ...
     "kind": str,        # the scenario kind that built it ("ellm_elastic", "select_n", ...)
     "instance": str,    # the model instance it serves ("node" for node-wide objects)
     "counters": {name: number},   # monotone totals over the run (events, bytes moved)
     "gauges": {name: number},     # values at the end of the run, maxima, sizes, settings
     "details": {...}}             # anything else JSON-able (tables, per-tier breakdowns)

``summarize`` reports them per instance as ``instances.<name>.mechanisms`` (the
instance's scheduler first, then its hooks, each object once) and the node
arbiter's as ``arbiter``. ``check_mechanism_stats`` validates the shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .request import FINISHED, PENDING

__all__ = [
    "weighted_percentile",
    "percentile",
    "summarize",
    "timeline",
    "MECHANISM_STATS_KEYS",
    "mechanism_stats",
    "check_mechanism_stats",
    "mechanism_objects",
    "collect_mechanism_stats",
]

MECHANISM_STATS_KEYS = ("mechanism", "kind", "instance", "counters", "gauges", "details")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mechanism_stats(
    mechanism: str,
    kind: str,
    instance: str,
    counters: dict | None = None,
    gauges: dict | None = None,
    details: dict | None = None,
) -> dict:
    """The statistics of one mechanism object in the common shape (module docstring)."""
    st = {
        "mechanism": mechanism,
        "kind": kind,
        "instance": instance,
        "counters": dict(counters or {}),
        "gauges": dict(gauges or {}),
        "details": dict(details or {}),
    }
    check_mechanism_stats(st)
    return st


def check_mechanism_stats(st) -> None:
    """Raise ``ValueError`` naming the first deviation from the common shape."""
    if not isinstance(st, dict) or tuple(st) != MECHANISM_STATS_KEYS:
        got = tuple(st) if isinstance(st, dict) else type(st).__name__
        raise ValueError(f"mechanism stats must have the keys {MECHANISM_STATS_KEYS} in order, got {got}")
    for key in ("mechanism", "kind", "instance"):
        if not isinstance(st[key], str) or not st[key]:
            raise ValueError(f"mechanism stats {key!r} must be a non-empty string, got {st[key]!r}")
    for key in ("counters", "gauges"):
        d = st[key]
        if not isinstance(d, dict):
            raise ValueError(f"{st['mechanism']}: {key} must be a dict, got {type(d).__name__}")
        for name, v in d.items():
            if not isinstance(name, str) or not _is_number(v):
                raise ValueError(f"{st['mechanism']}: {key}[{name!r}] must be a number, got {v!r}")
            if key == "counters" and v < 0:
                raise ValueError(f"{st['mechanism']}: counter {name!r} is negative ({v})")
    if not isinstance(st["details"], dict):
        raise ValueError(f"{st['mechanism']}: details must be a dict, got {type(st['details']).__name__}")


def mechanism_objects(inst) -> list:
    """The instance's mechanism objects: its scheduler (unwrapped from wrappers
    that keep it as ``inner``), then its hooks, each once, those with ``stats``."""
    objs, seen = [], set()
    sched = inst.scheduler
    chain = [sched]
    while hasattr(sched, "inner"):
        sched = sched.inner
        chain.append(sched)
    for o in [chain[-1], *inst.hooks]:
        if id(o) in seen or not callable(getattr(type(o), "stats", None)):
            continue
        seen.add(id(o))
        objs.append(o)
    return objs


def collect_mechanism_stats(inst) -> list[dict]:
    """``stats()`` of every mechanism object of ``inst`` (see ``mechanism_objects``)."""
    out = []
    for o in mechanism_objects(inst):
        st = o.stats()
        check_mechanism_stats(st)
        out.append(st)
    return out


def weighted_percentile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of ``values`` repeated ``weights`` times."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return float("nan")
    w = np.asarray(weights, dtype=float)
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    k = np.searchsorted(cum, q * cum[-1], side="left")
    return float(v[order][min(k, v.size - 1)])


def percentile(values: Sequence[float], q: float) -> float:
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return float("nan")
    return weighted_percentile(v, np.ones_like(v), q)


def _dist(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {"mean": float(x.mean()), "p50": percentile(x, 0.5), "p90": percentile(x, 0.9), "p99": percentile(x, 0.99)}


def _block(reqs: list, sim, insts: list, ttft_slo: float, tpot_slo: float, makespan: float) -> dict:
    rejected = set(sim.rejected)
    fin = [r for r in reqs if r.state == FINISHED and r.rid not in rejected]
    arrived = [r for r in reqs if r.state != PENDING]
    ttft = np.array([r.first_token_t - r.arrival for r in fin])
    e2e = np.array([r.finish_t - r.arrival for r in fin])
    multi = [r for r in fin if r.output_len > 1]
    tpot = np.array([(r.finish_t - r.first_token_t) / (r.output_len - 1) for r in multi])
    ok = [
        r
        for r in fin
        if r.first_token_t - r.arrival <= ttft_slo
        and (r.output_len <= 1 or (r.finish_t - r.first_token_t) / (r.output_len - 1) <= tpot_slo)
    ]
    gv = np.concatenate([np.frombuffer(i.gap_vals, dtype=float) for i in insts]) if insts else np.empty(0)
    gw = np.concatenate([np.frombuffer(i.gap_wts, dtype=np.int64) for i in insts]) if insts else np.empty(0)
    out_tokens = sum(r.output_len for r in fin)
    span = max(makespan, 1e-9)
    prompt_tokens = sum(r.prompt_len for r in fin)
    hit = sum(r.prefix_hit_tokens for r in fin)
    return {
        "requests": len(reqs),
        "arrived": len(arrived),
        "finished": len(fin),
        "rejected": sum(1 for r in reqs if r.rid in rejected),
        "unfinished": len(arrived) - len(fin) - sum(1 for r in reqs if r.rid in rejected),
        "not_arrived": len(reqs) - len(arrived),
        "ttft_s": _dist(ttft),
        "tpot_s": _dist(tpot),
        "tbt_s": {
            "mean": float(np.average(gv, weights=gw)) if gv.size else float("nan"),
            "p50": weighted_percentile(gv, gw, 0.5),
            "p99": weighted_percentile(gv, gw, 0.99),
            "gaps": int(gw.sum()) if gw.size else 0,
        },
        "e2e_s": _dist(e2e),
        "slo": {
            "ttft_s": ttft_slo,
            "tpot_s": tpot_slo,
            "attainment": len(ok) / len(arrived) if arrived else float("nan"),
        },
        "goodput_rps": len(ok) / span,
        "goodput_tokens_per_s": sum(r.output_len for r in ok) / span,
        "throughput_tokens_per_s": out_tokens / span,
        "throughput_rps": len(fin) / span,
        "preemptions": sum(r.preemptions for r in reqs),
        "prefix_hit_fraction": hit / prompt_tokens if prompt_tokens else 0.0,
    }


def summarize(sim) -> dict:
    """Summary dict of a finished ``Simulator`` (overall and per instance)."""
    finish = [r.finish_t for r in sim.requests if r.finish_t is not None]
    makespan = max(finish) if finish else sim.loop.now
    if sim.active():
        makespan = max(makespan, sim.loop.now)
    samples = sim.samples
    per = {}
    for i, inst in enumerate(sim.instances):
        reqs = [r for r in sim.requests if r.model == i]
        b = _block(reqs, sim, [inst], inst.cfg.ttft_slo_s, inst.cfg.tpot_slo_s, makespan)
        util = np.array([s.kv_used[i] / max(s.kv_capacity[i], 1) for s in samples]) if samples else np.zeros(1)
        b.update(
            {
                "iterations": inst.iterations,
                "busy_fraction": inst.busy_s / max(makespan, 1e-9),
                "prefill_tokens_computed": inst.prefill_tokens,
                "kv_capacity_blocks": inst.kv.capacity,
                "kv_util_mean": float(util.mean()),
                "kv_util_max": float(util.max()),
                "kv_evicted_blocks": inst.kv.evicted,
                "mechanisms": collect_mechanism_stats(inst),
            }
        )
        per[inst.cfg.name] = b
    # overall SLO attainment uses each request's own model SLO
    overall = _block(sim.requests, sim, sim.instances, math.inf, math.inf, makespan)
    arrived = sum(b["arrived"] for b in per.values())
    ok = sum(b["slo"]["attainment"] * b["arrived"] for b in per.values() if b["arrived"])
    overall["slo"] = {"attainment": ok / arrived if arrived else float("nan")}
    overall["goodput_rps"] = sum(b["goodput_rps"] for b in per.values())
    overall["goodput_tokens_per_s"] = sum(b["goodput_tokens_per_s"] for b in per.values())
    out = {
        "makespan_s": makespan,
        "sim_wall_s": sim.wall_s,
        "overall": overall,
        "instances": per,
        "links": sim.links.summary(),
    }
    if getattr(sim, "arbiter", None) is not None:
        out["arbiter"] = sim.arbiter.stats()
    return out


def timeline(sim) -> dict:
    """Sampled KV utilisation and queue lengths per instance (for plots)."""
    s = sim.samples
    return {
        "t": [x.t for x in s],
        "instances": {
            inst.cfg.name: {
                "kv_util": [x.kv_used[i] / max(x.kv_capacity[i], 1) for x in s],
                "kv_cached": [x.kv_cached[i] for x in s],
                "kv_capacity": [x.kv_capacity[i] for x in s],
                "waiting": [x.waiting[i] for x in s],
                "running": [x.running[i] for x in s],
            }
            for i, inst in enumerate(sim.instances)
        },
    }
