"""``benchmark/e2e/feature_floor.py``: its setups' command lines and its argument errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import feature_floor_table as T  # noqa: E402
from benchmark.e2e import feature_floor as F  # noqa: E402


def test_each_setup_differs_from_stock_only_by_its_features(tmp_path):
    stock, pool = F.server("stock", tmp_path, tmp_path), F.server("ekv-pool", tmp_path, tmp_path)
    assert stock.stock and not pool.stock
    extra = pool.args[len(stock.args) :]
    assert extra == [*F.FEATURES["ekv-pool"], "--memx-pool-dir", str(tmp_path)]
    assert pool.args[: len(stock.args)][:3] == stock.args[:3]
    for s in (stock, pool, F.server("plugin", tmp_path, tmp_path)):
        assert s.env["SGLANG_CPU_OMP_THREADS_BIND"] == F.CORE and s.env["OMP_NUM_THREADS"] == "1"
    assert not F.server("plugin", tmp_path, tmp_path).stock  # the plugin loaded, no feature flag


def test_the_shared_pools_arbiters_are_stopped(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(F.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    F.stop_pools(["stock", "ekv", "ekv-pool"], tmp_path)
    assert [c[-4:] for c in calls] == [["stop", "floor", "--pool-dir", str(tmp_path)]]


def test_bad_arguments_name_the_flag(capsys):
    for argv in (["--setups", "plugin,ekv"], ["--setups", "stock,fast"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            F.parse_args(argv)
    err = capsys.readouterr().err
    assert "--setups: needs stock" in err and "'fast' is not one of" in err and "--rounds" in err
    assert F.parse_args(["--setups", "stock,ekv-hb"]).setups == ["stock", "ekv-hb"]


def test_docs_blocks_match_the_json():
    assert T.main(["--check"]) == 0, "run: python -m benchmark.feature_floor_table"


def test_a_block_has_every_setup_its_ratios_and_the_largest_steps():
    def run(ttft, steps=None):
        return {"ttft_ms": ttft, "tpot_ms": 3.0, "sched_cpu_ms_per_request": 100.0, "steps_us_per_request": steps or {}}

    rounds = [{"stock": run(20.0), "ekv": dict(run(22.0, {"premap": 800.0, "deflate": 900.0}),
                                               busy_steps_us_per_request={"premap": 300.0})},
              {"stock": run(20.0), "ekv": run(24.0, {"premap": 700.0})}]  # fmt: skip
    ratio = {"median": 1.15, "min": 1.1, "max": 1.2}
    doc = {"command": "feature_floor.py --out /tmp/x.json --rounds 2", "when": "T", "model": "tiny-a",
           "setups": {"stock": [], "ekv": ["--memx-elastic-kv"]}, "rounds": rounds,
           "ratios": {f"ekv/stock {k}": ratio for k in ("ttft_ms", "tpot_ms", "sched_cpu_ms_per_request")}}  # fmt: skip
    text = T.render("s", doc, (("ekv", "stock"),))
    assert "`feature_floor.py --rounds 2`" in text and "/tmp/x.json" not in text
    assert "| `ekv` | `--memx-elastic-kv` | 23.00 [22.00, 24.00] | 1.150 [1.100, 1.200] |" in text
    assert "| `stock` | – | 20.00 [20.00, 20.00] |  |" in text
    assert "`ekv` premap 750, deflate 450." in text  # a round without a step counts it as 0
    assert "in iterations with work (on the requests' path) (median over the rounds): `ekv` premap 150." in text
    assert "`ekv` / `stock` per round: TTFT p50 ms 1.150 [1.100, 1.200], below 1 in 0 of 2; TPOT p50 ms" in text


def test_solo_runs_name_the_setup_of_a_failed_request(monkeypatch):
    from benchmark.e2e import load

    answers = iter([{"ttft": 0.02, "tpot": 0.003}, {"error": "HTTP 500"}])
    monkeypatch.setattr(load, "stream_one", lambda url, text, n: next(answers))
    with pytest.raises(RuntimeError, match="floor-ekv at http://x: HTTP 500"):
        load.solo_runs("http://x", ["a", "b"], 4, "floor-ekv")
