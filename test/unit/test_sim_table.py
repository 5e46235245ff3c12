"""docs/simulation.md's per-model ``combined_x1`` table is what ``benchmark/sim_table.py`` renders
from ``benchmark/results/sim/combined_x1.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import sim_table as st  # noqa: E402


def test_docs_block_matches_the_json():
    assert st.main(["--check"]) == 0, "run: python -m benchmark.sim_table"


def _run(attain: float, goodput: float, preempt: int, models=("a", "b")) -> list[dict]:
    inst = {m: {"slo": {"attainment": attain / 2}, "goodput_rps": goodput / 2} for m in models}
    return [{"overall": {"slo": {"attainment": attain}, "goodput_rps": goodput, "preemptions": preempt},
             "instances": inst}]  # fmt: skip


def _doc(results: dict) -> dict:
    return {"command": "sim run x.yaml", "where": "simulated", "seed": 0, "results": results}


def test_a_row_per_variant_and_a_column_per_model():
    text = st.render(_doc({"stock": _run(0.75, 11.2, 254), "memx": _run(0.8, 12.0, 28)}))
    assert "| variant | SLO attainment | goodput req/s | a attainment / goodput | b attainment / goodput |" in text
    assert "| `stock` | 0.750 | 11.20 | 0.375 / 5.60 | 0.375 / 5.60 | 254 |" in text
    assert "| `memx` | 0.800 | 12.00 | 0.400 / 6.00 | 0.400 / 6.00 | 28 |" in text


def test_a_changed_figure_fails_the_check(tmp_path, monkeypatch):
    doc = tmp_path / "sim.md"
    doc.write_text(f"x\n{st.render(_doc({'stock': _run(0.75, 11.2, 254)}))}\ny\n")
    monkeypatch.setattr(st, "DOC", doc)
    result = tmp_path / "r.json"
    monkeypatch.setattr(st, "RESULT", result)
    result.write_text(json.dumps(_doc({"stock": _run(0.75, 11.2, 254)})))
    assert st.main(["--check"]) == 0
    result.write_text(json.dumps(_doc({"stock": _run(0.75, 11.2, 255)})))
    assert st.main(["--check"]) == 1


def test_variants_with_other_models_or_several_runs_are_refused():
    with pytest.raises(ValueError, match="results.memx.instances"):
        st.render(_doc({"stock": _run(0.7, 1.0, 0), "memx": _run(0.7, 1.0, 0, models=("a",))}))
    with pytest.raises(ValueError, match="results.stock: 2 runs"):
        st.render(_doc({"stock": _run(0.7, 1.0, 0) * 2}))
