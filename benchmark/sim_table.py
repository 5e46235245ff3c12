"""Render the per-model table of ``combined_x1`` in ``docs/simulation.md`` from
``benchmark/results/sim/combined_x1.json`` (written by ``python -m benchmark.sim run
benchmark/sim/scenarios/combined_x1.yaml``): the figures in the docs are the JSON's, never typed.

    python -m benchmark.sim_table           # rewrite the block
    python -m benchmark.sim_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_sim_table.py`` runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import check_args, write_or_check

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "simulation.md"
RESULT = REPO / "benchmark" / "results" / "sim" / "combined_x1.json"
BEGIN = "<!-- generated: python -m benchmark.sim_table -->"
END = "<!-- end generated: combined_x1 per model -->"


def _pair(stats: dict) -> str:
    """``attainment / goodput req/s`` of one model or of the whole run."""
    return f"{stats['slo']['attainment']:.3f} / {stats['goodput_rps']:.2f}"


def render(doc: dict) -> str:
    """One row per variant, in the JSON's order; one column per model, in the first variant's order.
    Every variant holds one run (rate scale 1)."""
    variants = doc["results"]
    models = list(next(iter(variants.values()))[0]["instances"])
    lines = [
        BEGIN,
        f"`{doc['command']}`: {doc['where']}, seed {doc['seed']}.",
        "",
        "| variant | SLO attainment | goodput req/s | "
        + " | ".join(f"{m} attainment / goodput" for m in models)
        + " | preemptions |",
        "|---|---|---|" + "---|" * len(models) + "---|",
    ]
    for name, runs in variants.items():
        if len(runs) != 1:
            raise ValueError(f"results.{name}: {len(runs)} runs, the table shows one")
        run = runs[0]
        overall = run["overall"]
        if list(run["instances"]) != models:
            raise ValueError(f"results.{name}.instances: {list(run['instances'])}, expected {models}")
        cells = [f"`{name}`", f"{overall['slo']['attainment']:.3f}", f"{overall['goodput_rps']:.2f}"]
        cells += [_pair(run["instances"][m]) for m in models]
        cells.append(str(overall["preemptions"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__.split("\n\n")[0])
    block = render(json.loads(RESULT.read_text()))
    return write_or_check(DOC, [(BEGIN, END, block)], check, "python -m benchmark.sim_table")


if __name__ == "__main__":
    sys.exit(main())
