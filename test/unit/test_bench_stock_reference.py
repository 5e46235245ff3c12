"""The soak's and the fault suite's stock reference (``benchmark/stock_reference.py``): probes go
out one at a time, every answer is compared, and a difference names the model and the prompt."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import stock_reference  # noqa: E402
from benchmark.stock_reference import PROBES, mismatches  # noqa: E402


def test_probe_answers_asks_every_probe_greedily_in_order(monkeypatch):
    asked = []

    def fake_http_json(url, body, timeout):
        asked.append((url, body["model"], body["prompt"], body["temperature"], body["max_tokens"]))
        return {"choices": [{"text": f"<{body['prompt'][:4]}>"}]}

    monkeypatch.setattr(stock_reference, "http_json", fake_http_json)
    got = stock_reference.probe_answers("http://r", "tiny-a", 5.0)
    assert got == [f"<{p[:4]}>" for p in PROBES]
    assert asked == [("http://r/v1/completions", "tiny-a", p, 0, stock_reference.PROBE_TOKENS) for p in PROBES]


def test_equal_answers_have_no_mismatch():
    ref = {"a": ["x", "y", "z"], "b": ["1", "2", "3"]}
    assert mismatches({k: list(v) for k, v in ref.items()}, ref) == []


def test_a_different_answer_names_model_prompt_and_both_answers():
    ref = {"a": ["x", "y", "z"]}
    [line] = mismatches({"a": ["x", "Y!", "z"]}, ref)
    assert line.startswith("a: ") and repr(PROBES[1]) in line and "'Y!'" in line and "stock 'y'" in line


def test_a_model_missing_on_either_side_is_a_mismatch():
    assert mismatches({"a": ["x"] * 3}, {"a": ["x"] * 3, "b": ["q"] * 3}) == [
        "b: answers missing here, present in the reference"
    ]
    assert len(mismatches({"a": ["x"] * 3, "c": ["q"] * 3}, {"a": ["x"] * 3})) == 1
