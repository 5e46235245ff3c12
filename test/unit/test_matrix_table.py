"""docs/governor.md's matrix block is what ``benchmark/matrix_table.py`` renders from
``benchmark/results/e2e/matrix.json``, and the renderer says what the cells say."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import matrix_table as mt  # noqa: E402
from benchmark.matrix_score import cell, claims  # noqa: E402


def test_docs_block_matches_the_json():
    assert mt.main(["--check"]) == 0, "run: python -m benchmark.matrix_table"


def _run(att):
    return {"attainment": att, "goodput_tok_s": att, "throughput_tok_s": 2.0, "ttft_p50_s": 1.0, "ttft_tail_s": 2.0,
            "tpot_p50_s": 0.1, "tail": "p90", "failed": 0, "requests": 10}  # fmt: skip


def test_a_harmful_cell_and_a_missing_win_show_in_the_table():
    stock = {"equal": [_run(0.5)] * 4 + [{**_run(0.0), "failed": 10}], "need": [_run(0.8)] * 5}
    harm = cell([_run(0.9)] * 4 + [_run(0.6)], stock, ["equal", "need"], "equal", True, 10)
    fine = cell([_run(0.8)] * 5, stock, ["equal", "need"], "equal", True, 2)
    cells = {"10": harm, "2": fine}
    doc = {"command": "matrix", "time": "t", "machine": {"cpus": 2},
           "params": {"rounds": 5, "memx_args": ["--memx-host-buffer-gb", "1"]},
           "workloads": {"bursty2": {"memory_bound": True, "splits": [{}, {}], "cells": cells}},
           "claims": claims({"bursty2": cells}), "missing_workloads": {"prefix_reuse": "later"}}  # fmt: skip
    text = mt.render(doc)
    assert "| bursty2 (memory-bound) | ×10 | need (of 2) | 0.80 [0.80, 0.80] | 0.50 [0.00, 0.50] |" in text
    assert "**harm**, **no 1.3× win**" in text
    assert "| ×2 |" in text and "| no harm |" in text
    assert "Requests that failed (they count as misses): bursty2 `equal` 10 of 50." in text
    assert "Matrix holds" in text and "**no**" in text and "prefix_reuse (later)" in text
