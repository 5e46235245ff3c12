"""The co-location blocks of docs/models.md and docs/elastic-kv.md are what
``benchmark/colocated_table.py`` renders from ``colocated.py``'s JSON; ``colocated.py --families``
counts every family's memory the same way, its activation allowance measured per family."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import colocated_table as ct  # noqa: E402
from benchmark.e2e import colocated as co  # noqa: E402
from benchmark.pairs import ratio_stats  # noqa: E402


def test_docs_block_matches_the_json():
    assert ct.main(["--check"]) == 0, "run: python -m benchmark.colocated_table"


def _run(ttft50, ttft99, tpot, tput, failed=0):
    return {"ttft_p50_s": ttft50, "ttft_p90_s": 0.9 * ttft99, "ttft_p99_s": ttft99, "tpot_p50_s": tpot,
            "throughput_tok_s": tput, "requests": 78, "failed": failed}  # fmt: skip


def test_the_block_gives_medians_ratios_and_how_many_rounds_were_below_one():
    rounds = [{"stock": _run(0.8, 3.0, 0.003, 88.0), "memx": _run(0.4, 1.5, 0.0045, 88.0)},
              {"stock": _run(0.6, 2.0, 0.003, 88.0), "memx": _run(0.7, 2.2, 0.0040, 87.0, failed=1)},
              {"stock": _run(0.7, 2.5, 0.002, 88.0), "memx": _run(0.35, 1.0, 0.0030, 88.0)}]  # fmt: skip
    doc = {"command": "python benchmark/e2e/colocated.py --families sliding_window,llama,llama", "cpus": 2,
           "families": ["sliding_window", "llama", "llama"], "rounds": rounds,
           "params": {"phases": 3, "phase_s": 20.0, "burst": 16, "trickle_s": 4.0, "budget_tokens": 1536},
           "ratios": {k: ratio_stats(rounds, k, "memx", "stock") for k, *_ in ct.METRICS}}  # fmt: skip
    text = ct.render(doc)
    assert "three servers (sliding_window, llama, llama)" in text and "stock 512 per server" in text
    assert "| TTFT p50 (s) | 0.700 | 0.400 |" in text  # medians of each setup's runs
    assert "| TPOT p50 (ms) | 3.00 | 4.00 |" in text
    assert "| failed requests per run | 0, 0, 0 | 0, 1, 0 |" in text
    assert "| TTFT p50 | 0.50 [0.50, 1.17] (2 of 3) |" in text  # memx / stock per round
    assert "stock 3x" not in text.split("| ratio")[1]  # no stock_ample: no column for it
    assert "| TTFT p90 (s) | 2.250 | 1.350 |" in text and "tiny Llama's estimate for every server" in text
    doc["activation_allowance"] = {"per_family": {"sliding_window": {"allowance_bytes": 147456},
                                                  "llama": {"allowance_bytes": 94208}}}  # fmt: skip
    assert "measured per family before the rounds (sliding_window 144 KiB, llama 92 KiB)" in ct.render(doc)
    old = {**doc, "rounds": [{k: {m: v for m, v in r.items() if m != "ttft_p90_s"} for k, r in rnd.items()}
                             for rnd in rounds]}  # fmt: skip
    assert "TTFT p90" not in ct.render(old)  # a JSON from before the p90: no row for it


def test_the_memx_pool_holds_the_kv_and_each_servers_activation_allowance(tmp_path):
    import argparse

    args = argparse.Namespace(budget_tokens=1536)
    servers = co.make_servers([tmp_path] * 3, args, tmp_path, [100_000, 50_000, 100_000])
    flags = servers["memx"][0].args
    budget = float(flags[flags.index("--memx-pool-budget-gb") + 1]) * (1 << 30)
    assert round(budget) == co.kv_bytes(1536) + 250_000 == 24 * 64 * co.TOKEN_ROW_BYTES * 2 * co.LAYERS + 250_000
    stock = servers["stock"][0].args
    assert stock[stock.index("--max-total-tokens") + 1] == "512"  # a third of the KV tokens, activations outside


def test_families_parse_and_share_one_kv_row(tmp_path):
    assert co.parse_families("sliding_window, llama,llama") == ["sliding_window", "llama", "llama"]
    for bad in ("llama,llama", "llama,mla,llama"):
        with pytest.raises(ValueError, match="--families"):
            co.parse_families(bad)
    gemma2, llama = co.family_models(["sliding_window", "llama"], tmp_path)
    cfg = [json.loads((m / "config.json").read_text()) for m in (gemma2, llama)]
    assert cfg[0]["architectures"] == ["Gemma2ForCausalLM"] and cfg[1]["architectures"] == ["LlamaForCausalLM"]
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size"):  # same bytes a token
        assert cfg[0][key] == cfg[1][key] == {"num_hidden_layers": co.LAYERS, "num_key_value_heads": 2,
                                              "head_dim": 16, "hidden_size": 64}[key]  # fmt: skip


def test_the_readme_summary_names_the_tail_the_runs_allow_and_stock_with_3x_memory():
    rounds = [{"stock": _run(0.8, 3.0, 0.003, 88.0), "memx": _run(0.4, 1.5, 0.0045, 88.0),
               "stock_ample": _run(0.3, 1.0, 0.0044, 88.0)} for _ in range(5)]  # fmt: skip
    doc = {"families": ["llama"] * 3, "rounds": rounds,
           "ratios": {k: ratio_stats(rounds, k, "memx", "stock") for k, *_ in ct.METRICS},
           "ample_over_stock": {k: ratio_stats(rounds, k, "stock_ample", "stock") for k, *_ in ct.METRICS}}  # fmt: skip
    line = ct.render_summary(doc, result="x.json").splitlines()[1]
    assert (
        "`results/e2e/x.json`, 5 rounds" in line and "TTFT p50 0.50 [0.50, 0.50] (stock with 3x memory: 0.37)" in line
    )
    assert "TTFT p90 0.50" in line and "p99" not in line  # 78 requests a run: p90, not p99
