"""Render the figures of the no-harm matrix's probes (``benchmark/e2e/matrix_probe.py``) into the
docs from their JSON in ``benchmark/results/e2e/probes/``: the docs quote the JSON, never typed.

One block per probe named in ``BLOCKS``: the command (its ``--out`` left out), the code it ran, the
SLOs in force (the scale times each model's solo latency), then one row per setup: attainment
median [min, max] over the rounds and, per model, the span of the runs' TTFT / TPOT medians and of
the requests meeting each SLO; then the ratios named for that probe, per round (a pair), as
median [min, max].

    python -m benchmark.probe_table           # rewrite the blocks
    python -m benchmark.probe_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_probe_table.py`` runs the check.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmark.doc_blocks import block_markers, check_args, write_or_check
from benchmark.figures import median_range, span

REPO = Path(__file__).resolve().parents[1]
PROBES = REPO / "benchmark" / "results" / "e2e" / "probes"
COMMAND = "python -m benchmark.probe_table"

# (probe JSON stem, doc, ratios: (numerator setup, denominator setup) per round)
BLOCKS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("bursty2_x2_lend_add6cb6", "governor.md", (("lend", "stock"),)),
    ("bursty2_x2_perreq_b3b53a5", "governor.md", (("lend", "stock"), ("lend-nocap", "lend"))),
    ("steady2_x2_lend_7ae0832", "governor.md", (("lend", "stock"),)),
    ("steady2_x2_perreq_0dddaba", "governor.md", (("lend", "stock"), ("lend", "lend-nocap"))),
    ("steady2_x2_lend+nolend_48760a6", "governor.md", (("lend", "stock"), ("nolend", "stock"))),
    ("steady2_x2_lend+lend-cold_e307683", "governor.md", (("lend", "stock"), ("lend", "lend-cold"))),
    ("steady2_x2_lend+lend-cold_e307683", "elastic-kv.md", (("lend", "lend-cold"),)),
    ("bursty2_x2_lend+lend-cold_e307683", "elastic-kv.md", (("lend", "lend-cold"), ("lend", "stock"))),
    ("bursty2_x2_lend+lend-cold_e307683", "governor.md", (("lend", "stock"),)),
    ("bursty2_x2_lend+lend-spin10k_cc1ed80", "router.md", (("lend-spin10k", "lend"), ("lend", "stock"))),
    ("bursty2_x2_passive_51a006c", "router.md", (("lend", "nolend"), ("lend", "stock"))),
    ("bursty2_x2_passive_0edbb5b", "router.md", (("lend", "nolend"), ("lend", "stock"))),
    ("bursty2_x2_nocap_9eea8ae", "governor.md", (("lend-nocap", "lend"), ("lend", "stock"))),
)


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``."""
    return block_markers(COMMAND, "probe", name)


def command_without_out(command: str) -> str:
    """The probe's command line as run, without where it wrote its JSON (an empty argument, two
    spaces in the recorded line, shown as ``''``)."""
    return re.sub(r" --out\s+\S+", "", command).strip().replace("  ", " '' ")


def render(stem: str, doc: dict, ratios: tuple[tuple[str, str], ...]) -> str:
    """The block of probe ``stem`` (its JSON ``doc``)."""
    models, scale, runs = sorted(doc["solo"]), doc["scale"], doc["runs"]
    slos = ", ".join(f"`{m}` TTFT {scale * doc['solo'][m]['ttft_s'] * 1e3:.1f} ms / TPOT "
                     f"{scale * doc['solo'][m]['tpot_s'] * 1e3:.2f} ms" for m in models)  # fmt: skip
    head = ["| setup | attainment |"] + [f" `{m}` TTFT ms | TPOT ms | met TTFT / TPOT |" for m in models]
    rows = ["".join(head), "|---|---|" + "---|---|---|" * len(models)]
    for setup, per_run in runs.items():
        cells = [f"| {setup} | {median_range([r['attainment'] for r in per_run])} |"]
        for m in models:
            got = [r["models"][m] for r in per_run]

            def cell(key: str, fmt: str, got=got) -> str:
                return span([g[key] for g in got], fmt)

            cells.append(f" {cell('ttft_ms', '.1f')} | {cell('tpot_ms', '.2f')} | {cell('ttft_met', 'd')} / "
                         f"{cell('tpot_met', 'd')} of {cell('n', 'd')} |")  # fmt: skip
        rows.append("".join(cells))
    when = f"code {doc['code']}, {doc['when']}" if doc.get("code") else "code and time not recorded"
    lines = [f"`{PROBES.relative_to(REPO) / (stem + '.json')}`: `{command_without_out(doc['command'])}`, "
             f"{when}, {len(next(iter(runs.values())))} rounds; SLOs {slos}. Per setup: "
             "attainment median [min, max] over the rounds; per model the span of the runs' medians and of the "
             "requests meeting each SLO.", "", *rows]  # fmt: skip
    for num, den in ratios:
        lines += ["", ratio_line(runs, num, den, models)]
    refusals = refusal_line(runs)
    if refusals:
        lines += ["", refusals]
    begin, end = markers(stem)
    return "\n".join([begin, *lines, end])


def ratio_line(runs: dict, num: str, den: str, models: list[str]) -> str:
    """Per round (a pair): attainment ``num`` / ``den`` where ``den`` met some SLO, and each model's
    median TTFT ``num`` / ``den``; median [min, max] over the pairs."""
    pairs = [a["attainment"] / b["attainment"] for a, b in zip(runs[num], runs[den]) if b["attainment"] > 0]
    att = f"{median_range(pairs)} ({len(pairs)} pairs)" if pairs else f"no pair ({den} met no SLO in any round)"
    ttft = []
    for m in models:
        got = [a["models"][m]["ttft_ms"] / b["models"][m]["ttft_ms"] for a, b in zip(runs[num], runs[den])
               if a["models"][m].get("n") and b["models"][m].get("n")]  # fmt: skip
        if got:
            ttft.append(f"`{m}` {median_range(got)}, above 1 in {sum(x > 1 for x in got)} of {len(got)}")
    return f"Attainment {num} / {den} per round: {att}. Median TTFT {num} / {den} per round: {'; '.join(ttft)}."


def refusal_line(runs: dict) -> str | None:
    """The batch cap's refusals by the last round (``decisions.over_slo``, each memx engine's total
    since it started), for the setups whose runs recorded their engines' counters; None if none did."""
    parts = []
    for setup, per_run in runs.items():
        engines = per_run[-1].get("engines") or {}
        counts = [f"`{m}` {(c.get('decisions') or {}).get('over_slo', 'n/a')}" for m, c in sorted(engines.items())]
        if counts:
            parts.append(f"{setup}: {', '.join(counts)}")
    if not parts:
        return None
    return "Batch-cap refusals by the last round (`decisions.over_slo`, each engine's total): " + "; ".join(parts) + "."


def blocks_by_doc() -> dict[Path, list[tuple[str, str, str]]]:
    out: dict[Path, list[tuple[str, str, str]]] = {}
    for stem, doc_name, ratios in BLOCKS:
        block = render(stem, json.loads((PROBES / f"{stem}.json").read_text()), ratios)
        out.setdefault(REPO / "docs" / doc_name, []).append((*markers(stem), block))
    return out


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__)
    worst = 0
    for doc, blocks in blocks_by_doc().items():
        worst = max(worst, write_or_check(doc, blocks, check, COMMAND))
    return worst


if __name__ == "__main__":
    sys.exit(main())
