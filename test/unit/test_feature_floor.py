"""``benchmark/e2e/feature_floor.py``: its setups' command lines and its argument errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

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


def test_bad_arguments_name_the_flag(capsys):
    for argv in (["--setups", "plugin,ekv"], ["--setups", "stock,fast"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            F.parse_args(argv)
    err = capsys.readouterr().err
    assert "--setups: needs stock" in err and "'fast' is not one of" in err and "--rounds" in err
    assert F.parse_args(["--setups", "stock,ekv-hb"]).setups == ["stock", "ekv-hb"]
