"""Render the "Latest runs" block of ``docs/reliability.md`` from the soak's and the fault
suite's JSON (``benchmark/results/soak/soak.json``, ``benchmark/results/faults/faults.json``):
the figures in the docs are the JSON's, never typed.

    python -m benchmark.reliability_table           # rewrite the block
    python -m benchmark.reliability_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_reliability_table.py`` runs the check. Runs judged by the rules before every
request was accounted for (no ``outcomes`` in the JSON) are rendered as such.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import check_args, write_or_check

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
SOAK = REPO / "benchmark" / "results" / "soak" / "soak.json"
FAULTS = REPO / "benchmark" / "results" / "faults" / "faults.json"
BEGIN = "<!-- generated: python -m benchmark.reliability_table -->"
END = "<!-- end generated -->"


def _requests(doc: dict) -> str:
    """``N scheduled, N sent: N ok, N aborted, ...`` (result counts over every kind)."""
    totals: dict[str, int] = {}
    for per_kind in doc.get("requests", {}).values():
        for result, n in per_kind.items():
            totals[result] = totals.get(result, 0) + n
    parts = ", ".join(f"{n:,} {result}" for result, n in sorted(totals.items(), key=lambda kv: -kv[1]))
    head = f"{doc['scheduled']:,} scheduled, {doc['sent']:,} sent" if "scheduled" in doc else "not counted"
    return f"{head}: {parts}"


def _verdict(doc: dict) -> str:
    failed = [name for name, ok in doc.get("checks", {}).items() if not ok]
    rules = "" if "outcomes" in doc else " (judged by the rules before every request was accounted for)"
    if doc.get("passed"):
        return f"**PASS**, {len(doc.get('checks', {}))} checks{rules}"
    return f"**FAIL**{rules}: " + "; ".join(failed)


def soak_row(doc: dict) -> str:
    p = doc["params"]
    leak = doc.get("leak", {}).get("growth", {})
    grown = {k: v for k, v in leak.items() if k in ("fds", "threads", "rss_bytes")}
    probes = "stock's answers" if doc.get("stock_reference") else "unchanged since the start"
    return (f"| soak | `{doc['command']}` (seed {p['seed']}) | {p['duration_s']:g} s + {p['warmup_s']:g} s warm-up; "
            f"start-up {doc['startup_s']:.0f} s | {_requests(doc)} | {_verdict(doc)}; probes held to {probes}; "
            f"process growth between quiet points {json.dumps(grown) if grown else 'not recorded'} |")  # fmt: skip


def _fault(f: dict) -> str:
    target = f.get("target") or f["kind"]
    if f.get("skipped"):
        return f"{f['kind']} ({target}): skipped, {f.get('reason', 'no reason recorded')}"
    took = next(
        (f[k] for k in ("recovery_s", "restarted_s", "rejoined_s", "recovered_s") if f.get(k) is not None), None
    )
    return f"{f['kind']} ({target}): back in {took} s" if took is not None else f"{f['kind']} ({target})"


def _excused(doc: dict) -> str:
    n = doc.get("excused_by_kills")
    return f" ({n:,} of them ended inside a kill's window, as the rules allow)" if n else ""


def faults_row(doc: dict) -> str:
    p = doc["params"]
    kills = "; ".join(_fault(f) for f in doc.get("faults", []))
    return (f"| faults | `{doc['command']}` (seed {p['seed']}) | {len(doc.get('faults', []))} kills: {kills} | "
            f"{_requests(doc)}{_excused(doc)} | {_verdict(doc)} |")  # fmt: skip


def render(soak: dict | None, faults: dict | None) -> str:
    rows = [r for r in (soak and soak_row(soak), faults and faults_row(faults)) if r]
    return "\n".join([BEGIN, "| run | command | what ran | requests | result |", "|---|---|---|---|---|", *rows, END])


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv=None) -> int:
    check = check_args(argv, __doc__)
    block = render(_load(SOAK), _load(FAULTS))
    return write_or_check(DOC, [(BEGIN, END, block)], check, "python -m benchmark.reliability_table")


if __name__ == "__main__":
    sys.exit(main())
