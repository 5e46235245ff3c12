"""docs/router.md's bench_serving block is what ``benchmark/bench_serving_table.py`` renders from
``benchmark/results/e2e/bench_serving.json``, and the renderer says what the JSON says."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import bench_serving_table as bt  # noqa: E402
from benchmark.e2e import bench_serving as bs  # noqa: E402


def test_docs_block_matches_the_json():
    assert bt.main(["--check"]) == 0, "run: python -m benchmark.bench_serving_table"


def _run(thr, ttft, completed=100):
    return {"completed": completed, "request_throughput": thr, "output_throughput": 40 * thr, "median_ttft_ms": 100.0,
            "tail_ttft_ms": ttft, "median_tpot_ms": 50.0}  # fmt: skip


def _doc(pairs):
    rounds = [{"stock": s, "memx": m} for s, m in pairs]
    ratios = {k: bs.ratio_stats(rounds, k, "memx", "stock") for k in bs.KEYS}
    return {"command": "bench", "time": "t", "machine": {"cpus": 2}, "tail": "p99", "rounds": rounds,
            "ratios": ratios, "claims": bs.claims(rounds, ratios, 100)}  # fmt: skip


def test_one_contradicting_pair_breaks_the_claim_and_the_table_shows_it():
    good = _doc([(_run(1.0, 1000.0), _run(1.2, 800.0))] * 5)
    c = good["claims"]
    assert c["throughput_at_least_stock_every_pair"] and c["tail_ttft_at_most_stock_every_pair"]
    mixed = _doc([(_run(1.0, 1000.0), _run(1.2, 800.0))] * 4 + [(_run(1.0, 1000.0), _run(0.9, 1100.0, 99))])
    c = mixed["claims"]
    assert not c["throughput_at_least_stock_every_pair"] and not c["tail_ttft_at_most_stock_every_pair"]
    assert not c["memx_served_every_request"] and c["stock_served_every_request"]
    text = bt.render(mixed)
    assert "| requests answered per run | 100, 100, 100, 100, 100 | 100, 100, 100, 100, 99 |" in text
    assert "TTFT p99 (ms)" in text and "1.2 [0.9, 1.2]" in text and "memx_served_every_request **no**" in text
