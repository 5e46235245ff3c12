"""scripts/gpu_check.sh without a GPU (it says so and runs the fake-driver suite, here one test of
it, exiting with that run's status) and its report against the goals on made-up results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark.gpu_check_report import evaluate, main, render, report

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run test/gpu")
def test_without_a_gpu_it_says_so_and_runs_the_fake_driver_suite():
    env = dict(os.environ, MEMX_PY=sys.executable)  # no environment build from a unit test
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "-k", "test_construction_follows_the_documented_call_sequence"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no GPU here" in done.stdout and "1 passed" in done.stdout


def _results(tmp_path, map_us=7.5, restore=0.93, hidden=0.97, maps=0.0, failures=0):
    micro = tmp_path / "micro"
    micro.mkdir()
    (micro / "vmm_map_cuda.json").write_text(json.dumps({"map_unmap": {"p50_us": map_us}}))
    (micro / "weights_restore_cuda.json").write_text(
        json.dumps({"restore_fraction_of_reference": restore, "hidden_fraction": hidden})
    )
    (micro / "pool_decode_host.json").write_text(
        json.dumps({"variants": {"premapped": {"request_path_maps_per_step": maps}}})
    )
    junit = tmp_path / "gpu-tests.xml"
    junit.write_text(
        f'<testsuites><testsuite tests="5" failures="{failures}" errors="0" skipped="1"></testsuite></testsuites>'
    )
    return junit, micro


def test_report_meets_every_goal(tmp_path):
    junit, micro = _results(tmp_path)
    doc = report(junit, micro, {"gpu": "test"})
    assert doc["ok"] and [g["met"] for g in doc["goals"]] == [True] * 4
    assert doc["tests"] == dict(tests=5, failures=0, errors=0, skipped=1)
    out = tmp_path / "r.json"
    assert main(["--junit", str(junit), "--results", str(micro), "--out", str(out), "--gpu", "g"]) == 0
    assert json.loads(out.read_text())["gpu"] == "g"


@pytest.mark.parametrize(
    "bad, goal",
    [
        (dict(map_us=12.0), "map latency"),
        (dict(restore=0.8), "restore"),
        (dict(hidden=0.9), "hidden"),
        (dict(maps=0.01), "driver calls"),
    ],
)
def test_report_names_the_goal_missed(tmp_path, bad, goal):
    junit, micro = _results(tmp_path, **bad)
    doc = report(junit, micro)
    missed = [g["goal"] for g in doc["goals"] if not g["met"]]
    assert not doc["ok"] and len(missed) == 1 and goal in missed[0]
    assert "NO" in render(doc)


def test_missing_results_and_failed_tests_are_not_met(tmp_path):
    junit, micro = _results(tmp_path, failures=2)
    (micro / "vmm_map_cuda.json").unlink()
    doc = report(junit, micro)
    assert not doc["ok"] and doc["goals"][0]["value"] is None and "missing" in render(doc)
    assert evaluate(tmp_path / "nowhere")[3]["met"] is False
    assert report(tmp_path / "none.xml", micro)["tests"]["missing"]
