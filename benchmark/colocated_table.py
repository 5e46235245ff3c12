"""Render the co-location blocks of ``docs/models.md``, ``docs/elastic-kv.md`` and
``benchmark/README.md`` (its summary line) from
``benchmark/e2e/colocated.py``'s JSON (three co-located servers, stock's static split against memx's
shared pool): ``colocated_families.json`` (``--families``, different model families) and the three
tiny Llamas' runs: the figures in the docs are the JSON's, never typed.

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
RESULTS = REPO / "benchmark" / "results" / "e2e"
BLOCKS = (  # (doc, block name, JSON)
    ("docs/models.md", "families", "colocated_families.json"),
    ("docs/models.md", "llama", "colocated_llama_2026-12-06.json"),
    ("docs/models.md", "llama_replan", "colocated_llama.json"),
    ("docs/elastic-kv.md", "headline", "colocated_llama.json"),
    ("benchmark/README.md", "summary", "colocated_llama.json"),
)
COMMAND = "python -m benchmark.colocated_table"
SETUP_NAMES = {"stock": "stock (static split)", "memx": "memx (one shared pool)", "stock_ample": "stock, 3x memory"}
METRICS = (  # (key, label, scale, format)
    ("ttft_p50_s", "TTFT p50 (s)", 1.0, ".3f"),
    ("ttft_p90_s", "TTFT p90 (s)", 1.0, ".3f"),  # in the JSON since 2026-12-06 (p99 needs 100 requests a run)
    ("ttft_p99_s", "TTFT p99 (s)", 1.0, ".3f"),
    ("tpot_p50_s", "TPOT p50 (ms)", 1000.0, ".2f"),
    ("throughput_tok_s", "throughput (tok/s)", 1.0, ".1f"),
)
RATIOS = (("ratios", "memx / stock"), ("ample_over_stock", "stock 3x / stock"), ("memx_over_ample", "memx / stock 3x"))


def markers(name: str) -> tuple[str, str]:
    return block_markers(COMMAND, "colocated", name)


def _families(doc: dict) -> str:
    """The servers' model families (a JSON from before ``--families`` ran three Llamas)."""
    return ", ".join(doc.get("families") or ["llama"] * 3)


def _below(st: dict) -> str:
    return f"{sum(v < 1 for v in st['values'])} of {len(st['values'])}"


def render(doc: dict, name: str = "families") -> str:
    """Per setup the median of each metric over the runs; each ratio's median [min, max] over the
    rounds and how many rounds it was below 1; failures per run."""
    setups = [s for s in SETUP_NAMES if s in doc["rounds"][0]]
    rounds = doc["rounds"]
    requests = sorted({r[s]["requests"] for r in rounds for s in setups})
    metrics = [m for m in METRICS if m[0] in rounds[0][setups[0]]]
    p = doc["params"]
    lines = [
        f"`{doc['command']}` ({len(rounds)} interleaved rounds, {doc['cpus']} CPUs): three servers "
        f"({_families(doc)}), {p['phases']} phases of {p['phase_s']:g} s (a burst "
        f"of {p['burst']} to one server, one request every {p['trickle_s']:g} s to the others), "
        f"{p['budget_tokens']} KV tokens in all: stock {p['budget_tokens'] // 3} per server, memx one shared pool of "
        f"them plus {_allowance(doc)}, stock 3x {p['budget_tokens']} per server. "
        f"{', '.join(map(str, requests))} requests a run, so the p99 is nearly the maximum (fewer than the 100 a "
        "p99 needs: no claim rests on it).",
        "",
        "| median over the runs | " + " | ".join(SETUP_NAMES[s] for s in setups) + " |",
        "|---|" + "---|" * len(setups),
    ]
    for key, label, scale, fmt in metrics:
        cells = [f"{statistics.median(r[s][key] for r in rounds) * scale:{fmt}}" for s in setups]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| failed requests per run | " + " | ".join(
        ", ".join(str(r[s]["failed"]) for r in rounds) for s in setups) + " |")  # fmt: skip
    present = [(name, label) for name, label in RATIOS if doc.get(name)]
    lines += ["", "| ratio: median [min, max] over the rounds (below 1 in) | "
              + " | ".join(label for _, label in present) + " |", "|---|" + "---|" * len(present)]  # fmt: skip
    for key, label, _, _ in metrics:
        cells = [f"{stat_range(doc[name][key], '.2f')} ({_below(doc[name][key])})" for name, _ in present]
        lines.append(f"| {label.split(' (')[0]} | " + " | ".join(cells) + " |")  # a ratio has no unit
    begin, end = markers(name)
    return "\n".join([begin, *lines, end])


def _allowance(doc: dict) -> str:
    """How the pool's activation memory was counted (``colocated.py`` measures it since 2026-12-06)."""
    per_family = (doc.get("activation_allowance") or {}).get("per_family")
    if not per_family:
        return "three prefills' activation (the tiny Llama's estimate for every server)"
    each = ", ".join(f"{f} {a['allowance_bytes'] / 1024:.0f} KiB" for f, a in per_family.items())
    return f"each server's activation allowance, measured per family before the rounds ({each})"


def render_summary(doc: dict, name: str = "summary", result: str = "colocated_llama.json") -> str:
    """One bullet for ``benchmark/README.md``'s latest figures: memx / stock TTFT p50, the tail
    the requests allow and TPOT, each with stock with 3x the memory beside it."""
    tail = "ttft_p90_s" if "ttft_p90_s" in doc["ratios"] else "ttft_p99_s"
    keys = (("ttft_p50_s", "TTFT p50"), (tail, f"TTFT {tail[5:8]}"), ("tpot_p50_s", "TPOT p50"))
    parts = [f"{label} {stat_range(doc['ratios'][key], '.2f')} (stock with 3x memory: "
             f"{doc['ample_over_stock'][key]['median']:.2f})" for key, label in keys]  # fmt: skip
    line = (f"* co-location (three servers, {_families(doc)}; `results/e2e/{result}`, "
            f"{len(doc['rounds'])} rounds), memx / stock: " + "; ".join(parts) + ".")  # fmt: skip
    begin, end = markers(name)
    return "\n".join([begin, line, end])


def blocks(doc_name: str) -> list[tuple[str, str, str]]:
    out = []
    for doc, name, result in BLOCKS:
        if doc == doc_name:
            data = json.loads((RESULTS / result).read_text())
            text = render_summary(data, name, result) if name == "summary" else render(data, name)
            out.append((*markers(name), text))
    return out


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__)
    return max(write_or_check(REPO / doc, blocks(doc), check, COMMAND) for doc in dict.fromkeys(d for d, *_ in BLOCKS))


if __name__ == "__main__":
    sys.exit(main())
