"""Random ``--memx-*`` command lines: a valid config or an error naming one of the flags involved.

Hypothesis draws a subset of ``MEMX_FLAGS`` with values, good and bad (negative, zero, NaN,
inf, 1e400, words where numbers go, empty, odd paths and names), in random order, sometimes
a flag twice, with upstream's ``--disable-radix-cache`` / CUDA-graph situation. Through
memx's own argparse group: argparse refuses a value its ``type`` cannot read (exit 2, the
option on stderr), else ``MemxConfig.from_namespace`` + ``check_server_args`` give a config
or ``MemxConfigError`` whose ``flag`` is a memx option that was given, or one the message
says is missing next to one given ("must be given together with", "is required with");
anything else is a bug. ``MemxConfig.from_dict`` (the config that rides to every SGLang
process) gets values of any JSON type and must answer the same way.

Then a few generated bad command lines go through upstream's real parser as the plugin
patches it (``ServerArgs.add_cli_args`` + ``hooks.server_args.after_add_cli_args``): exit
status 2 and ``argument <flag>:`` on stderr, the same flag the direct check named.

``MEMX_FUZZ_EXAMPLES`` (default 25) x 4 command lines per test; see docs/reliability.md "Bad input".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_memx.config import MEMX_FLAGS, MemxConfig, MemxConfigError, add_memx_arguments

EXAMPLES = int(os.environ.get("MEMX_FUZZ_EXAMPLES", "25")) * 4
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
OPTIONS = {f.option: f for f in MEMX_FLAGS}

NUMBERS = ["0", "-1", "1", "2", "4", "64", "0.5", "1.5", "1e-9", "nan", "inf", "-inf", "1e400", "3", "1048576",
           "2097152", "99999999999999999999", "0x10", "1_000", " 2", "abc", ""]  # fmt: skip
WORDS = ["off", "remap", "static", "donate", "borrow", "both", "lend", "p1", "pool.a-b", "-x", ".hidden", "a" * 65,
         "/memx/status", "/memx/x", "/health", "/memx/metrics", "/", "memx", "/a b", "/a?b", "/tmp/d", " ", "",
         "/\x00", "\u00e9", "/tmp/profile.json"]  # fmt: skip


def value_for(flag) -> st.SearchStrategy[str]:
    if flag.type in (int, float):
        return st.sampled_from(NUMBERS) | st.floats(allow_nan=True).map(repr) | st.integers().map(str)
    return st.sampled_from(WORDS) | st.text(max_size=12)


@st.composite
def command_lines(draw) -> list[str]:
    flags = draw(st.lists(st.sampled_from(MEMX_FLAGS), max_size=7))
    if draw(st.booleans()):  # a base that makes the dependent flags reachable
        flags = [OPTIONS["--memx-elastic-kv"], OPTIONS["--memx-pool"], *flags]
    argv = []
    for flag in flags:
        if flag.action:
            argv.append(flag.option)
        elif flag.option == "--memx-pool" and draw(st.booleans()):
            argv += [flag.option, "p1"]
        else:
            argv += [flag.option, draw(value_for(flag))]
    return argv


def given_options(argv: list[str]) -> set[str]:
    return {a for a in argv if a in OPTIONS}


def memx_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_memx_arguments(parser)
    return parser


def check_error(err: MemxConfigError, given: set[str]) -> None:
    """The error is a ``MemxConfigError`` naming a flag involved."""
    assert type(err) is MemxConfigError and err.flag in OPTIONS, repr(err)
    assert str(err).startswith(f"argument {err.flag}: "), str(err)
    involved = err.flag in given or (
        ("given together with" in str(err) or "is required with" in str(err)) and any(g in str(err) for g in given)
    )
    assert involved, (err.flag, sorted(given), str(err))


def outcome(argv: list[str], radix_off: bool, graphs: bool):
    """The config, or the MemxConfigError (checked), or "argparse" when argparse refused a value."""
    parser = memx_parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            ns = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        text = str(exc) + stderr.getvalue()
        assert any(o in text for o in given_options(argv)), text  # argparse names the option it could not read
        return "argparse"
    try:
        config = MemxConfig.from_namespace(ns)
        config.check_server_args(radix_off, graphs)
        return config
    except MemxConfigError as err:
        check_error(err, given_options(argv))
        return err


@FUZZ
@given(argv=command_lines(), radix_off=st.booleans(), graphs=st.booleans())
def test_random_memx_command_lines_are_valid_or_name_a_flag(argv, radix_off, graphs):
    got = outcome(argv, radix_off, graphs)
    if isinstance(got, MemxConfig):
        assert MemxConfig.from_dict(got.to_dict()) == got  # a valid config survives the trip to subprocesses


ANY = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.lists(st.integers(), max_size=2)
)
FIELD_VALUES = {f.dest: ANY | st.just(f.default) for f in MEMX_FLAGS}


@FUZZ
@given(data=st.fixed_dictionaries({}, optional=FIELD_VALUES))
def test_from_dict_with_values_of_any_type_is_valid_or_names_a_flag(data):
    try:
        config = MemxConfig.from_dict(dict(data))
    except MemxConfigError as err:
        given = {f.option for f in MEMX_FLAGS if f.dest in data}
        check_error(err, given)
    else:
        assert isinstance(config, MemxConfig)


# --------------------------------------------------------- through upstream's parser as the plugin patches it


@pytest.fixture(scope="module")
def server_parser():
    server_args = pytest.importorskip("sglang.srt.server_args")
    from sglang_memx.hooks.server_args import after_add_cli_args

    def make():
        parser = argparse.ArgumentParser()
        after_add_cli_args(server_args.ServerArgs.add_cli_args(parser), parser)
        return parser

    return make


@settings(FUZZ, max_examples=max(5, EXAMPLES // 10))
@given(argv=command_lines())
def test_bad_combinations_exit_2_naming_the_flag_on_upstreams_parser(server_parser, argv):
    expected = outcome(argv, radix_off=False, graphs=False)
    if not isinstance(expected, MemxConfigError):
        return  # argparse's own refusals and valid lines are covered above
    parser = server_parser()
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(stderr):
        parser.parse_args(["--model-path", "m", "--device", "cpu", *argv])
    assert exit_.value.code == 2
    assert f"argument {expected.flag}: " in stderr.getvalue(), stderr.getvalue()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--memx-chunk-kb", "nan"], "--memx-chunk-kb"),  # argparse: not an int
        (["--memx-elastic-kv", "--memx-pool-budget-gb", "inf"], "--memx-pool-budget-gb"),
        (["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--memx-ttft-slo-ms", "5"], "--memx-tpot-slo-ms"),
        (["--memx-disable", "--memx-weights", "off", "--memx-status-path", "/x"], "--memx-disable"),
    ],
)
def test_examples_name_the_flag(argv, flag):
    got = outcome(argv, radix_off=False, graphs=False)
    assert got == "argparse" if flag == "--memx-chunk-kb" else got.flag == flag
