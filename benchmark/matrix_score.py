"""Scoring of the no-harm matrix (``benchmark/e2e/matrix.py``, issue 26 item 3): pure functions
over the requests each run recorded, so the driver, the docs renderer and the tests agree.

Definitions (the same for every setup):

* A request *attains* at SLO scale ``k`` when it was answered, its TTFT is at most ``k`` x its
  model's solo TTFT and its TPOT at most ``k`` x its model's solo TPOT. A refusal or an error
  misses.
* Stock's runs do not depend on the SLO, so every stock run is scored at every scale. memx's runs
  do (the governor and the router read the SLO), so a memx run is scored only at the scale it
  was started with.
* The **best static split** of a cell (workload, scale) is the stock candidate with the highest
  median attainment over the rounds at that scale (ties: higher median goodput, then the order
  the candidates were listed in): the configuration a user who searched the splits would keep.
* A cell's pairs are the rounds: ``memx@k`` of round r over the best split's run of round r.
  Ratios of attainment: 0/0 counts as 1 (both missed everything), x/0 for x > 0 as infinity.
* No harm in a cell: the median ratio >= 1.0 and every pair >= 0.95. The win (only claimed where
  memory binds and the scale is >= 10): the median ratio >= 1.3. Attainment is at most 1, so the
  win is *out of reach* where the best split's median attainment is above 1 / 1.3 (0.77): no memx
  could reach it there (``win_reachable``; the claims list those cells apart, and they still count
  as no win for ``matrix_holds``: the criterion is the issue's).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from benchmark._stats import percentile

NO_HARM_MEDIAN = 1.0
NO_HARM_EVERY_PAIR = 0.95
WIN_MEDIAN = 1.3
WIN_MIN_SCALE = 10


def attains(request: Mapping, solo: Mapping, scale: float) -> bool:
    """``request`` (``ttft``, ``tpot`` or ``error``) met ``scale`` x ``solo`` (``ttft_s``, ``tpot_s``)."""
    if "error" in request:
        return False
    return request["ttft"] <= scale * solo["ttft_s"] and request["tpot"] <= scale * solo["tpot_s"]


def tail_key(n: int) -> tuple[str, float]:
    """The highest percentile ``n`` samples per run can mean: p99 from 100, p90 from 10, else p50."""
    if n >= 100:
        return "p99", 0.99
    if n >= 10:
        return "p90", 0.90
    return "p50", 0.50


def score_run(requests: Sequence[Mapping], solo: Mapping[str, Mapping], scale: float, wall_s: float) -> dict:
    """One run at one scale: attainment, goodput (output tokens/s of attaining requests), the
    costs beside it (throughput, TTFT p50 / tail, TPOT p50) and failures."""
    if not requests:
        raise ValueError("score_run: a run with no request")
    ok = [r for r in requests if "error" not in r]
    good = [r for r in ok if attains(r, solo[r["model"]], scale)]
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok]
    tail, q = tail_key(len(requests))
    nan = float("nan")
    return {
        "requests": len(requests),
        "failed": len(requests) - len(ok),
        "attainment": len(good) / len(requests),
        "goodput_tok_s": sum(r["tokens"] for r in good) / wall_s,
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall_s,
        "ttft_p50_s": percentile(ttft, 0.5) if ttft else nan,
        "ttft_tail_s": percentile(ttft, q) if ttft else nan,
        "tail": tail,
        "tpot_p50_s": percentile(tpot, 0.5) if tpot else nan,
    }


def attainment_ratio(memx: float, stock: float) -> float:
    """memx / stock attainment; 0/0 is 1 (equal), x/0 infinity."""
    if stock == 0:
        return 1.0 if memx == 0 else math.inf
    return memx / stock


def _spread(values: Sequence[float]) -> dict:
    finite = [v for v in values if not math.isnan(v)]
    return {
        "values": list(values),
        "median": statistics.median(finite) if finite else math.nan,
        "min": min(finite, default=math.nan),
        "max": max(finite, default=math.nan),
    }


def best_split(scored: Mapping[str, Sequence[Mapping]], order: Sequence[str]) -> str:
    """The candidate (key of ``scored``: its runs' scores over the rounds) a searching user keeps:
    highest median attainment, then highest median goodput, then first in ``order``."""
    if not scored:
        raise ValueError("best_split: no stock candidate")

    def key(name: str):
        runs = scored[name]
        return (statistics.median(r["attainment"] for r in runs), statistics.median(r["goodput_tok_s"] for r in runs),
                -order.index(name))  # fmt: skip

    return max(scored, key=key)


def cell(memx: Sequence[Mapping], stock: Mapping[str, Sequence[Mapping]], order: Sequence[str], default: str,
         memory_bound: bool, scale: float) -> dict:  # fmt: skip
    """One (workload, scale) cell from the rounds' scores: ``memx[r]`` and ``stock[name][r]`` are
    round r's runs scored at ``scale``. Returns the best split, the ratios to it and to the default
    split, the costs, and the verdicts."""
    rounds = len(memx)
    if any(len(runs) != rounds for runs in stock.values()):
        raise ValueError("cell: every setup needs one run per round")
    best = best_split(stock, order)

    def ratios(name: str) -> dict:
        return _spread([attainment_ratio(m["attainment"], s["attainment"]) for m, s in zip(memx, stock[name])])

    vs_best = ratios(best)
    no_harm = vs_best["median"] >= NO_HARM_MEDIAN and all(v >= NO_HARM_EVERY_PAIR for v in vs_best["values"])
    win_asked = memory_bound and scale >= WIN_MIN_SCALE
    attainment = {"memx": _spread([m["attainment"] for m in memx]),
                  **{name: _spread([r["attainment"] for r in runs]) for name, runs in stock.items()}}  # fmt: skip
    costs = {}
    for key in ("throughput_tok_s", "ttft_p50_s", "ttft_tail_s", "tpot_p50_s", "goodput_tok_s"):
        costs[key] = _spread([m[key] / s[key] if s[key] else math.nan for m, s in zip(memx, stock[best])])
    return {
        "scale": scale,
        "rounds": rounds,
        "best_split": best,
        "default_split": default,
        "attainment": attainment,
        "failed": _totals("failed", memx, stock),
        "requests": _totals("requests", memx, stock),
        "ratio_vs_best": vs_best,
        "ratio_vs_default": ratios(default),
        "cost_ratios_vs_best": costs,
        "tail": memx[0]["tail"] if memx else "p50",
        "no_harm": no_harm,
        "win_asked": win_asked,
        "win": (vs_best["median"] >= WIN_MEDIAN) if win_asked else None,
        # attainment is at most 1: above 1 / WIN_MEDIAN for the best split, no memx reaches the win
        "win_reachable": (attainment[best]["median"] * WIN_MEDIAN <= 1.0) if win_asked else None,
    }


def _totals(key: str, memx: Sequence[Mapping], stock: Mapping[str, Sequence[Mapping]]) -> dict:
    """``key`` summed over the rounds, per setup."""
    return {"memx": sum(m[key] for m in memx), **{n: sum(r[key] for r in runs) for n, runs in stock.items()}}


def claims(cells: Mapping[str, Mapping[str, Mapping]]) -> dict:
    """``cells[workload][scale]`` -> the claims dict: no harm per cell, the win per memory-bound
    cell at scale >= 10 (and which of those cells the win is out of reach in), and whether the whole
    matrix holds (issue 26's done-when)."""
    out = {"no_harm": {}, "win_where_memory_binds": {}, "win_out_of_reach": []}
    for workload, by_scale in cells.items():
        for scale, c in by_scale.items():
            out["no_harm"][f"{workload}@{scale}"] = c["no_harm"]
            if c["win_asked"]:
                out["win_where_memory_binds"][f"{workload}@{scale}"] = c["win"]
                if c.get("win_reachable") is False:  # results scored before the field: not listed
                    out["win_out_of_reach"].append(f"{workload}@{scale}")
    out["matrix_holds"] = bool(out["no_harm"]) and all(out["no_harm"].values()) and all(
        out["win_where_memory_binds"].values())  # fmt: skip
    return out
