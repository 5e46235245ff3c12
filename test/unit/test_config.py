"""--memx-* flags: parsing, validation and the config that travels to subprocesses."""

import argparse
import pickle

import pytest

from sglang_memx.config import GROUP_TITLE, MEMX_FLAGS, MemxConfig, MemxConfigError, add_memx_arguments


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_memx_arguments(parser)
    return MemxConfig.from_namespace(parser.parse_args(argv))


def test_defaults():
    cfg = _parse([])
    assert cfg == MemxConfig()
    assert cfg.features == {
        "status_endpoint": True,
        "elastic_kv": False,
        "shared_pool": False,
        "host_buffer": False,
        "weights": False,
        "peer_kv": False,
    }
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


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("memx", "absolute URL path"),
        ("/", "absolute URL path"),
        ("/a b", "must not contain"),
        ("/x?y", "must not contain"),
        ("/generate", "upstream SGLang route"),
        ("/v1/chat/completions", "upstream SGLang route"),
        ("/health/", "upstream SGLang route"),
        ("/memx/metrics", "Prometheus endpoint"),
    ],
)
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


def test_elastic_kv_flags_parse_and_turn_features_on():
    cfg = _parse(
        [
            "--memx-elastic-kv",
            "--memx-pool",
            "gpu0",
            "--memx-pool-budget-gb",
            "1.5",
            "--memx-pool-dir",
            "/tmp/p",
            "--memx-chunk-kb",
            "2048",
        ]
    )
    assert (cfg.elastic_kv, cfg.pool, cfg.pool_budget_gb, cfg.pool_dir, cfg.chunk_kb) == (
        True,
        "gpu0",
        1.5,
        "/tmp/p",
        2048,
    )
    assert cfg.features == {
        "status_endpoint": True,
        "elastic_kv": True,
        "shared_pool": True,
        "host_buffer": False,
        "weights": False,
        "peer_kv": False,
    }
    assert MemxConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "argv, flag, fragment",
    [
        (["--memx-pool", "gpu0"], "--memx-pool", "needs --memx-elastic-kv"),
        (["--memx-pool-budget-gb", "2"], "--memx-pool-budget-gb", "needs --memx-elastic-kv"),
        (["--memx-pool-dir", "/tmp/x"], "--memx-pool-dir", "needs --memx-elastic-kv"),
        (["--memx-chunk-kb", "8"], "--memx-chunk-kb", "needs --memx-elastic-kv"),
        (["--memx-torch-activations"], "--memx-torch-activations", "needs --memx-elastic-kv"),
        (["--memx-elastic-kv", "--memx-pool", "bad name"], "--memx-pool", "letters, digits"),
        (["--memx-elastic-kv", "--memx-pool", "../up"], "--memx-pool", "letters, digits"),
        (["--memx-elastic-kv", "--memx-pool-budget-gb", "0"], "--memx-pool-budget-gb", "positive"),
        (["--memx-elastic-kv", "--memx-pool-budget-gb", "nan"], "--memx-pool-budget-gb", "positive"),
        (["--memx-elastic-kv", "--memx-chunk-kb", "6"], "--memx-chunk-kb", "power of two"),
        (["--memx-elastic-kv", "--memx-chunk-kb", "2"], "--memx-chunk-kb", "power of two"),
        (["--memx-disable", "--memx-elastic-kv"], "--memx-disable", "--memx-elastic-kv"),
        (["--memx-host-buffer-gb", "1"], "--memx-host-buffer-gb", "needs --memx-elastic-kv"),
        (["--memx-elastic-kv", "--memx-host-buffer-gb", "-1"], "--memx-host-buffer-gb", "positive"),
        (
            ["--memx-elastic-kv", "--memx-ttft-slo-ms", "500", "--memx-tpot-slo-ms", "50"],
            "--memx-ttft-slo-ms",
            "needs --memx-host-buffer-gb",
        ),
        (
            ["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--memx-ttft-slo-ms", "500"],
            "--memx-tpot-slo-ms",
            "together with --memx-ttft-slo-ms",
        ),
        (
            ["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--memx-ttft-slo-ms", "0", "--memx-tpot-slo-ms", "5"],
            "--memx-ttft-slo-ms",
            "positive",
        ),
    ],
)
def test_bad_elastic_flags_name_the_flag(argv, flag, fragment):
    with pytest.raises(MemxConfigError) as err:
        _parse(argv)
    assert err.value.flag == flag
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "argv,flag,fragment",
    [
        (["--memx-tpot-slo-ms", "50"], "--memx-tpot-slo-ms", "needs --memx-elastic-kv"),
        (["--memx-elastic-kv", "--memx-tpot-slo-ms", "0"], "--memx-tpot-slo-ms", "positive"),
        (["--memx-elastic-kv", "--memx-tpot-slo-ms", "-3"], "--memx-tpot-slo-ms", "positive"),
        (["--memx-elastic-kv", "--memx-tpot-slo-ms", "inf"], "--memx-tpot-slo-ms", "positive"),
        (["--memx-elastic-kv", "--memx-ttft-slo-ms", "500"], "--memx-ttft-slo-ms", "needs --memx-host-buffer-gb"),
        (
            ["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--memx-tpot-slo-ms", "50"],
            "--memx-ttft-slo-ms",
            "together with --memx-tpot-slo-ms",
        ),
    ],
)
def test_bad_governor_flags_name_the_flag(argv, flag, fragment):
    with pytest.raises(MemxConfigError) as err:
        _parse(argv)
    assert err.value.flag == flag
    assert fragment in str(err.value)


def test_the_governor_flag_needs_elastic_kv_and_runs_without_an_slo():
    with pytest.raises(MemxConfigError) as err:
        _parse(["--memx-governor"])
    assert err.value.flag == "--memx-governor" and "needs --memx-elastic-kv" in str(err.value)
    cfg = _parse(["--memx-elastic-kv", "--memx-governor"])
    assert cfg.governed and cfg.tpot_slo_ms is None
    assert _parse(["--memx-elastic-kv", "--memx-tpot-slo-ms", "80"]).governed
    assert not _parse(["--memx-elastic-kv"]).governed


def test_tpot_slo_alone_with_elastic_kv_is_the_governor():
    cfg = _parse(["--memx-elastic-kv", "--memx-tpot-slo-ms", "80"])
    assert (cfg.tpot_slo_ms, cfg.ttft_slo_ms, cfg.host_buffer_gb) == (80.0, None, None)
    assert cfg.features["host_buffer"] is False and cfg.features["elastic_kv"] is True


def test_host_buffer_flags_parse():
    cfg = _parse(
        ["--memx-elastic-kv", "--memx-host-buffer-gb", "0.5", "--memx-ttft-slo-ms", "800", "--memx-tpot-slo-ms", "60"]
    )
    assert (cfg.host_buffer_gb, cfg.ttft_slo_ms, cfg.tpot_slo_ms) == (0.5, 800.0, 60.0)
    assert cfg.features["host_buffer"] is True


BUDGET = ["--memx-elastic-kv", "--memx-pool-budget-gb", "1"]


@pytest.mark.parametrize(
    "argv,flag,words",
    [
        (BUDGET + ["--memx-weights", "swap"], "--memx-weights", "one of off, remap, static"),
        (["--memx-weights", "remap"], "--memx-weights", "needs --memx-elastic-kv"),
        (["--memx-elastic-kv", "--memx-weights", "remap"], "--memx-weights", "physical budget"),
        (BUDGET + ["--memx-weights", "static"], "--memx-weights-streamed", "required"),
        (BUDGET + ["--memx-weights", "static", "--memx-weights-streamed", "1.5"], "--memx-weights-streamed", "0 and 1"),
        (BUDGET + ["--memx-weights", "remap", "--memx-weights-streamed", "0.5"], "--memx-weights-streamed", "static"),
        (BUDGET + ["--memx-weights", "remap", "--memx-prefetch-depth", "0"], "--memx-prefetch-depth", "positive"),
        (BUDGET + ["--memx-weights", "remap", "--memx-tbt-slo-ms", "-3"], "--memx-tbt-slo-ms", "positive"),
        (BUDGET + ["--memx-weights", "static", "--memx-weights-streamed", "0.5", "--memx-tbt-slo-ms", "50"],
         "--memx-tbt-slo-ms", "only applies to --memx-weights remap"),
        (BUDGET + ["--memx-weights", "static", "--memx-weights-streamed", "0.5", "--memx-weights-profile", "p.json"],
         "--memx-weights-profile", "only applies"),
        (["--memx-tbt-slo-ms", "50"], "--memx-tbt-slo-ms", "needs --memx-weights"),
        (["--memx-weights-idle-after-s", "5"], "--memx-weights-idle-after-s", "needs --memx-weights remap"),
    ],
)  # fmt: skip
def test_weights_flags_refused_with_the_flag_named(argv, flag, words):
    with pytest.raises(MemxConfigError, match=flag) as err:
        _parse(argv)
    assert err.value.flag == flag and words in str(err.value)


def test_weights_flags_parse():
    cfg = _parse(BUDGET + ["--memx-weights", "remap", "--memx-tbt-slo-ms", "80", "--memx-prefetch-depth", "2",
                           "--memx-weights-idle-after-s", "5"])  # fmt: skip
    assert (cfg.weights, cfg.tbt_slo_ms, cfg.prefetch_depth, cfg.weights_idle_after_s) == ("remap", 80.0, 2, 5.0)
    assert cfg.features["weights"] is True
    cfg = _parse(["--memx-elastic-kv", "--memx-pool", "p", "--memx-weights", "static", "--memx-weights-streamed", "1"])
    assert cfg.weights_streamed == 1.0 and pickle.loads(pickle.dumps(cfg)) == cfg


def test_weights_refused_when_cuda_graphs_may_be_captured():
    cfg = _parse(BUDGET + ["--memx-weights", "remap"])
    with pytest.raises(MemxConfigError) as err:
        cfg.check_server_args(disable_radix_cache=False, cuda_graphs=True)
    assert err.value.flag == "--memx-weights" and "--cuda-graph-backend-decode disabled" in str(err.value)
    cfg.check_server_args(disable_radix_cache=False, cuda_graphs=False)
    _parse(BUDGET).check_server_args(disable_radix_cache=False, cuda_graphs=True)  # no weights: graphs are fine


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--memx-sleep-after-s", "5"], "needs --memx-weights remap"),
        (BUDGET + ["--memx-weights", "remap", "--memx-sleep-after-s", "5"], "needs --memx-pool"),
        (["--memx-elastic-kv", "--memx-pool", "p", "--memx-weights", "remap", "--memx-sleep-after-s", "0"], "positive"),
        (["--memx-elastic-kv", "--memx-pool", "p", "--memx-weights", "static", "--memx-weights-streamed", "0.5",
          "--memx-sleep-after-s", "5"], "only applies to --memx-weights remap"),
    ],
)  # fmt: skip
def test_sleep_flag_refused_with_the_flag_named(argv, words):
    with pytest.raises(MemxConfigError) as err:
        _parse(argv)
    assert err.value.flag == "--memx-sleep-after-s" and words in str(err.value)


def test_sleep_flag_parses():
    cfg = _parse(["--memx-elastic-kv", "--memx-pool", "p", "--memx-weights", "remap", "--memx-sleep-after-s", "60"])
    assert cfg.sleep_after_s == 60.0


# every way an SLO flag can be wrong, each naming the flag (the host buffer makes the TTFT one legal)
SLO_FLAGS = {
    "--memx-tpot-slo-ms": ["--memx-elastic-kv"],
    "--memx-ttft-slo-ms": ["--memx-elastic-kv", "--memx-host-buffer-gb", "1", "--memx-tpot-slo-ms", "50"],
}


@pytest.mark.parametrize("flag", sorted(SLO_FLAGS))
@pytest.mark.parametrize("bad", ["0", "-0", "-3", "nan", "inf", "-inf", "1e999"])
def test_bad_slo_numbers_name_the_flag(flag, bad):
    with pytest.raises(MemxConfigError) as err:
        _parse(SLO_FLAGS[flag] + [f"{flag}={bad}"])  # "=": argparse takes a bare "-inf" for an option
    assert err.value.flag == flag and "must be a positive number" in str(err.value)


@pytest.mark.parametrize("flag", sorted(SLO_FLAGS))
@pytest.mark.parametrize("bad", ["fast", "", "50ms", "1,5"])
def test_slo_flags_that_are_not_numbers_name_the_flag(flag, bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(SLO_FLAGS[flag] + [flag, bad])
    assert exit_.value.code == 2 and f"argument {flag}: invalid float value" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["50", True, [50], 0, float("nan")])
def test_slo_values_set_without_the_parser_name_the_flag(bad):
    with pytest.raises(MemxConfigError) as err:
        MemxConfig(elastic_kv=True, tpot_slo_ms=bad).validate()
    assert err.value.flag == "--memx-tpot-slo-ms"


def test_the_tpot_slo_source_is_the_flag_unless_serve_names_its_field():
    from sglang_memx.config import TPOT_SLO_SOURCE_ENV, tpot_slo_source

    assert tpot_slo_source({}) == tpot_slo_source({TPOT_SLO_SOURCE_ENV: ""}) == "--memx-tpot-slo-ms"
    named = "models.yaml: models[2].tpot_slo_ms"
    assert tpot_slo_source({TPOT_SLO_SOURCE_ENV: named}) == named
    for bad in ("a\nb", "x" * 201, "tab\there"):
        with pytest.raises(MemxConfigError) as err:
            tpot_slo_source({TPOT_SLO_SOURCE_ENV: bad})
        assert err.value.flag == TPOT_SLO_SOURCE_ENV


def test_the_ttft_slo_source_follows_the_same_rules():
    from sglang_memx.config import TTFT_SLO_SOURCE_ENV, ttft_slo_source

    assert ttft_slo_source({}) == ttft_slo_source({TTFT_SLO_SOURCE_ENV: ""}) == "--memx-ttft-slo-ms"
    named = "models.yaml: models[0].ttft_slo_ms"
    assert ttft_slo_source({TTFT_SLO_SOURCE_ENV: named}) == named
    with pytest.raises(MemxConfigError) as err:
        ttft_slo_source({TTFT_SLO_SOURCE_ENV: "a\nb"})
    assert err.value.flag == TTFT_SLO_SOURCE_ENV
