"""Render the "stock upstream on CPU" table of ``docs/models.md`` from
``benchmark/results/families/probe.json`` (written by ``benchmark/families_probe.py``), and its
family x memx-feature table from ``benchmark/results/families/memx.json`` (written by
``benchmark/families_memx.py``): what the docs say each family does is the JSONs', never typed.

    python -m benchmark.families_table           # rewrite the block
    python -m benchmark.families_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_families_table.py`` runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import check_args, write_or_check

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "models.md"
RESULT = REPO / "benchmark" / "results" / "families" / "probe.json"
BEGIN = "<!-- generated: python -m benchmark.families_table -->"
END = "<!-- end generated: families -->"
MEMX_RESULT = REPO / "benchmark" / "results" / "families" / "memx.json"
MEMX_BEGIN = "<!-- generated: python -m benchmark.families_table (memx) -->"
MEMX_END = "<!-- end generated: families x memx -->"
FEATURE_NAMES = {"elastic_kv": "elastic KV", "host_buffer": "host buffer", "weights": "remappable weights",
                 "peer_kv": "peer KV tier"}  # fmt: skip
# probe key -> memx.json row key: the family row the probe's memx column points to
MEMX_ROW_OF = {"llama": "llama", "mla": "mla", "mla_v3": "mla", "sliding_window": "sliding_window",
               "swa_gpt_oss": "swa_gpt_oss", "swa_mellum": "swa_mellum", "hybrid_linear": "hybrid_linear",
               "hybrid_linear_no_overlap": "hybrid_linear", "fp8_kv": "fp8_kv", "tp2": "tp2", "tp2_bound": "tp2",
               "tp2_no_nccl": "tp2"}  # fmt: skip


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


def memx_summary(row: dict | None) -> str:
    """The probe table's memx column: what the family x feature table says of the family."""
    if row is None:
        return "not yet tested with memx"
    verdicts = {c["verdict"] for c in row["cells"].values()}
    if verdicts == {"works"}:
        return "every feature works (table below)"
    if verdicts == {"refused"}:
        return "refused at launch (table below)"
    return "see the table below"


def render(doc: dict, memx: dict | None = None) -> str:
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
    memx_rows = {r["key"]: r for r in (memx or {}).get("rows", [])}
    for row in doc["probes"]:
        startup = f"{row['startup_s']:.0f}" if row["startup_s"] is not None else "–"
        pool = f"`{row['pool_class']}`" if row.get("pool_class") else "–"
        refused = f"`{_cell(row.get('upstream_refusal'))}`" if row.get("upstream_refusal") else "–"
        summary = memx_summary(memx_rows.get(MEMX_ROW_OF.get(row["key"], "")))
        cells = [row["family"], _model(row), verdict(row, control), startup, pool, refused, summary]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(END)
    return "\n".join(lines)


# the counters that show a feature acting, as the table quotes them
EVIDENCE = {
    "elastic_kv": ("retractions", "groups_unmapped_total"),
    "host_buffer": ("parked", "restored", "prefill_offloads"),
    "weights": ("streamed_layers", "resident_layers", "fetches"),
    "peer_kv": ("spills", "hits", "tokens_loaded"),
}


def memx_cell(cell: dict, notes: list[str], feature: str = "") -> str:
    if cell["verdict"] == "works":
        shown = [f"{k.replace('_', ' ')} {cell['evidence'][k]}" for k in EVIDENCE.get(feature, ())
                 if k in cell.get("evidence", {})]  # fmt: skip
        remap = cell.get("remap")
        if remap is not None:
            shown.append(f"remap under load: {'= stock' if remap['equal'] else 'differs'}, "
                         f"{remap['max_lent_layers']} layers released")  # fmt: skip
        counters = f"; {', '.join(shown)}" if shown else ""
        return f"**works on CPU**, greedy = stock ({_test_ref(cell['test'])}{counters})"
    if cell["verdict"] == "pool_level":
        if cell["note"] not in notes:
            notes.append(cell["note"])
        return (
            f"**pool level on CPU** ({_test_ref(cell['test'])}); in a server memx built it, then upstream's "
            f"model stopped as in stock [{notes.index(cell['note']) + 1}]"
        )
    if cell["verdict"] in ("refused", "upstream"):
        note = cell["message"] if cell["verdict"] == "refused" else cell["note"]
        if note not in notes:
            notes.append(note)
        ref = f"[{notes.index(note) + 1}]"
        if cell["verdict"] == "upstream":
            return f"upstream does not run it on CPU {ref}"
        return f"**refused** at {cell['stage'].split(' ')[0]} {ref}"
    return f"**{cell['verdict']}**: {_cell(json.dumps(cell.get('evidence')))}"


def _test_ref(test: str) -> str:
    return f"`{test.split('/')[-1]}`" if test.startswith("test/") else test


def render_memx(memx: dict) -> str:
    lines = [
        MEMX_BEGIN,
        f"`{memx['command']}` (sglang {memx['sglang']}, servers niced, at most two at a time, "
        f"`{' '.join(memx['common_args'])}` beside the CPU flags above). A feature *works* when its greedy "
        "outputs equal a stock server's on the same prompts while its counters show it acting; a refusal is "
        "quoted from the server's log (numbered below, with the notes).",
        "",
        "| family | model | " + " | ".join(FEATURE_NAMES.values()) + " |",
        "|---|---|" + "---|" * len(FEATURE_NAMES),
    ]
    notes: list[str] = []
    for row in memx["rows"]:
        cells = row["cells"]
        if "all" in cells:
            one = memx_cell(cells["all"], notes)
            values = [one] * len(FEATURE_NAMES)
        else:
            values = [memx_cell(cells[f], notes, f) for f in FEATURE_NAMES]
        lines.append("| " + " | ".join([row["family"], _model(row), *values]) + " |")
    lines.append("")
    lines += [f"{i}. `{_cell(n, 1000)}`" for i, n in enumerate(notes, 1)]
    lines.append(MEMX_END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__.split("\n\n")[0])
    memx = json.loads(MEMX_RESULT.read_text())
    blocks = [(BEGIN, END, render(json.loads(RESULT.read_text()), memx)), (MEMX_BEGIN, MEMX_END, render_memx(memx))]
    return write_or_check(DOC, blocks, check, "python -m benchmark.families_table")


if __name__ == "__main__":
    sys.exit(main())
