"""Simulator: workload generators match their documented parameters."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.sim.core.workload import (  # noqa: E402
    LENGTH_PRESETS,
    ArrivalSpec,
    LengthDist,
    SessionSpec,
    WorkloadSpec,
    arrival_times,
    generate,
    sample_lengths,
)


@pytest.mark.parametrize(
    "preset,mean",
    [("sharegpt_input", 161.31), ("sharegpt_output", 337.99), ("alpaca_input", 19.31), ("alpaca_output", 58.45)],
)
def test_length_presets_have_the_published_means(preset, mean):
    x = sample_lengths(LENGTH_PRESETS[preset], 200_000, np.random.default_rng(1))
    assert x.mean() == pytest.approx(mean, rel=0.03)
    assert x.min() >= LENGTH_PRESETS[preset].min and x.max() <= LENGTH_PRESETS[preset].max


def test_sharegpt_is_longer_than_alpaca_like_the_paper_says():
    rng = np.random.default_rng(0)
    s = sample_lengths(LENGTH_PRESETS["sharegpt_input"], 50_000, rng).mean()
    a = sample_lengths(LENGTH_PRESETS["alpaca_input"], 50_000, rng).mean()
    assert 7 < s / a < 10  # vLLM paper: 8.4x longer inputs


def test_fixed_and_custom_lognormal():
    rng = np.random.default_rng(0)
    assert set(sample_lengths(LengthDist("fixed", value=2048), 10, rng)) == {2048}
    x = sample_lengths(LengthDist("lognormal", mean=500, sigma=0.5), 100_000, rng)
    assert x.mean() == pytest.approx(500, rel=0.02)
    assert np.median(x) == pytest.approx(500 * np.exp(-0.125), rel=0.03)


def test_poisson_rate_and_cv():
    ts = arrival_times(ArrivalSpec("poisson", rate=20.0), 0, 2000, np.random.default_rng(2))
    gaps = np.diff(ts)
    assert len(ts) / 2000 == pytest.approx(20.0, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)
    assert np.all(np.diff(ts) >= 0) and ts.min() >= 0 and ts.max() < 2000


def test_gamma_is_bursty_with_requested_cv_and_rate():
    ts = arrival_times(ArrivalSpec("gamma", rate=10.0, cv=2.0), 0, 5000, np.random.default_rng(3))
    gaps = np.diff(ts)
    assert len(ts) / 5000 == pytest.approx(10.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)


def test_onoff_mean_rate_is_on_fraction_of_rate():
    ts = arrival_times(ArrivalSpec("onoff", rate=10.0, on_s=30, off_s=90), 0, 40_000, np.random.default_rng(4))
    assert len(ts) / 40_000 == pytest.approx(10.0 * 30 / 120, rel=0.1)


def test_sessions_share_a_growing_prefix_and_idle_windows_are_empty():
    spec = WorkloadSpec(
        "m",
        ArrivalSpec("poisson", rate=2.0),
        LENGTH_PRESETS["sharegpt_input"],
        LENGTH_PRESETS["sharegpt_output"],
        SessionSpec(turns_mean=4, think_s=5),
        system_prompt_tokens=64,
        idle=((100.0, 200.0),),
    )
    wl = generate([spec], {"m": 0}, 600, seed=7)
    firsts = [wl.requests[i] for i in wl.initial]
    assert not any(100 <= r.arrival < 200 for r in firsts)
    follow = 0
    for r in wl.requests:
        assert r.rid == wl.requests.index(r) if r.rid < 5 else True
        if r.next_turn >= 0:
            n = wl.requests[r.next_turn]
            assert n.lineage == r.lineage and n.turn == r.turn + 1
            assert n.prompt_len > r.prompt_len + r.output_len  # history + a new input
            assert n.block_key(0, 16) == r.block_key(0, 16)
            follow += 1
    turns = len(wl.requests) / len(wl.initial)
    assert follow > 0 and 2.5 < turns < 5.0
    assert all(r.prompt_len >= 64 + 4 for r in firsts)


def test_generation_is_seeded_and_streams_are_independent():
    a = WorkloadSpec("a", ArrivalSpec("poisson", rate=5.0))
    b = WorkloadSpec("b", ArrivalSpec("gamma", rate=5.0))
    w1 = generate([a], {"a": 0}, 100, seed=3)
    w2 = generate([a, b], {"a": 0, "b": 1}, 100, seed=3)
    w3 = generate([a], {"a": 0}, 100, seed=4)
    sig = lambda w: [(r.arrival, r.prompt_len, r.output_len) for r in w.requests if r.model == 0]  # noqa: E731
    assert sig(w1) == sig(w2)  # adding workload b does not change a
    assert sig(w1) != sig(w3)
