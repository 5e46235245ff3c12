"""Render ``benchmark/e2e/feature_floor.py``'s results into docs/governor.md from their JSON: per
setup the median [min, max] over the rounds of the solo TTFT, TPOT and scheduler CPU per request,
and the ratio to stock per round; the pairs of setups ``BLOCKS`` names, per round; then, for the
setups that recorded them, the coordinator's
largest steps in microseconds per request (median over the rounds), in every iteration and in those
with work.

    python -m benchmark.feature_floor_table           # rewrite the blocks
    python -m benchmark.feature_floor_table --check   # exit 1 when the doc differs from the JSON

``test/unit/test_feature_floor.py`` runs the check.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmark.doc_blocks import block_markers, check_args, write_or_check
from benchmark.figures import median_range, stat_range
from benchmark.probe_table import command_without_out

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmark" / "results" / "e2e"
DOC = REPO / "docs" / "governor.md"
COMMAND = "python -m benchmark.feature_floor_table"
# JSON stem in RESULTS (one block each in DOC), and the (numerator, denominator) setups compared per round
BLOCKS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("feature_floor", ()),
    ("feature_floor_pool", (("ekv-pool", "ekv"),)),
    ("feature_floor_warm", (("ekv-pool-warm", "ekv-pool"),)),
    ("feature_floor_lender", (("ekv-pool", "ekv-pool@base"),)),
    ("feature_floor_warm_chunks", (("ekv-pool", "ekv-pool@base"),)),
    ("feature_floor_warm_chunks2", (("ekv-pool", "ekv-pool@base"),)),
    ("feature_floor_tp2", (("ekv-pool", "ekv"),)),
    ("feature_floor_tp2_check", (("ekv", "ekv@base"),)),
    ("feature_floor_report", (("ekv-pool", "ekv-pool@base"),)),
    ("feature_floor_2026-12-07", (("ekv-pool", "ekv"),)),
)
METRICS = (("ttft_ms", "TTFT p50 ms", ".2f"), ("tpot_ms", "TPOT p50 ms", ".3f"),
           ("sched_cpu_ms_per_request", "scheduler CPU ms / request", ".1f"))  # fmt: skip
TOP_STEPS = 4


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``."""
    return block_markers(COMMAND, "feature floor", name)


def largest_steps(rounds: list[dict], setups: list[str], key: str) -> list[str]:
    """Per setup, its ``TOP_STEPS`` largest steps of ``key`` (median over the rounds, a round
    without a step counting 0), as "`setup` name µs, ..."; setups without any left out."""
    out = []
    for s in setups:
        per_round = [r[s].get(key) or {} for r in rounds]
        names = {n for p in per_round for n in p}
        med = {n: statistics.median(p.get(n, 0.0) for p in per_round) for n in names}
        top = sorted(med.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_STEPS]  # ties by name: the same every run
        if top:
            out.append(f"`{s}` " + ", ".join(f"{n} {v:.0f}" for n, v in top))
    return out


def render(stem: str, doc: dict, pairs: tuple[tuple[str, str], ...] = ()) -> str:
    rounds, setups = doc["rounds"], list(doc["setups"])
    head = "| setup | flags | " + " | ".join(f"{label} | / stock" for _, label, _ in METRICS) + " |"
    rows = [head, "|---|---|" + "---|---|" * len(METRICS)]
    for s in setups:
        cells = [f"`{s}`", " ".join(f"`{f}`" for f in doc["setups"][s]) or "–"]
        for key, _, fmt in METRICS:
            cells.append(median_range([r[s][key] for r in rounds], fmt))
            cells.append("" if s == "stock" else stat_range(doc["ratios"][f"{s}/stock {key}"], ".3f"))
        rows.append("| " + " | ".join(cells) + " |")
    command = command_without_out(doc["command"])
    how = f"{len(rounds)} interleaved rounds" + (", fresh servers every round" if doc.get("fresh_servers") else "")
    if doc.get("tp", 1) > 1:
        how += f", every setup at `--tp {doc['tp']}`"
    if "base" in doc:
        how += f"; code {doc['code']}, the `@base` setups on {doc['base']}"
    lines = [f"`{command}` ({doc['when']}, model `{doc['model']}`, {how}): "
             "per setup median [min, max] over the rounds; ratio to stock per round, median [min, max].",
             "", *rows]  # fmt: skip
    for key, what in (
        ("steps_us_per_request", "The coordinator's largest steps, µs per request"),
        ("busy_steps_us_per_request", "Of those, in iterations with work, i.e. on the requests' path"),
    ):
        steps = largest_steps(rounds, setups, key)
        if steps:
            lines += ["", f"{what} (median over the rounds): " + "; ".join(steps) + "."]
    for num, den in pairs:
        parts = []
        for key, label, _ in METRICS:
            got = [r[num][key] / r[den][key] for r in rounds]
            parts.append(f"{label} {median_range(got, '.3f')}, below 1 in {sum(x < 1 for x in got)} of {len(got)}")
        lines += ["", f"`{num}` / `{den}` per round: " + "; ".join(parts) + "."]
    begin, end = markers(stem)
    return "\n".join([begin, *lines, end])


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__)
    blocks = [(*markers(stem), render(stem, json.loads((RESULTS / f"{stem}.json").read_text()), pairs))
              for stem, pairs in BLOCKS]  # fmt: skip
    return write_or_check(DOC, blocks, check, COMMAND)


if __name__ == "__main__":
    sys.exit(main())
