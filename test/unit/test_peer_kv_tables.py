"""docs/peer-kv.md's measured blocks (max context, prefix reuse, soak and faults) are what
``benchmark/peer_kv_tables.py`` renders from the results JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import peer_kv_tables as pt  # noqa: E402


def test_docs_blocks_match_the_json():
    assert pt.main(["--check"]) == 0, "run: python -m benchmark.peer_kv_tables"


def _maxctx(equal=True) -> dict:
    ls = {"streamed_layers": 8, "resident_layers": 0, "staging_layers": 1, "lsc_bytes_loaded": 3e9,
          "lsc_bytes_stored": 1.6e8, "forwards": 10, "bytes_last_forward": 1.6e7}  # fmt: skip
    return {"command": "peer_maxctx.py", "date": "d", "model": "tiny", "dtype": "float32", "layers": 8,
            "local_tokens": 1024, "wall_s": 1000.0, "stock": {"max_total_num_tokens": 1024, "max_context": 1017},
            "memx": {"max_total_num_tokens": 8192, "max_context": 4096, "layer_stream": ls,
                     "greedy_equals_stock_with_enough_memory": equal},
            "ratio": 4096 / 1017}  # fmt: skip


def test_maxctx_quotes_capacity_longest_prompt_and_the_greedy_check():
    text = pt.render_maxctx(_maxctx(), REPO / "x.json")
    assert "| stock | 1,024 | **1,017** |" in text
    assert "| memx LSC | 8,192 (8 of 8 layers streamed, 0 resident, 1 staging) | **4,096** |" in text
    assert "| memx / stock | 8.00× | **4.03×** |" in text and "enough memory: **yes**" in text
    assert "**not checked**" in pt.render_maxctx(_maxctx(equal=None), REPO / "x.json")


def _fig(values):
    return {"values": values, "median": sorted(values)[len(values) // 2], "min": min(values), "max": max(values)}


def _setup(ttft, hit, peer=None):
    f = {"ttft_p50_s": _fig(ttft), "ttft_p99_s": _fig(ttft), "hit_rate": _fig(hit)}
    f["peer_hit_rate"] = _fig(peer) if peer else _fig([float("nan")] * len(ttft))
    return f


def _round(groups_mapped):
    peer = {"hits": 18, "tokens_loaded": 4896}
    mem = {"borrower": {"elastic_kv": {"groups_mapped": groups_mapped, "groups_total": 5}},
           "donor": {"elastic_kv": {"groups_mapped": 2, "groups_total": 17}}}  # fmt: skip
    load = {"requests": 4, "failed": 0}
    return {"stock": {"failed": 0, "donor_load": load},
            "memx": {"failed": 0, "donor_load": load, "peer": peer, "memory_after": mem, "hit_rate": 0.75,
                     "prompt_tokens_returning": 6336}}  # fmt: skip


def _prefix(p50_ratios, not_run=None) -> dict:
    setups = ["stock", "hicache", "memx"] if not_run else ["stock", "memx"]
    totals = {"spills": 440, "pages_spilled": 760, "hits": 36, "pages_loaded": 612, "tokens_loaded": 9792,
              "lookups_missed": 12, "loads_no_room": 0, "recomputes_after_reclaim": 0,
              "entries_dropped_reclaim": 0}  # fmt: skip
    ratios = {k: _fig(p50_ratios) for k in ("ttft_p50_s", "ttft_all_p50_s", "ttft_all_p99_s")}
    ratios["ttft_p99_s"] = _fig([0.4, 0.5])
    return {"date_utc": "2026-11-28 07:06", "command": "peer_kv.py", "machine": "x86_64", "cpus": 2,
            "params": {"rounds": 2, "setups": setups}, "startup_s": 80.0, "wall_s": 148.0,
            "not_run": {"hicache": not_run} if not_run else {}, "rounds": [_round(5), _round(4)],
            "figures": {"stock": _setup([0.15, 0.14], [0.0, 0.0]),
                        "memx": _setup([0.07, 0.08], [0.75, 0.75], [0.75, 0.75])},
            "ratios": {"memx": ratios}, "mismatches": {"memx": {"compared": 48, "mismatched": 1}},
            "memx_borrowed_bytes_before_rounds": 12 << 20, "peer_totals": totals}  # fmt: skip


def test_prefix_run_claims_a_win_only_when_no_round_contradicts_it():
    won = "\n".join(pt.render_prefix_run(_prefix([0.5, 0.6]), REPO / "a.json"))
    assert "TTFT P50 0.60 [0.50, 0.60], win **yes**" in won and "TTFT P99 0.50 [0.40, 0.50], win **yes**" in won
    lost = "\n".join(pt.render_prefix_run(_prefix([0.5, 1.04]), REPO / "a.json"))
    assert "win no (1 of 2 rounds ≥ 1)" in lost


def test_prefix_run_rows_outputs_and_counters():
    text = "\n".join(
        pt.render_prefix_run(_prefix([0.5, 0.6], not_run="b: RuntimeError: no driver. Please"), REPO / "a.json")
    )
    assert "| stock | 0.150 [0.140, 0.150] | 0.150 [0.140, 0.150] | 0.00 [0.00, 0.00] | – |" in text
    assert "| memx | 0.080 [0.070, 0.080] | 0.080 [0.070, 0.080] | 0.75 [0.75, 0.75] | 0.75 [0.75, 0.75] |" in text
    assert "| hicache | not run: `RuntimeError: no driver` | | | |" in text
    assert "equal stock's on 47 of 48 turns" in text
    assert "loads 18 every round" in text and "cached 4,752 every round" in text
    assert "groups mapped after each round: 5 of 5, 4 of 5." in text and "lent 12 MiB" in text


def _soak(passed=True) -> tuple[dict, dict]:
    totals = {"spills": 10, "pages_spilled": 20, "hits": 3, "pages_loaded": 4, "tokens_loaded": 64,
              "lookups_missed": 5, "reclaims": 0, "recomputes_after_reclaim": 1, "donors_lost": 0}  # fmt: skip
    soak = {"command": "soak.py", "params": {"seed": 7}, "peer_kv": "on", "passed": passed,
            "checks": {"a": True, "b": passed},
            "peer": {"replicas": 2, "model": "tiny-a", "checks_with_borrowing": 3, "checks": 4,
                     "max_borrowed_bytes": 1 << 20, "totals": totals}}  # fmt: skip
    side = {"donors_lost": 0}
    kill = {"kind": "peer_donor", "target": "a", "sibling": "a#1", "t": 84.2, "sibling_probe_unchanged": True,
            "donor_lost_seen_s": 0.4, "relinked_s": 20.4, "before": {"a#1": side},
            "after": {"a#1": {"donors_lost": 1}}}  # fmt: skip
    faults = {"command": "faults.py", "params": {"seed": 9}, "faults": [kill, {"kind": "engine"}],
              "checks": {"peer_donor: re-linked": True, "engine: back": False}}  # fmt: skip
    return soak, faults


def test_soak_and_faults_say_what_the_peer_tier_did():
    text = pt.render_soak(*_soak())
    assert "**PASS**, 2 of 2 checks held" in text and "at 3 of 4 checks (at most 1 MiB borrowed)" in text
    assert "10 spills (20 pages), 3 loads (4 pages, 64 tokens)" in text
    assert "1 SIGKILL of a lending replica; a at 84 s" in text and "`donors_lost` 0 → 1" in text
    assert "peer_donor: re-linked: **held**" in text and "engine" not in text.split("Faults")[1].split("(seed")[0]
    assert "**FAIL**, 1 of 2 checks held (failed: b)" in pt.render_soak(*_soak(passed=False))


def test_a_changed_figure_fails_the_check(tmp_path, monkeypatch):
    maxctx = tmp_path / "maxctx.json"
    maxctx.write_text(json.dumps(_maxctx()))
    monkeypatch.setattr(pt, "MAXCTX", maxctx)
    doc = tmp_path / "peer-kv.md"
    doc.write_text(pt.DOC.read_text())
    monkeypatch.setattr(pt, "DOC", doc)
    assert pt.main([]) == 0 and pt.main(["--check"]) == 0
    changed = _maxctx()
    changed["memx"]["max_context"] = 4095
    maxctx.write_text(json.dumps(changed))
    assert pt.main(["--check"]) == 1
    doc.write_text(doc.read_text().replace(pt.markers("soak")[0], ""))
    assert pt.main([]) == 1
