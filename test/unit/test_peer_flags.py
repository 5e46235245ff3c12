"""--memx-peer-kv / --memx-peer-donate-max-gb: parsed and validated (errors name the flag); the
upstream flags the tier cannot serve are refused (docs/peer-kv.md)."""

import argparse

import pytest

from sglang_memx.config import MemxConfig, MemxConfigError, add_memx_arguments
from sglang_memx.peer.checks import check_peer_kv

POOL = ["--memx-elastic-kv", "--memx-pool", "p1"]


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    return MemxConfig.from_namespace(parser.parse_args(argv))


def test_default_is_off():
    cfg = _parse([])
    assert cfg.peer_kv == "off" and cfg.peer_donate_max_gb is None
    assert cfg.features["peer_kv"] is False
    assert _parse(["--memx-peer-kv", "off"]) == cfg


@pytest.mark.parametrize(
    ("argv", "flag", "fragment"),
    [
        (["--memx-peer-kv", "lend"], "--memx-peer-kv", "must be one of off, donate, borrow, both"),
        (["--memx-peer-kv", "donate"], "--memx-peer-kv", "needs --memx-pool"),
        (["--memx-peer-kv", "both", "--memx-elastic-kv"], "--memx-peer-kv", "needs --memx-pool"),
        (POOL + ["--memx-peer-donate-max-gb", "2"], "--memx-peer-donate-max-gb", "needs --memx-peer-kv donate"),
        (POOL + ["--memx-peer-kv", "borrow", "--memx-peer-donate-max-gb", "2"], "--memx-peer-donate-max-gb",
         "needs --memx-peer-kv donate"),
        (POOL + ["--memx-peer-kv", "donate", "--memx-peer-donate-max-gb", "0"], "--memx-peer-donate-max-gb",
         "positive number of GB"),
        (POOL + ["--memx-peer-kv", "donate", "--memx-peer-donate-max-gb", "nan"], "--memx-peer-donate-max-gb",
         "positive number of GB"),
        (["--memx-disable", "--memx-peer-kv", "off", "--memx-status-path", "/x"], "--memx-disable", "contradicts"),
        (POOL + ["--memx-peer-layer-stream"], "--memx-peer-layer-stream", "needs --memx-peer-kv borrow"),
        (POOL + ["--memx-peer-kv", "both", "--memx-peer-layer-stream"], "--memx-peer-layer-stream",
         "needs --memx-peer-kv borrow"),
        (POOL + ["--memx-peer-kv", "donate", "--memx-peer-layer-stream"], "--memx-peer-layer-stream",
         "needs --memx-peer-kv borrow"),
        (POOL + ["--memx-peer-kv", "borrow", "--memx-peer-layer-stream", "--memx-host-buffer-gb", "1"],
         "--memx-peer-layer-stream", "cannot run with --memx-host-buffer-gb"),
    ],
)  # fmt: skip
def test_bad_values_name_the_flag(argv, flag, fragment):
    with pytest.raises(MemxConfigError) as err:
        _parse(argv)
    assert err.value.flag == flag and fragment in str(err.value)


@pytest.mark.parametrize("mode", ["donate", "borrow", "both"])
def test_valid_modes_parse(mode):
    extra = ["--memx-peer-donate-max-gb", "1.5"] if mode != "borrow" else []
    cfg = _parse(POOL + ["--memx-peer-kv", mode] + extra)
    assert cfg.peer_kv == mode and cfg.features["peer_kv"] is True
    assert cfg.peer_donate_max_gb == (1.5 if extra else None)
    check_peer_kv(cfg, disable_radix_cache=False, hierarchical_cache=False, device="cpu")  # no error


@pytest.mark.parametrize(
    ("upstream", "fragment"),
    [
        ({"disable_radix_cache": True}, "needs the radix cache"),
        ({"hierarchical_cache": True}, "--enable-hierarchical-cache"),
        ({"device": "cuda"}, "CPU servers only"),
    ],
)
def test_upstream_flags_the_tier_cannot_serve_are_refused(upstream, fragment):
    cfg = MemxConfig(elastic_kv=True, pool="p1", peer_kv="borrow")
    kwargs = {"disable_radix_cache": False, "hierarchical_cache": False, "device": "cpu", **upstream}
    with pytest.raises(MemxConfigError) as err:
        check_peer_kv(cfg, **kwargs)
    assert err.value.flag == "--memx-peer-kv" and fragment in str(err.value)
    check_peer_kv(_parse(POOL), **kwargs)  # off: upstream's flags are none of its business


def test_the_server_parser_exits_2_naming_the_flag(capsys):
    from sglang_memx.hooks.server_args import _validating_parse_args

    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    parser.parse_args = _validating_parse_args(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--memx-peer-kv", "borrow"])
    assert exit_.value.code == 2
    assert "argument --memx-peer-kv: needs --memx-pool" in capsys.readouterr().err


def test_layer_stream_with_borrow():
    assert _parse([]).peer_layer_stream is False
    cfg = _parse(POOL + ["--memx-peer-kv", "borrow", "--memx-peer-layer-stream"])
    assert cfg.peer_layer_stream is True and cfg.features["peer_kv"] is True
    assert MemxConfig.from_dict(cfg.to_dict()) == cfg
