"""The no-harm matrix's scoring (``benchmark/matrix_score.py``) and workloads
(``benchmark/matrix_workloads.py``): attainment per scale, the best static split, the verdicts."""

from __future__ import annotations

import math

import pytest

from benchmark.matrix_score import attainment_ratio, attains, best_split, cell, claims, score_run, tail_key
from benchmark.matrix_workloads import WORKLOADS, ModelSize, Split, candidate_splits, memory_plan, schedule

SOLO = {"a": {"ttft_s": 0.1, "tpot_s": 0.01}}


def req(ttft, tpot, tokens=10, model="a"):
    return {"model": model, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def test_attains_needs_both_ttft_and_tpot_within_scale():
    assert attains(req(0.2, 0.02), SOLO["a"], 2)
    assert not attains(req(0.21, 0.02), SOLO["a"], 2)
    assert not attains(req(0.2, 0.021), SOLO["a"], 2)
    assert not attains({"model": "a", "error": "429"}, SOLO["a"], 1000)


def test_score_run_counts_failures_as_misses_and_goodput_of_attaining_only():
    runs = [req(0.1, 0.01, 10), req(1.0, 0.01, 20), {"model": "a", "error": "boom"}]
    s = score_run(runs, SOLO, 5, wall_s=10.0)
    assert s["attainment"] == pytest.approx(1 / 3)
    assert s["failed"] == 1
    assert s["goodput_tok_s"] == pytest.approx(1.0)
    assert s["throughput_tok_s"] == pytest.approx(3.0)
    assert s["tail"] == "p50"  # 3 samples: no tail percentile means anything
    with pytest.raises(ValueError, match="no request"):
        score_run([], SOLO, 5, 1.0)


@pytest.mark.parametrize("n,tail", [(5, "p50"), (10, "p90"), (99, "p90"), (100, "p99")])
def test_tail_percentile_follows_the_sample_count(n, tail):
    assert tail_key(n)[0] == tail


def test_attainment_ratio_zero_cases():
    assert attainment_ratio(0, 0) == 1.0
    assert math.isinf(attainment_ratio(0.5, 0))
    assert attainment_ratio(0.5, 1.0) == 0.5


def run(att, good=1.0, failed=0):
    return {"attainment": att, "goodput_tok_s": good, "throughput_tok_s": 1.0, "ttft_p50_s": 1.0,
            "ttft_tail_s": 1.0, "tpot_p50_s": 1.0, "tail": "p90", "failed": failed, "requests": 10}  # fmt: skip


def test_best_split_by_median_attainment_then_goodput_then_order():
    scored = {"equal": [run(0.5), run(0.6), run(0.7)], "need": [run(0.9), run(0.1), run(0.8)]}
    assert best_split(scored, ["equal", "need"]) == "need"  # median 0.8 > 0.6
    tie = {"equal": [run(0.5, 1.0)], "need": [run(0.5, 2.0)]}
    assert best_split(tie, ["equal", "need"]) == "need"
    same = {"equal": [run(0.5)], "need": [run(0.5)]}
    assert best_split(same, ["equal", "need"]) == "equal"


def test_cell_no_harm_needs_median_and_every_pair():
    stock = {"equal": [run(0.5)] * 5, "need": [run(0.8)] * 5}
    held = cell([run(0.8)] * 4 + [run(0.77)], stock, ["equal", "need"], "equal", memory_bound=False, scale=5)
    assert held["best_split"] == "need" and held["no_harm"] and held["win"] is None
    assert held["ratio_vs_default"]["median"] == pytest.approx(1.6)
    lost = cell([run(0.8)] * 5, {"equal": [run(0.5, failed=3)] * 5}, ["equal"], "equal", False, 5)
    assert lost["failed"] == {"memx": 0, "equal": 15} and lost["requests"]["equal"] == 50
    one_bad_pair = cell([run(0.9)] * 4 + [run(0.7)], stock, ["equal", "need"], "equal", False, 5)
    assert not one_bad_pair["no_harm"]  # 0.7 / 0.8 < 0.95 although the median is above 1
    low_median = cell([run(0.78)] * 5, stock, ["equal", "need"], "equal", False, 5)
    assert not low_median["no_harm"]  # every pair >= 0.95 but the median < 1


def test_cell_win_asked_only_where_memory_binds_at_scale_10_or_more():
    stock = {"equal": [run(0.5)] * 5}
    win = cell([run(0.7)] * 5, stock, ["equal"], "equal", memory_bound=True, scale=10)
    assert win["win_asked"] and win["win"]
    small = cell([run(0.6)] * 5, stock, ["equal"], "equal", memory_bound=True, scale=20)
    assert small["no_harm"] and small["win"] is False
    tight = cell([run(0.6)] * 5, stock, ["equal"], "equal", memory_bound=True, scale=5)
    assert not tight["win_asked"] and tight["win"] is None
    c = claims({"w": {"5": tight, "20": small}})
    assert c["no_harm"] == {"w@5": True, "w@20": True}
    assert c["win_where_memory_binds"] == {"w@20": False}
    assert c["matrix_holds"] is False
    assert (win["win_reachable"], small["win_reachable"], tight["win_reachable"]) == (True, True, None)
    assert c["win_out_of_reach"] == []  # the best split at 0.5: memx at 0.65 would be the win


@pytest.mark.parametrize("best, reachable", [(0.5, True), (0.769, True), (0.771, False), (1.0, False)])
def test_the_win_is_out_of_reach_where_the_best_split_attains_above_1_over_1_3(best, reachable):
    """Attainment is at most 1: against a best split above 1 / 1.3, a perfect memx misses the win.
    Such a cell is listed apart in the claims and still counts as no win for ``matrix_holds``."""
    stock = {"equal": [run(best)] * 5}
    perfect = cell([run(1.0)] * 5, stock, ["equal"], "equal", memory_bound=True, scale=10)
    assert perfect["win_reachable"] is reachable and perfect["win"] is reachable
    c = claims({"w": {"10": perfect}})
    assert c["win_out_of_reach"] == ([] if reachable else ["w@10"])
    assert c["matrix_holds"] is reachable


def test_cell_refuses_rounds_of_different_lengths():
    with pytest.raises(ValueError, match="one run per round"):
        cell([run(1)] * 2, {"equal": [run(1)]}, ["equal"], "equal", False, 2)


def test_schedule_is_deterministic_and_phased():
    w = WORKLOADS["bursty2"]
    s = schedule(w)
    assert s == schedule(w)
    first = [m for t, m, _ in s if t == 0.0]
    assert first == [w.models[0]] * w.burst
    assert {m for t, m, _ in s if t >= w.phase_s} == {w.models[1]}
    steady = schedule(WORKLOADS["steady2"])
    assert {m for t, m, _ in steady if t < WORKLOADS["steady2"].phase_s} == set(WORKLOADS["steady2"].models)


def test_memory_plan_and_splits_count_the_same_bytes():
    w = WORKLOADS["bursty2"]
    sizes = {"tiny-a": ModelSize(1000, 10, 50, 7), "tiny-c": ModelSize(2000, 40, 50, 9)}
    plan = memory_plan(w, sizes)
    need_a = 1000 + w.concurrency * (50 + w.new_tokens) * 10
    need_c = 2000 + w.concurrency * (50 + w.new_tokens) * 40
    assert plan["budget_bytes"] == int(w.budget_models * (need_a + need_c) / 2)
    assert plan["memx_device_bytes"] == plan["budget_bytes"] + 16
    splits = candidate_splits(w, plan)
    assert [s.name for s in splits][0] == "equal"
    for s in splits:
        assert sum(s.fractions.values()) == pytest.approx(1.0)
        toks = s.max_total_tokens(plan)
        for name, f in s.fractions.items():  # the share pays the weights and the KV, nothing else
            m = plan["models"][name]
            assert m["weight_bytes"] + toks[name] * m["kv_bytes_per_token"] <= f * plan["budget_bytes"]
    starved = Split("starve", {"tiny-a": 0.999, "tiny-c": 0.001})
    assert not starved.feasible(plan, w.new_tokens)
    assert w.memory_bound and not WORKLOADS["steady2"].memory_bound


def test_the_driver_refuses_more_servers_than_memory_holds_naming_the_flag(tmp_path):
    from benchmark.e2e import matrix

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    4000000 kB\n")
    matrix.check_memory(3, meminfo)  # 3 x 1.3 GB < 4.1 GB
    with pytest.raises(SystemExit, match="--splits: 12 servers need"):
        matrix.check_memory(12, meminfo)
