"""``benchmark/e2e/feature_floor.py``: its setups' command lines and its argument errors."""

from __future__ import annotations

import json
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
    assert "in iterations with work, i.e. on the requests' path (median over the rounds): `ekv` premap 150." in text
    assert "`ekv` / `stock` per round: TTFT p50 ms 1.150 [1.100, 1.200], below 1 in 0 of 2; TPOT p50 ms" in text


def test_solo_runs_name_the_setup_of_a_failed_request(monkeypatch):
    from benchmark.e2e import load

    answers = iter([{"ttft": 0.02, "tpot": 0.003}, {"error": "HTTP 500"}])
    monkeypatch.setattr(load, "stream_one", lambda url, text, n: next(answers))
    with pytest.raises(RuntimeError, match="floor-ekv at http://x: HTTP 500"):
        load.solo_runs("http://x", ["a", "b"], 4, "floor-ekv")


def test_fresh_servers_start_every_setup_anew_each_round_in_the_rotated_order(tmp_path, monkeypatch):
    from sglang_memx.models import tiny

    started, stopped, pools, measured = [], [], [], []
    monkeypatch.setattr(F, "start_all", lambda servers: started.append([s.name for s in servers]))
    monkeypatch.setattr(F, "stop_all", lambda servers: stopped.append([s.name for s in servers]))
    monkeypatch.setattr(F, "stop_pools", lambda setups, pool_dir: pools.append(list(setups)))
    one = {"ttft_ms": 20.0, "tpot_ms": 3.0, "sched_cpu_ms_per_request": 100.0}
    monkeypatch.setattr(F, "measure", lambda srv, *a: measured.append(srv.name) or dict(one))
    monkeypatch.setattr(tiny, "tiny_model", lambda spec, root: tmp_path)
    out = tmp_path / "floor.json"
    assert F.main(["--setups", "stock,ekv,ekv-pool", "--rounds", "4", "--fresh-servers", "--out", str(out)]) == 0
    orders = [["stock", "ekv", "ekv-pool"], ["ekv", "ekv-pool", "stock"], ["ekv-pool", "stock", "ekv"]]
    orders.append(orders[0])
    names = [[f"floor-{s}" for s in order] for order in orders]
    assert started == stopped == names and pools == orders  # every round's servers and arbiters ended
    assert measured == [n for order in names for n in order]
    assert [r["order"] for r in json.loads(out.read_text())["rounds"]] == orders


def test_a_base_setup_runs_the_same_flags_on_the_base_checkouts_code(tmp_path):
    base = tmp_path / "earlier"
    new, old = F.server("ekv-pool", tmp_path, tmp_path), F.server("ekv-pool@base", tmp_path, tmp_path, base)
    assert "PYTHONPATH" not in new.env or str(base) not in new.env["PYTHONPATH"]
    assert old.env["PYTHONPATH"] == f"{base}/python:{base}" and not old.stock
    assert old.env["PYTHONSAFEPATH"] == "1"  # no working directory ahead of the base checkout
    # the same flags, on a pool of its own (its arbiter runs the base code too)
    assert F.flags_of("ekv-pool@base") == [
        "--memx-elastic-kv",
        "--memx-pool",
        "floor-base",
        "--memx-pool-budget-gb",
        "0.25",
    ]
    assert F.flags_of("ekv@base") == F.FEATURES["ekv"] and F.flags_of("ekv-pool") == F.FEATURES["ekv-pool"]


def test_base_arguments_are_checked(tmp_path, capsys):
    (tmp_path / "python" / "sglang_memx").mkdir(parents=True)
    for argv in (["--setups", "stock,ekv@base"], ["--setups", "stock,ekv", "--base", str(tmp_path)],
                 ["--setups", "stock,stock@base", "--base", str(tmp_path)],
                 ["--setups", "stock,ekv@base", "--base", str(tmp_path / "python")]):  # fmt: skip
        with pytest.raises(SystemExit):
            F.parse_args(argv)
    err = capsys.readouterr().err
    assert err.count("--base: give it with a setup named SETUP@base") == 2
    assert "'stock@base' is not one of" in err and "is not a checkout of sglang-memx" in err
    args = F.parse_args(["--setups", "stock,ekv,ekv@base", "--base", str(tmp_path)])
    assert args.base == tmp_path and args.setups == ["stock", "ekv", "ekv@base"]
