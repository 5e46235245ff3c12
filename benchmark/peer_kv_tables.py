"""Render the measured blocks of ``docs/peer-kv.md`` from the results JSON: max context
(``benchmark/results/e2e/peer_maxctx.json``, written by ``benchmark/e2e/peer_maxctx.py``), prefix
reuse (``peer_kv.json`` and ``peer_kv_rerun.json``, written by ``benchmark/e2e/peer_kv.py``) and the
peer tier in the soak and the fault suite (``benchmark/results/soak/soak.json``,
``benchmark/results/faults/faults.json``): the figures in the docs are the JSON's, never typed.

    python -m benchmark.peer_kv_tables           # rewrite the blocks
    python -m benchmark.peer_kv_tables --check   # exit 1 when the docs differ from the JSON

``test/unit/test_peer_kv_tables.py`` runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import block_markers, check_args, write_or_check
from benchmark.figures import stat_range

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "peer-kv.md"
E2E = REPO / "benchmark" / "results" / "e2e"
MAXCTX = E2E / "peer_maxctx.json"
PREFIX_RUNS = (E2E / "peer_kv.json", E2E / "peer_kv_rerun.json")
SOAK = REPO / "benchmark" / "results" / "soak" / "soak.json"
FAULTS = REPO / "benchmark" / "results" / "faults" / "faults.json"
COMMAND = "python -m benchmark.peer_kv_tables"


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name``."""
    return block_markers(COMMAND, "peer_kv", name)


def _rel(path: Path) -> str:
    """The path as the docs name it: from the repository root (a file elsewhere: its name)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


# ---------------------------------------------------------------- max context


def render_maxctx(doc: dict, path: Path = MAXCTX) -> str:
    """Stock's and memx's capacity and longest prompt that ran, from one run of the script."""
    stock, memx = doc["stock"], doc["memx"]
    ls = memx["layer_stream"]
    capacity = memx["max_total_num_tokens"] / stock["max_total_num_tokens"]
    equal = memx["greedy_equals_stock_with_enough_memory"]
    begin, end = markers("maxctx")
    lines = [
        begin,
        f"`{_rel(path)}`: `{doc['command']}` ({doc['date']}, {doc['model']}, {doc['dtype']}, "
        f"{doc['layers']} layers, `--max-total-tokens {doc['local_tokens']}` on both; wall {doc['wall_s']:,.0f} s).",
        "",
        "| | `max_total_num_tokens` | longest prompt that ran |",
        "|---|---|---|",
        f"| stock | {stock['max_total_num_tokens']:,} | **{stock['max_context']:,}** |",
        f"| memx LSC | {memx['max_total_num_tokens']:,} ({ls['streamed_layers']} of {doc['layers']} layers "
        f"streamed, {ls['resident_layers']} resident, {ls['staging_layers']} staging) | **{memx['max_context']:,}** |",
        f"| memx / stock | {capacity:.2f}× | **{doc['ratio']:.2f}×** |",
        "",
        f"The longest prompt's greedy output equals a stock server's with enough memory: "
        f"**{'yes' if equal else 'no' if equal is not None else 'not checked'}**. Moved by the layer stream "
        f"cache over the run: {ls['lsc_bytes_loaded'] / 1e9:.2f} GB loaded, {ls['lsc_bytes_stored'] / 1e6:.0f} MB "
        f"stored ({ls['forwards']} forwards; {ls['bytes_last_forward'] / 1e6:.1f} MB in the last one).",
        end,
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- prefix reuse


def _claim(ratio: dict) -> str:
    """A ratio memx / stock is a win only when no round contradicts it (every round below 1)."""
    against = sum(v >= 1 for v in ratio["values"])
    return "**yes**" if against == 0 else f"no ({against} of {len(ratio['values'])} rounds ≥ 1)"


def _per_round(values: list) -> str:
    return f"{values[0]:,} every round" if len(set(values)) == 1 else ", ".join(f"{v:,}" for v in values)


def render_prefix_run(doc: dict, path: Path) -> list[str]:
    """One run of ``benchmark/e2e/peer_kv.py``: per-setup figures, ratios, outputs, peer counters."""
    rounds, fig, ratio = doc["rounds"], doc["figures"], doc["ratios"]["memx"]
    p = doc["params"]
    lines = [
        f"**{doc['date_utc']} UTC** — `{_rel(path)}`: `{doc['command']}` ({doc['machine']}, {doc['cpus']} cores, "
        f"{p['rounds']} rounds, setups {', '.join(p['setups'])}; start-up {doc['startup_s']:.0f} s, "
        f"{doc['wall_s']:.0f} s in all). Median [min, max] over the rounds:",
        "",
        "| setup | TTFT P50, s | TTFT P99, s | hit rate | from the peer |",
        "|---|---|---|---|---|",
    ]
    for setup in p["setups"]:
        if setup in doc.get("not_run", {}):
            lines.append(f"| {setup} | not run: `{doc['not_run'][setup].split(': ', 1)[-1].split('. ')[0]}` | | | |")
            continue
        f = fig[setup]
        cells = [setup, stat_range(f["ttft_p50_s"]), stat_range(f["ttft_p99_s"]), stat_range(f["hit_rate"], ".2f"),
                 stat_range(f["peer_hit_rate"], ".2f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    mm = doc["mismatches"]["memx"]
    failed = {s: sum(r[s]["failed"] for r in rounds) for s in ("stock", "memx")}
    donor = [r[s]["donor_load"] for r in rounds for s in ("stock", "memx")]
    memx_rounds = [r["memx"] for r in rounds]
    cached = [round(r["hit_rate"] * r["prompt_tokens_returning"]) for r in memx_rounds]
    mapped = [r["memory_after"]["borrower"]["elastic_kv"] for r in memx_rounds]
    donor_kv = memx_rounds[-1]["memory_after"]["donor"]["elastic_kv"]
    t = doc["peer_totals"]
    lines += [
        "",
        f"Per-round ratios memx / stock: TTFT P50 {stat_range(ratio['ttft_p50_s'], '.2f')}, "
        f"win {_claim(ratio['ttft_p50_s'])}; "
        f"TTFT P99 {stat_range(ratio['ttft_p99_s'], '.2f')}, win {_claim(ratio['ttft_p99_s'])} "
        f"(all turns, turn 1 included: {stat_range(ratio['ttft_all_p50_s'], '.2f')} and "
        f"{stat_range(ratio['ttft_all_p99_s'], '.2f')}). Greedy outputs of the memx borrower equal stock's on "
        f"{mm['compared'] - mm['mismatched']} of {mm['compared']} turns. Failed requests: stock {failed['stock']}, "
        f"memx {failed['memx']}; donor sides {min(d['requests'] for d in donor)}–{max(d['requests'] for d in donor)} "
        f"requests a round, {sum(d['failed'] for d in donor)} failed.",
        f"Peer tier over the {len(rounds)} rounds: {t['spills']:,} spills ({t['pages_spilled']:,} pages), "
        f"{t['hits']:,} loads ({t['pages_loaded']:,} pages, {t['tokens_loaded']:,} tokens), "
        f"{t['lookups_missed']:,} lookups missed, `loads_no_room` {t['loads_no_room']}, "
        f"`recomputes_after_reclaim` {t['recomputes_after_reclaim']}, `entries_dropped_reclaim` "
        f"{t['entries_dropped_reclaim']}. A round: loads {_per_round([r['peer']['hits'] for r in memx_rounds])}, "
        f"tokens loaded {_per_round([r['peer']['tokens_loaded'] for r in memx_rounds])}, prompt tokens of the "
        f"returning turns {_per_round([r['prompt_tokens_returning'] for r in memx_rounds])}, cached "
        f"{_per_round(cached)}. The borrower's KV groups mapped after each round: "
        + ", ".join(f"{m['groups_mapped']} of {m['groups_total']}" for m in mapped)
        + f". The donor lent {doc['memx_borrowed_bytes_before_rounds'] / 2**20:g} MiB before the first round and "
        f"had {donor_kv['groups_mapped']} of its {donor_kv['groups_total']} own KV groups mapped after the last.",
    ]
    return lines


def render_prefix(docs: list[tuple[dict, Path]]) -> str:
    begin, end = markers("prefix")
    lines = [begin]
    for i, (doc, path) in enumerate(docs):
        lines += ([""] if i else []) + render_prefix_run(doc, path)
    lines.append(end)
    return "\n".join(lines)


# ---------------------------------------------------------------- soak and faults


def _kill(k: dict) -> str:
    """One SIGKILL of a lending replica: what its sibling saw."""
    lost = f"{k['before'][k['sibling']]['donors_lost']} → {k['after'][k['sibling']]['donors_lost']}"
    return (
        f"; {k['target']} at {k['t']:.0f} s: its sibling {k['sibling']}'s probe "
        f"{'unchanged' if k['sibling_probe_unchanged'] else 'changed'}, the loss seen in {k['donor_lost_seen_s']} s, "
        f"`donors_lost` {lost}, restarted and re-linked in {k['relinked_s']} s"
    )


def render_soak(soak: dict, faults: dict) -> str:
    """The peer tier in the latest soak and fault runs (the rest of them: docs/reliability.md)."""
    peer, t = soak["peer"], soak["peer"]["totals"]
    failed = [name for name, ok in soak["checks"].items() if not ok]
    verdict = "PASS" if soak["passed"] else "FAIL"
    begin, end = markers("soak")
    lines = [
        begin,
        f"Soak, `{_rel(SOAK)}`: `{soak['command']}` (seed {soak['params']['seed']}), peer tier "
        f"{soak['peer_kv']}: **{verdict}**, {len(soak['checks']) - len(failed)} of {len(soak['checks'])} checks held"
        + (f" (failed: {'; '.join(failed)})" if failed else "")
        + f". The {peer['replicas']} replicas of `{peer['model']}` lent to each other at "
        f"{peer['checks_with_borrowing']} of {peer['checks']} checks "
        f"(at most {peer['max_borrowed_bytes'] / 2**20:g} MiB borrowed): "
        f"{t['spills']:,} spills ({t['pages_spilled']:,} pages), {t['hits']:,} loads "
        f"({t['pages_loaded']:,} pages, {t['tokens_loaded']:,} tokens), {t['lookups_missed']:,} lookups missed, "
        f"{t['reclaims']} reclaims, {t['recomputes_after_reclaim']} `recomputes_after_reclaim`, "
        f"`donors_lost` {t['donors_lost']}.",
    ]
    kills = [f for f in faults["faults"] if f["kind"] == "peer_donor"]
    checks = {name: ok for name, ok in faults["checks"].items() if name.startswith("peer_donor")}
    lines.append("")
    lines.append(
        f"Faults, `{_rel(FAULTS)}`: `{faults['command']}` (seed {faults['params']['seed']}): "
        f"{len(kills)} SIGKILL{'' if len(kills) == 1 else 's'} of a lending replica"
        + "".join(_kill(k) for k in kills)
        + ". "
        + "; ".join(f"{name}: **{'held' if ok else 'failed'}**" for name, ok in checks.items())
        + "."
    )
    lines.append(end)
    return "\n".join(lines)


def blocks() -> list[tuple[str, str, str]]:
    maxctx = render_maxctx(json.loads(MAXCTX.read_text()))
    prefix = render_prefix([(json.loads(p.read_text()), p) for p in PREFIX_RUNS])
    soak = render_soak(json.loads(SOAK.read_text()), json.loads(FAULTS.read_text()))
    return [(*markers(name), block) for name, block in (("maxctx", maxctx), ("prefix", prefix), ("soak", soak))]


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__.split("\n\n")[0])
    return write_or_check(DOC, blocks(), check, COMMAND)


if __name__ == "__main__":
    sys.exit(main())
