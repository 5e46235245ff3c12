"""Render ``docs/models.md``'s co-location blocks from ``benchmark/results/e2e/colocated_families.json``
(``benchmark/e2e/colocated.py --families ...``: three co-located servers of different model
families, stock's static split against memx's shared pool) and ``colocated_llama_2026-12-06.json``
(the same with three tiny Llamas, the same day): the figures in the docs are the JSON's, never typed.

    python -m benchmark.colocated_table           # rewrite the block
    python -m benchmark.colocated_table --check   # exit 1 when the doc differs from the JSON

``test/unit/test_colocated_table.py`` runs the check.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmark.doc_blocks import block_markers, check_args, write_or_check
from benchmark.figures import stat_range

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "models.md"
RESULTS = REPO / "benchmark" / "results" / "e2e"
BLOCKS = (("families", "colocated_families.json"), ("llama", "colocated_llama_2026-12-06.json"))  # (name, JSON)
COMMAND = "python -m benchmark.colocated_table"
SETUP_NAMES = {"stock": "stock (static split)", "memx": "memx (one shared pool)", "stock_ample": "stock, 3x memory"}
METRICS = (  # (key, label, scale, format)
    ("ttft_p50_s", "TTFT p50 (s)", 1.0, ".3f"),
    ("ttft_p99_s", "TTFT p99 (s)", 1.0, ".3f"),
    ("tpot_p50_s", "TPOT p50 (ms)", 1000.0, ".2f"),
    ("throughput_tok_s", "throughput (tok/s)", 1.0, ".1f"),
)
RATIOS = (("ratios", "memx / stock"), ("ample_over_stock", "stock 3x / stock"), ("memx_over_ample", "memx / stock 3x"))


def markers(name: str) -> tuple[str, str]:
    return block_markers(COMMAND, "colocated", name)


def _below(st: dict) -> str:
    return f"{sum(v < 1 for v in st['values'])} of {len(st['values'])}"


def render(doc: dict, name: str = "families") -> str:
    """Per setup the median of each metric over the runs; each ratio's median [min, max] over the
    rounds and how many rounds it was below 1; failures per run."""
    setups = [s for s in SETUP_NAMES if s in doc["rounds"][0]]
    rounds = doc["rounds"]
    requests = sorted({r[s]["requests"] for r in rounds for s in setups})
    p = doc["params"]
    lines = [
        f"`{doc['command']}` ({len(rounds)} interleaved rounds, {doc['cpus']} CPUs): three servers "
        f"({', '.join(doc['families'])}), {p['phases']} phases of {p['phase_s']:g} s (a burst of {p['burst']} to one "
        f"server, one request every {p['trickle_s']:g} s to the others), {p['budget_tokens']} KV tokens in all: "
        f"stock {p['budget_tokens'] // 3} per server, memx one shared pool of them (plus three prefills' "
        f"activation), stock 3x {p['budget_tokens']} per server. {', '.join(map(str, requests))} requests a run, "
        "so the p99 is nearly the maximum (fewer than the 100 a p99 needs: no claim rests on it).",
        "",
        "| median over the runs | " + " | ".join(SETUP_NAMES[s] for s in setups) + " |",
        "|---|" + "---|" * len(setups),
    ]
    for key, label, scale, fmt in METRICS:
        cells = [f"{statistics.median(r[s][key] for r in rounds) * scale:{fmt}}" for s in setups]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| failed requests per run | " + " | ".join(
        ", ".join(str(r[s]["failed"]) for r in rounds) for s in setups) + " |")  # fmt: skip
    present = [(name, label) for name, label in RATIOS if doc.get(name)]
    lines += ["", "| ratio: median [min, max] over the rounds (below 1 in) | "
              + " | ".join(label for _, label in present) + " |", "|---|" + "---|" * len(present)]  # fmt: skip
    for key, label, _, _ in METRICS:
        cells = [f"{stat_range(doc[name][key], '.2f')} ({_below(doc[name][key])})" for name, _ in present]
        lines.append(f"| {label.split(' (')[0]} | " + " | ".join(cells) + " |")  # a ratio has no unit
    begin, end = markers(name)
    return "\n".join([begin, *lines, end])


def blocks() -> list[tuple[str, str, str]]:
    return [(*markers(name), render(json.loads((RESULTS / result).read_text()), name)) for name, result in BLOCKS]


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__)
    return write_or_check(DOC, blocks(), check, COMMAND)


if __name__ == "__main__":
    sys.exit(main())
