"""Render the no-harm matrix block of ``docs/governor.md`` from the matrix's results files
(``benchmark/results/e2e/matrix*.json``, written by ``benchmark/e2e/matrix.py``; one table per file, in
``RESULTS`` order): the figures in the docs are the JSON's, never typed.

    python -m benchmark.matrix_table           # rewrite the block
    python -m benchmark.matrix_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_matrix_table.py`` runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import check_args, write_or_check

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "governor.md"
RESULTS = [
    REPO / "benchmark" / "results" / "e2e" / f"{name}.json"
    for name in ("matrix_bursty2", "matrix", "matrix_steady2", "matrix_x2_2026-12-07")
]
BEGIN = "<!-- generated: python -m benchmark.matrix_table -->"
END = "<!-- end generated: matrix -->"


def _spread(st: dict, fmt: str = ".2f") -> str:
    return f"{st['median']:{fmt}} [{st['min']:{fmt}}, {st['max']:{fmt}}]"


def _verdict(c: dict) -> str:
    out = "no harm" if c["no_harm"] else "**harm**"
    if c["win_asked"]:
        out += ", win ≥ 1.3×" if c["win"] else ", **no 1.3× win**"
        if c.get("win_reachable") is False:
            best = c["attainment"][c["best_split"]]["median"]
            out += f" (out of reach: 1.3× the best split's {best:.2f} is above 1)"
    return out


def render(doc: dict) -> str:
    """One results file's table, between the markers."""
    return "\n".join([BEGIN, *table(doc), END])


def table(doc: dict) -> list[str]:
    params = doc["params"]
    done = ", ".join(doc.get("workloads_done", list(doc["workloads"])))
    lines = [
        f"`{doc['command']}` ({doc['time']}, {doc['machine']['cpus']} CPUs; workloads finished: {done}), "
        f"{params['rounds']} interleaved "
        f"rounds; memx flags `{' '.join(params['memx_args'])}`. Attainment: median [min, max] over the rounds; "
        "ratio: memx / the best static split, median [min, max] over the pairs; costs: memx / best split, medians "
        "over the pairs. The tail percentile is the highest the requests per run allow (p99 needs 100).",
        "",
        "| workload | scale | best split (of searched) | its attainment | default split's | memx's | "
        "memx / best | verdict | throughput | TTFT p50 | TTFT tail | TPOT p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in doc["workloads"].items():
        searched = len(w["splits"])
        for scale, c in w["cells"].items():
            att, cost = c["attainment"], {k: v["median"] for k, v in c["cost_ratios_vs_best"].items()}
            best, default = att[c["best_split"]], att[c["default_split"]]
            row = [f"{name}{' (memory-bound)' if w['memory_bound'] else ''}", f"×{scale}",
                   f"{c['best_split']} (of {searched})", _spread(best), _spread(default), _spread(att["memx"]),
                   _spread(c["ratio_vs_best"]), _verdict(c), f"{cost['throughput_tok_s']:.2f}",
                   f"{cost['ttft_p50_s']:.2f}", f"{cost['ttft_tail_s']:.2f} ({c['tail']})",
                   f"{cost['tpot_p50_s']:.2f}"]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    lost = []
    for name, w in doc["workloads"].items():
        c = next(iter(w["cells"].values()))  # stock's runs are the same at every scale
        lost += [f"{name} `{setup}` {n} of {c['requests'][setup]}" for setup, n in c["failed"].items()
                 if n and not setup == "memx"]  # fmt: skip
        lost += [f"{name} memx ×{k} {c2['failed']['memx']} of {c2['requests']['memx']}"
                 for k, c2 in w["cells"].items() if c2["failed"]["memx"]]  # fmt: skip
    if lost:
        lines += ["", "Requests that failed (they count as misses): " + "; ".join(lost) + "."]
    cl = doc["claims"]
    missing = "; ".join(f"{k} ({v})" for k, v in doc.get("missing_workloads", {}).items())
    verdict = "yes" if cl["matrix_holds"] else "no"
    out_of_reach = cl.get("win_out_of_reach") or []
    reach = (f"The 1.3× win is out of reach in {', '.join(out_of_reach)} (the best split attains above 1 / 1.3: "
             "no memx could; counted as no win). " if out_of_reach else "")  # fmt: skip
    lines += ["", f"Matrix holds (no harm in every cell, the win where memory binds at ≥ ×10): **{verdict}**. "
                  f"{reach}Workloads not in the driver yet: {missing}."]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__.split("\n\n")[0])
    tables = [table(json.loads(path.read_text())) for path in RESULTS]
    block = "\n".join([BEGIN, *(line for t in tables for line in (*t, "")), END])
    return write_or_check(DOC, [(BEGIN, END, block)], check, "python -m benchmark.matrix_table")


if __name__ == "__main__":
    sys.exit(main())
