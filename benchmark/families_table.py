"""Render the "stock upstream on CPU" table of ``docs/models.md`` from
``benchmark/results/families/probe.json`` (written by ``benchmark/families_probe.py``): what the
docs say each family does is the JSON's, never typed.

    python -m benchmark.families_table           # rewrite the block
    python -m benchmark.families_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_families_table.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "models.md"
RESULT = REPO / "benchmark" / "results" / "families" / "probe.json"
BEGIN = "<!-- generated: python -m benchmark.families_table -->"
END = "<!-- end generated: families -->"


def verdict(row: dict, control: dict | None = None) -> str:
    if row["answered"]:
        same = control is not None and control is not row and control["model"]["checksum"] == row["model"]["checksum"]
        if same and control["output_ids"] == row["output_ids"]:
            return f"**runs**, the same {len(row['output_ids'])} greedy tokens as the `{control['key']}` row"
        return "**runs** (greedy /generate answered)"
    if row["started"]:
        return "**started, did not answer**"
    return "**does not start**"


def _cell(text: str | None, limit: int = 240) -> str:
    text = (text or "").replace("\n", " ")
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def _model(row: dict) -> str:
    m = row["model"]
    env = " ".join(f"{k}={v}" for k, v in row.get("env", {}).items())
    flags = f" `{_cell(' '.join([env] * bool(env) + row['extra_args']))}`" if row["extra_args"] or env else ""
    size = f"{m['weights_bytes'] / 1e6:.2f} MB"
    return f"`{m['architecture']}`{flags}, {m['layers']} layers, hidden {m['hidden_size']}, {size}"


def _span(doc: dict) -> str:
    times = sorted(r["time"] for r in doc["probes"] if r.get("time"))
    return f"{times[0]} to {times[-1][-9:]}" if len(set(times)) > 1 else (times[0] if times else doc["time"])


def render(doc: dict) -> str:
    lines = [
        BEGIN,
        f"`{doc['command']}` ({_span(doc)}, sglang {doc['sglang']}, {doc['machine']['cpus']} CPUs): one stock "
        f"server at a time (`SGLANG_USE_CPU_ENGINE=1`, memx filtered out of `SGLANG_PLUGINS`, "
        f"`{' '.join(doc['flags'])}`), one greedy `/generate` of {doc['max_new_tokens']} tokens for "
        f"{json.dumps(doc['prompt'])}.",
        "",
        "| family | model | stock upstream on CPU here | start-up (s) | KV pool upstream built | upstream's refusal "
        "| memx |",
        "|---|---|---|---|---|---|---|",
    ]
    control = next((r for r in doc["probes"] if r["key"] == "llama" and r["answered"]), None)
    for row in doc["probes"]:
        startup = f"{row['startup_s']:.0f}" if row["startup_s"] is not None else "–"
        pool = f"`{row['pool_class']}`" if row.get("pool_class") else "–"
        refused = f"`{_cell(row.get('upstream_refusal'))}`" if row.get("upstream_refusal") else "–"
        cells = [row["family"], _model(row), verdict(row, control), startup, pool, refused, "not yet tested with memx"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: no generated block ({BEGIN} ... {END})", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = head + render(json.loads(RESULT.read_text())) + tail
    if args.check:
        if new != text:
            print(f"{DOC} differs from {RESULT}: run python -m benchmark.families_table", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
