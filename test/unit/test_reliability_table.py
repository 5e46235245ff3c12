"""docs/reliability.md's "Latest runs" block is what ``benchmark/reliability_table.py`` renders
from the soak's and the fault suite's JSON, and the renderer says what a run's JSON says."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import reliability_table as rt  # noqa: E402


def test_docs_block_matches_the_json():
    assert rt.main(["--check"]) == 0, "run: python -m benchmark.reliability_table"


def _doc(**over):
    doc = {"command": "python benchmark/soak.py", "params": {"seed": 7, "duration_s": 60.0, "warmup_s": 10.0},
           "startup_s": 100.0, "scheduled": 3, "sent": 3, "requests": {"chat": {"ok": 2}, "abort": {"aborted": 1}},
           "checks": {"a": True, "b": True}, "passed": True, "outcomes": [], "stock_reference": {"m": ["x"]},
           "leak": {"growth": {"fds": 1, "threads": 0, "rss_bytes": 5}}}  # fmt: skip
    return {**doc, **over}


def test_a_passing_soak_row_names_counts_checks_and_reference():
    row = rt.soak_row(_doc())
    assert "seed 7" in row and "3 scheduled, 3 sent: 2 ok, 1 aborted" in row and "**PASS**, 2 checks" in row
    assert "stock's answers" in row and '"fds": 1' in row


def test_a_failing_run_names_its_failed_checks_and_old_rules_are_said():
    row = rt.soak_row(_doc(passed=False, checks={"a": True, "no leak": False}))
    assert "**FAIL**: no leak" in row
    old = {k: v for k, v in _doc().items() if k not in ("outcomes", "scheduled", "sent", "stock_reference")}
    assert "judged by the rules before" in rt.soak_row(old) and "not counted" in rt.soak_row(old)


def test_faults_row_lists_every_kill_and_skips_with_their_reason():
    faults = [{"kind": "engine", "target": "tiny-b", "restarted_s": 21.1},
              {"kind": "arbiter_reclaim", "skipped": True, "reason": "no reclaim in 60 s"}]  # fmt: skip
    row = rt.faults_row(_doc(command="python benchmark/faults.py", faults=faults))
    assert "2 kills" in row and "engine (tiny-b): back in 21.1 s" in row
    assert "arbiter_reclaim (arbiter_reclaim): skipped, no reclaim in 60 s" in row
