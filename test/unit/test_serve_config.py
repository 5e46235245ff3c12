"""``sglang-memx serve`` config: YAML -> frozen dataclasses, every error names its field."""

from __future__ import annotations

import pytest

from sglang_memx.serve.config import UNCAPPED, ServeConfigError, load_config, parse_config
from support.fake_checkpoint import fake_model


def doc(tmp_path, **over):
    a = fake_model(tmp_path, "a")
    fake_model(tmp_path, "b")
    base = {
        "models": [{"name": "a", "path": str(a), "ttft_slo_ms": 500, "priority": 1}, {"name": "b", "path": "b"}],
        "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": 1}],
    }
    base.update(over)
    return base


def err(tmp_path, d) -> ServeConfigError:
    with pytest.raises(ServeConfigError) as e:
        parse_config(d, base_dir=tmp_path)
    return e.value


def test_valid_config_is_frozen_and_defaults_apply(tmp_path):
    cfg = parse_config(doc(tmp_path), base_dir=tmp_path)
    a, b = cfg.models
    assert a.name == "a" and a.ttft_slo_ms == 500 and a.priority == 1
    assert b.path == str((tmp_path / "b").resolve())  # relative to the config file's folder
    assert cfg.router.host == "127.0.0.1" and cfg.inflight_cap(b) == UNCAPPED == cfg.queue_cap(b)
    # defaults refuse nothing stock would serve: no caps, no shedding (issue 26 item 4)
    assert cfg.router.max_inflight_per_engine is None and cfg.router.max_queued is None
    assert cfg.router.hopeless_after_slo_x is None and cfg.total_queue_cap() == UNCAPPED
    assert cfg.devices[0].memory_gb == 1.0
    with pytest.raises(AttributeError):
        a.name = "x"  # frozen


def test_duplicate_model_name_names_the_second(tmp_path):
    d = doc(tmp_path)
    d["models"][1]["name"] = "a"
    e = err(tmp_path, d)
    assert e.field == "models[1].name" and "duplicate 'a'" in str(e)


def test_unknown_fields_at_every_level(tmp_path):
    d = doc(tmp_path)
    d["models"][0]["ttft_slo"] = 3
    assert err(tmp_path, d).field == "models[0].ttft_slo"
    assert err(tmp_path, doc(tmp_path, router={"prot": 1})).field == "router.prot"
    assert err(tmp_path, doc(tmp_path, extra=1)).field == "extra"
    d = doc(tmp_path)
    d["devices"][0]["gpu"] = True
    e = err(tmp_path, d)
    assert e.field == "devices[0].gpu" and "unknown field" in str(e)


def test_bad_paths(tmp_path):
    d = doc(tmp_path)
    d["models"][1]["path"] = str(tmp_path / "nope")
    e = err(tmp_path, d)
    assert e.field == "models[1].path" and "not a directory" in str(e)
    (tmp_path / "empty").mkdir()
    d["models"][1]["path"] = "empty"
    assert "no config.json" in str(err(tmp_path, d))


@pytest.mark.parametrize(
    "field,value,where",
    [
        ("ttft_slo_ms", 0, "models[0].ttft_slo_ms"),
        ("ttft_slo_ms", "fast", "models[0].ttft_slo_ms"),
        ("dtype", "int3", "models[0].dtype"),
        ("priority", True, "models[0].priority"),
        ("max_replicas", 2, "models[0].max_replicas"),
        ("min_replicas", 0, "models[0].min_replicas"),
        ("device", "gpu9", "models[0].device"),
        ("server_args", ["--chunked-prefill-size", "64", "--port", "1"], "models[0].server_args[2]"),
        ("name", "bad name", "models[0].name"),
    ],
)
def test_bad_model_values_name_the_field(tmp_path, field, value, where):
    d = doc(tmp_path)
    d["models"][0][field] = value
    assert err(tmp_path, d).field == where


def test_replicas_default_and_bounds_by_field(tmp_path):
    d = doc(tmp_path)
    d["models"][0]["min_replicas"] = 3
    a, b = parse_config(d, base_dir=tmp_path).models
    assert (a.min_replicas, a.max_replicas) == (3, 3) and (b.min_replicas, b.max_replicas) == (1, 1)
    d["models"][0]["max_replicas"] = 2
    e = err(tmp_path, d)
    assert e.field == "models[0].max_replicas" and "< min_replicas 3" in str(e)
    d["models"][0]["max_replicas"] = 4  # scaling above min is not implemented: refused, not ignored
    e = err(tmp_path, d)
    assert e.field == "models[0].max_replicas" and "not implemented yet" in str(e)
    for bad in (0, 33, 1.5, "2"):
        d = doc(tmp_path)
        d["models"][1]["min_replicas"] = bad
        assert err(tmp_path, d).field == "models[1].min_replicas"
    d = doc(tmp_path)
    d["models"][1]["max_replicas"] = 2  # min defaults to 1
    assert err(tmp_path, d).field == "models[1].max_replicas"


def test_devices_and_router_checks(tmp_path):
    assert err(tmp_path, doc(tmp_path, devices=[])).field == "devices"
    assert err(tmp_path, doc(tmp_path, devices=[{"name": "c", "memory_gb": -1}])).field == "devices[0].memory_gb"
    two = [{"name": "c", "memory_gb": 1}, {"name": "c", "memory_gb": 2}]
    assert err(tmp_path, doc(tmp_path, devices=two)).field == "devices[1].name"
    assert err(tmp_path, doc(tmp_path, devices=[{"name": "c", "memory_gb": 1, "kind": "tpu"}])).field == (
        "devices[0].kind"
    )
    assert err(tmp_path, doc(tmp_path, router={"port": 70000})).field == "router.port"
    assert err(tmp_path, doc(tmp_path, models=None)).field == "models"
    e = err(tmp_path, {"devices": [{"name": "c", "memory_gb": 1}]})
    assert e.field == "models" and "required" in str(e)
    lend = {"name": "c", "memory_gb": 1, "lend_idle_cores": "yes"}
    assert err(tmp_path, doc(tmp_path, devices=[lend])).field == "devices[0].lend_idle_cores"
    gpu = {"name": "g", "kind": "cuda", "memory_gb": 1, "lend_idle_cores": True}
    assert err(tmp_path, doc(tmp_path, devices=[gpu])).field == "devices[0].lend_idle_cores"
    for field, bad in (("max_queued", -1), ("hopeless_after_slo_x", 0), ("max_inflight_per_engine", 0)):
        assert err(tmp_path, doc(tmp_path, router={field: bad})).field == f"router.{field}"


def test_precision_is_an_alias_of_dtype(tmp_path):
    d = doc(tmp_path)
    d["models"][0]["precision"] = "float32"
    assert parse_config(d, base_dir=tmp_path).models[0].dtype == "float32"
    d["models"][0]["dtype"] = "bfloat16"
    assert err(tmp_path, d).field == "models[0].precision"


def test_load_config_reads_yaml_and_reports_bad_files(tmp_path):
    fake_model(tmp_path, "a")
    p = tmp_path / "models.yaml"
    p.write_text("models:\n  - {name: a, path: a}\ndevices:\n  - {name: cpu0, memory_gb: 0.5}\n")
    cfg = load_config(p)
    assert cfg.models[0].path == str((tmp_path / "a").resolve()) and cfg.source == str(p)
    p.write_text("models: [\n")
    assert load_config.__name__ and "not valid YAML" in str(pytest.raises(ServeConfigError, load_config, p).value)
    assert pytest.raises(ServeConfigError, load_config, tmp_path / "none.yaml").value.field == "--config"


def test_health_section_defaults_and_errors_name_the_field(tmp_path):
    h = parse_config(doc(tmp_path), base_dir=tmp_path).health
    assert (h.interval_s, h.timeout_s, h.failures, h.path) == (5.0, 10.0, 3, "/memx/status")
    h = parse_config(doc(tmp_path, health={"interval_s": 2, "timeout_s": 30, "failures": 5}), base_dir=tmp_path).health
    assert (h.interval_s, h.timeout_s, h.failures) == (2.0, 30.0, 5)
    assert parse_config(doc(tmp_path, health={"interval_s": None}), base_dir=tmp_path).health.interval_s is None
    for bad, where in (({"interval_s": 0}, "health.interval_s"), ({"timeout_s": -1}, "health.timeout_s"),
                       ({"timeout_s": None}, "health.timeout_s"), ({"failures": 0}, "health.failures"),
                       ({"failures": 1.5}, "health.failures"), ({"path": "/ping"}, "health.path"),
                       ({"intervall_s": 5}, "health.intervall_s"),
                       ({"timeout_s": 1e6}, "health.timeout_s")):  # fmt: skip
        assert err(tmp_path, doc(tmp_path, health=bad)).field == where
    assert err(tmp_path, doc(tmp_path, health=[1])).field == "health"
    # upstream's /health generates a token: refused when a model sleeps (each probe would wake it)
    assert parse_config(doc(tmp_path, health={"path": "/health"}), base_dir=tmp_path).health.path == "/health"
    d = doc(tmp_path, health={"path": "/health_generate"})
    d["models"][1]["sleep_after_s"] = 30
    e = err(tmp_path, d)
    assert e.field == "health.path" and "b: sleep_after_s" in str(e)
    d["health"]["interval_s"] = None  # no probing: nothing to wake it
    assert parse_config(d, base_dir=tmp_path).health.path == "/health_generate"


def test_device_max_inflight_is_validated_and_caps_its_models_together_in_deadline_order(tmp_path):
    from sglang_memx.serve.admission import policy_from_config

    assert parse_config(doc(tmp_path), base_dir=tmp_path).devices[0].max_inflight is None
    for bad in (0, "2", True):
        assert err(tmp_path, doc(tmp_path, devices=[{"name": "c", "memory_gb": 1, "max_inflight": bad}])).field == (
            "devices[0].max_inflight"
        )
    devices = [{"name": "cpu0", "memory_gb": 1, "max_inflight": 1}, {"name": "cpu1", "memory_gb": 1}]
    cfg = parse_config(doc(tmp_path, devices=devices), base_dir=tmp_path)
    assert cfg.devices[0].max_inflight == 1 and cfg.devices[1].max_inflight is None
    # a: TTFT SLO 0.5 s, b: 1 s, each with 8 slots of its own; both on cpu0, one slot between them
    pol = policy_from_config(cfg, {"a": "cpu0", "b": "cpu0"})
    assert pol.offer("a1", "a", 0.0).verdict == "admit"
    assert pol.offer("b1", "b", 0.0).verdict == "queue"  # b's own cap is free: the device's is not
    assert pol.offer("a2", "a", 0.2).verdict == "queue"  # deadline 0.7 < b1's 1.0
    assert [t.rid for t in pol.finish("a1", 0.3)] == ["a2"]  # earliest deadline first across models
    assert [t.rid for t in pol.finish("a2", 0.4)] == ["b1"]
    # the same models on a device without a cap: each uses its own slots at once
    free = policy_from_config(cfg, {"a": "cpu1", "b": "cpu1"})
    assert free.offer("a1", "a", 0.0).verdict == "admit" and free.offer("b1", "b", 0.0).verdict == "admit"


BAD_SLOS = [0, -1, -0.5, float("nan"), float("inf"), float("-inf"), 1e16, "fast", "50", True, [50]]


@pytest.mark.parametrize("field", ["ttft_slo_ms", "tpot_slo_ms"])
@pytest.mark.parametrize("bad", BAD_SLOS)
def test_bad_slo_values_name_the_field(tmp_path, field, bad):
    d = doc(tmp_path)
    d["models"][1][field] = bad
    e = err(tmp_path, d)
    assert e.field == f"models[1].{field}" and str(e).startswith(f"models[1].{field}: must be")


def test_slo_values_parse_and_tpot_is_optional(tmp_path):
    d = doc(tmp_path)
    d["models"][0]["tpot_slo_ms"] = 80
    a, b = parse_config(d, base_dir=tmp_path).models
    assert (a.ttft_slo_ms, a.tpot_slo_ms) == (500.0, 80.0) and (b.ttft_slo_ms, b.tpot_slo_ms) == (1000.0, None)
    d["models"][0]["tpot_slo_ms"] = None  # explicitly none: no governor
    assert parse_config(d, base_dir=tmp_path).models[0].tpot_slo_ms is None


@pytest.mark.parametrize(
    "server_args,memx_args,where,fragment",
    [  # tpot_slo_ms reaches the engines as --memx-tpot-slo-ms: the flag may not come a second time
        (["--memx-tpot-slo-ms", "50"], [], "models[0].server_args[0]", "contradicts models[0].tpot_slo_ms"),
        (["--memx-tpot-slo-ms=50"], [], "models[0].server_args[0]", "contradicts models[0].tpot_slo_ms"),
        ([], ["--memx-chunk-kb", "4", "--memx-tpot-slo-ms", "50"], "launch.memx_args[2]", "give one of the two"),
    ],
)
def test_a_tpot_slo_given_twice_names_the_field(tmp_path, server_args, memx_args, where, fragment):
    d = doc(tmp_path, launch={"memx_args": memx_args})
    d["models"][0].update(tpot_slo_ms=80, server_args=server_args)
    e = err(tmp_path, d)
    assert e.field == where and fragment in str(e)


def test_the_tpot_flag_without_a_models_yaml_slo_is_allowed(tmp_path):
    d = doc(tmp_path)
    d["models"][1]["server_args"] = ["--memx-tpot-slo-ms", "50"]  # model b sets no tpot_slo_ms: one source
    d["models"][0].update(tpot_slo_ms=80, server_args=["--memx-host-buffer-gb", "1", "--memx-ttft-slo-ms", "900"])
    a, b = parse_config(d, base_dir=tmp_path).models
    assert a.tpot_slo_ms == 80.0 and b.tpot_slo_ms is None and b.server_args == ("--memx-tpot-slo-ms", "50")
