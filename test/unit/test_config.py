"""--memx-* flags: parsing, validation and the config that travels to subprocesses."""

import argparse
import pickle

import pytest

from sglang_memx.config import (GROUP_TITLE, MEMX_FLAGS, MemxConfig, MemxConfigError,
                                add_memx_arguments)


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    return MemxConfig.from_namespace(parser.parse_args(argv))


def test_defaults():
    cfg = _parse([])
    assert cfg == MemxConfig()
    assert cfg.features == {"status_endpoint": True}
    assert cfg.status_path == "/memx/status"


def test_every_flag_is_in_one_group_once():
    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    add_memx_arguments(parser)  # idempotent
    groups = [g for g in parser._action_groups if g.title == GROUP_TITLE]
    assert len(groups) == 1
    options = [o for a in groups[0]._group_actions for o in a.option_strings]
    assert options == [f.option for f in MEMX_FLAGS]
    assert all(o.startswith("--memx-") for o in options)


@pytest.mark.parametrize("path, fragment", [
    ("memx", "absolute URL path"),
    ("/", "absolute URL path"),
    ("/a b", "must not contain"),
    ("/x?y", "must not contain"),
    ("/generate", "upstream SGLang route"),
    ("/v1/chat/completions", "upstream SGLang route"),
    ("/health/", "upstream SGLang route"),
])
def test_bad_status_path_names_the_flag(path, fragment):
    with pytest.raises(MemxConfigError) as err:
        _parse(["--memx-status-path", path])
    assert err.value.flag == "--memx-status-path"
    assert "--memx-status-path" in str(err.value) and fragment in str(err.value)


def test_disable_contradicts_other_memx_flags():
    with pytest.raises(MemxConfigError) as err:
        _parse(["--memx-disable", "--memx-status-path", "/other"])
    assert err.value.flag == "--memx-disable"
    assert "--memx-status-path" in str(err.value)


def test_disable_alone_turns_every_feature_off():
    cfg = _parse(["--memx-disable"])
    assert cfg.disabled and not any(cfg.features.values())


def test_round_trip_through_dict_and_pickle():
    cfg = _parse(["--memx-status-path", "/ops/memx"])
    assert MemxConfig.from_dict(cfg.to_dict()) == cfg
    assert pickle.loads(pickle.dumps(cfg.to_dict())) == cfg.to_dict()


def test_from_dict_rejects_unknown_and_invalid_settings():
    with pytest.raises(MemxConfigError, match="--memx-bogus"):
        MemxConfig.from_dict({"bogus": 1})
    with pytest.raises(MemxConfigError, match="--memx-status-path"):
        MemxConfig.from_dict({"status_path": "nope"})
