"""Render the map-call figures of ``docs/elastic-kv.md`` from the results JSON: the co-location
run (``benchmark/results/e2e/colocated.json``, written by ``benchmark/e2e/colocated.py``) and the
decode-step micro-benchmark (``benchmark/results/micro/pool_decode_host.json``, written by
``benchmark/micro/pool_decode.py``): the figures in the docs are the JSON's, never typed.

    python -m benchmark.map_calls_table           # rewrite the blocks
    python -m benchmark.map_calls_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_map_calls_table.py`` runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import block_markers, check_args, write_or_check
from benchmark.figures import span

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "elastic-kv.md"
COLOCATED = REPO / "benchmark" / "results" / "e2e" / "colocated.json"
POOL_DECODE = REPO / "benchmark" / "results" / "micro" / "pool_decode_host.json"
COMMAND = "python -m benchmark.map_calls_table"


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``."""
    return block_markers(COMMAND, "map calls", name)


def _rel(path: Path) -> str:
    """The path as the docs name it: from the repository root (a file elsewhere: its name)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def render_colocated(doc: dict) -> str:
    """Map calls of the memx servers in every round: per server and run, and per decode step."""
    servers = [e for r in doc["rounds"] for e in r["memx"]["elastic_kv"]]
    per_step = sorted(r["memx"]["decode_map_calls_per_step"] for r in doc["rounds"])
    per_run = len(doc["rounds"][0]["memx"]["elastic_kv"])
    begin, end = markers("colocated")
    text = (
        f"* **Map calls** (`{_rel(COLOCATED)}`, {per_run} memx servers, {len(doc['rounds'])} runs): "
        f"{span([e['decode_map_calls'] for e in servers], ',')} groups mapped on the request path during decode "
        f"per server and run, in {span([e['decode_steps'] for e in servers], ',')} decode steps "
        f"({per_step[len(per_step) // 2]:.4f} [{per_step[0]:.4f}, {per_step[-1]:.4f}] per step over the rounds); "
        f"{span([e['map_calls_request'] for e in servers], ',')} request-path maps in all (prefill too) and "
        f"{span([e['map_calls_premap'] for e in servers], ',')} premapped off the path."
    )
    return "\n".join([begin, text, end])


def _costs(variants: dict, names: tuple[str, ...], key: str, fmt: str) -> str:
    return " / ".join(f"{variants[n][key]:{fmt}}" for n in names)


def render_pool_decode(doc: dict) -> str:
    """Request-path maps per step and per-step cost of the three variants."""
    v, p = doc["variants"], doc["params"]
    names = ("on_demand", "premapped", "stock")
    begin, end = markers("pool_decode")
    text = (
        f"* Mechanism: `{doc['command'].strip()}` (upstream's `TokenToKVPoolAllocator` driven by `ElasticKV`, "
        f"{p['requests']} decoding requests, {p['steps']:,} steps; {doc['where']}; "
        f"`{_rel(POOL_DECODE)}`): on-demand mapping "
        f"{v['on_demand']['request_path_maps_per_step']:.3f} map calls per step on the request path, premapped "
        f"**{v['premapped']['request_path_maps_per_step']:.3f}** ({v['premapped']['premap_calls']} premaps between "
        f"steps); per-step cost p50 {_costs(v, names, 'p50_us', '.1f')} µs (on-demand / premapped / "
        f"stock allocator over plain tensors), p99 {_costs(v, names, 'p99_us', '.0f')} µs."
    )
    return "\n".join([begin, text, end])


def blocks() -> list[tuple[str, str, str]]:
    colocated = render_colocated(json.loads(COLOCATED.read_text()))
    pool = render_pool_decode(json.loads(POOL_DECODE.read_text()))
    return [(*markers("colocated"), colocated), (*markers("pool_decode"), pool)]


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__.split("\n\n")[0])
    return write_or_check(DOC, blocks(), check, COMMAND)


if __name__ == "__main__":
    sys.exit(main())
