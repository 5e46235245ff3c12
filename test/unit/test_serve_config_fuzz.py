"""Random mutations of a valid ``models.yaml`` give a valid config or a ``ServeConfigError`` naming the field.

Hypothesis starts from a document that uses every section and field (``serve/config.py``), then
applies one to three mutations anywhere in it: drop a field, add an unknown one, replace a
value with another type or an out-of-range / NaN / inf / huge number, wrap it in a list or a
mapping (wrong nesting), duplicate a model or device, point a model path somewhere bad
(missing, a file, a directory without ``config.json``, outside the config's folder, NUL,
5 000 characters, a symlink loop). ``parse_config`` and then ``plan_placement`` must accept it or
raise ``ServeConfigError`` whose ``field`` is a path into the mutated document (the value, or
a required field missing from a mapping that is there) and whose message starts with it;
any other exception is a bug. The same documents also go through ``load_config`` as YAML
files, and random text as a YAML file gives a config or ``ServeConfigError`` too.

``MEMX_FUZZ_EXAMPLES`` (default 25) x 4 documents per test; see docs/reliability.md "Bad input".
"""

from __future__ import annotations

import copy
import math
import os
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_memx.serve.config import ServeConfig, ServeConfigError, load_config, parse_config
from sglang_memx.serve.placement import Placement, plan_placement
from support.fake_checkpoint import fake_model

EXAMPLES = int(os.environ.get("MEMX_FUZZ_EXAMPLES", "25")) * 4
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The config's folder: checkpoints a, b; an empty dir; a file; a symlink loop; one checkpoint outside."""
    root = tmp_path_factory.mktemp("fuzzcfg")
    outside = fake_model(root, "outside")
    base = root / "conf"
    fake_model(base, "a")
    fake_model(base, "b", layers=4)
    (base / "empty").mkdir()
    (base / "file").write_text("x")
    (base / "loop").symlink_to(base / "loop")
    return base, outside


def valid(base) -> dict:
    conf, _ = base
    return {
        "models": [
            {"name": "a", "path": str(conf / "a"), "dtype": "bfloat16", "kv_cache_dtype": "auto", "ttft_slo_ms": 500,
             "tpot_slo_ms": 50, "priority": 1, "min_replicas": 1, "max_replicas": 1, "max_inflight": 4,
             "max_queued": 8, "max_total_tokens": 4096, "kv_reserve_tokens": 512, "device": "cpu0",
             "server_args": ["--chunked-prefill-size", "512"], "sleep_after_s": 30},
            {"name": "org/b", "path": "b", "precision": "float32", "server_args": "--max-running-requests 4"},
        ],
        "devices": [
            {"name": "cpu0", "kind": "cpu", "memory_gb": 4, "cores": [0, 1], "max_inflight": 6},
            {"name": "gpu0", "kind": "cuda", "memory_gb": 8.5, "index": 0},
        ],
        "router": {"host": "127.0.0.1", "port": 30000, "max_queued": 64, "max_inflight_per_engine": 8,
                   "hopeless_after_slo_x": 4.0, "request_timeout_s": 600, "api_key": "k"},
        "launch": {"log_dir": "logs", "pool_dir": "/tmp/pool", "startup_timeout_s": 600, "memx_args": ["--memx-x"],
                   "max_restarts": 3, "restart_backoff_s": 1.0, "restart_window_s": 600},
        "health": {"interval_s": 5, "timeout_s": 10, "failures": 3, "path": "/memx/status"},
    }  # fmt: skip


# --------------------------------------------------------------------------- values

SPECIAL = [None, True, False, 0, -1, 1, 65536, 10**400, -(10**400), 2**63, 0.0, -0.0, 1e-300, 1e308, -1e308,
           math.nan, math.inf, -math.inf, "", " ", "auto", "cpu", "cuda", "a", "org/b", "cpu0", "\x00", "é" * 50,
           [], {}, [0, 0], [-1], ["a", 1], {"a": 1}]  # fmt: skip
# a fresh copy per draw: SPECIAL's lists and dicts land in documents that later mutations change in
# place ("unknown" adds keys to any mapping), and a changed SPECIAL made hypothesis see the same
# choices give different documents (FlakyStrategyDefinition)
SPECIAL_VALUES = st.sampled_from(SPECIAL).map(copy.deepcopy)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | SPECIAL_VALUES
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
UNKNOWN_KEYS = st.sampled_from(["ttft_slo", "gpu", "Name", "replicas", "models", "x", "", 0, None, True]) | st.text(
    "abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12
)


def bad_paths(base) -> list[str]:
    conf, outside = base
    return ["nope", "file", "empty", "loop", "loop/x", "a\x00", "x" * 5000, "/".join(["x" * 200] * 30), "~",
            "~nouser/x", "../outside", str(outside), "../../../../../../etc", "/", ".", "a/config.json", "a/",
            str(conf / "a") + "/", "\ud800"]  # fmt: skip


# ------------------------------------------------------------------------ mutations


def key_name(key) -> str:
    """How an error path shows a mapping key (``config._fields``): plain names as is, others quoted."""
    return key if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_-]+", key) else repr(key)


def locations(doc, path="") -> list[tuple[object, object, str]]:
    """(container, key, field path) of every value in ``doc``."""
    out = []
    items = enumerate(doc) if isinstance(doc, list) else doc.items() if isinstance(doc, dict) else ()
    for k, v in items:
        sub = f"{path}[{k}]" if isinstance(doc, list) else (f"{path}.{key_name(k)}" if path else key_name(k))
        out.append((doc, k, sub))
        out.extend(locations(v, sub))
    return out


@st.composite
def mutated(draw, base) -> dict:
    doc = valid(base)
    for _ in range(draw(st.integers(1, 3))):
        locs = locations(doc)
        container, key, _ = draw(st.sampled_from(locs))
        op = draw(st.sampled_from(["drop", "value", "unknown", "wrap", "dup", "path", "section"]))
        if op == "drop":
            del container[key]
        elif op == "value":
            container[key] = draw(SPECIAL_VALUES | VALUES)
        elif op == "unknown":
            maps = [v for _, _, v in ((c, k, c[k]) for c, k, _ in locs) if isinstance(v, dict)] + [doc]
            draw(st.sampled_from(maps))[draw(UNKNOWN_KEYS)] = draw(VALUES)
        elif op == "wrap":
            container[key] = draw(st.sampled_from([[container[key]], {"value": container[key]}]))
        elif op == "dup":
            section = draw(st.sampled_from(["models", "devices"]))
            if isinstance(doc.get(section), list) and doc[section]:
                doc[section].append(copy.deepcopy(draw(st.sampled_from(doc[section]))))
        elif op == "path":
            models = doc.get("models")
            if isinstance(models, list) and models and isinstance(models[-1], dict):
                draw(st.sampled_from([m for m in models if isinstance(m, dict)]))["path"] = draw(
                    st.sampled_from(bad_paths(base))
                )
        else:  # a whole section of the wrong shape
            doc[draw(st.sampled_from(["models", "devices", "router", "launch", "health"]))] = draw(VALUES)
    return doc


# -------------------------------------------------------------------------- checks


def assert_names_a_field(err: ServeConfigError, doc) -> None:
    """``err.field`` is the path of a value in ``doc``, or of a required field missing from a mapping there."""
    assert type(err) is ServeConfigError and str(err).startswith(f"{err.field}: ") and err.message, repr(err)
    paths = {p: v for c, k, p in locations(doc) for v in [c[k]]}
    if err.field in paths:
        return
    parent, _, name = err.field.rpartition(".")
    assert re.fullmatch(r"[a-z_]+", name), f"{err.field!r} is not in the document"
    assert isinstance(paths.get(parent, doc if parent == "" else None), dict), f"{err.field!r}: no mapping {parent!r}"


def outcome(doc, conf):
    """The config and its placement, or the ServeConfigError (anything else propagates: a bug)."""
    try:
        cfg = parse_config(doc, base_dir=conf)
        assert isinstance(cfg, ServeConfig)
        assert isinstance(plan_placement(cfg), Placement)
        return cfg
    except ServeConfigError as err:
        assert_names_a_field(err, doc)
        return err


@FUZZ
@given(data=st.data())
def test_mutated_configs_are_valid_or_name_the_field(base, data):
    doc = data.draw(mutated(base))
    outcome(doc, base[0])


@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))  # PyYAML is slow: a quarter of the documents
@given(data=st.data())
def test_the_same_documents_as_yaml_files(base, tmp_path_factory, data):
    doc = data.draw(mutated(base))
    try:
        text = yaml.safe_dump(doc, allow_unicode=False)
    except yaml.YAMLError:
        return
    path = base[0] / "models.yaml"
    path.write_text(text)
    try:
        got = load_config(path)
        plan_placement(got)
    except ServeConfigError as err:
        if err.field != "--config":
            assert_names_a_field(err, yaml.safe_load(text))


ODD_YAML = ["", "---", "[", "models: [", "a: &x [*x]", "!!python/object:os.system {}", "models:\n  - name: a\n  -",
            "\t", "? [a]\n: 1", "{a: 1, a: 2}", "models: !!binary aGk=", "models: 1e999"]  # fmt: skip


@FUZZ
@given(text=st.text(max_size=200) | st.sampled_from(ODD_YAML))
def test_random_text_as_a_yaml_file(base, text):
    path = base[0] / "random.yaml"
    path.write_text(text, errors="surrogatepass")
    try:
        load_config(path)
    except ServeConfigError as err:
        assert str(err).startswith(f"{err.field}: ") and err.message


# ------------------------------------------------- regressions: what the fuzzer found (each was another error)


def one_model(base, **fields) -> dict:
    doc = valid(base)
    doc["models"][0].update(fields)
    return doc


def parse_and_place(doc, conf):
    plan_placement(parse_config(doc, base_dir=conf))


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"ttft_slo_ms": 10**400}, "models[0].ttft_slo_ms"),  # float() overflowed
        ({"path": "x" * 5000}, "models[0].path"),  # ENAMETOOLONG from is_dir
        ({"kv_reserve_tokens": 10**400}, "models[0].kv_reserve_tokens"),  # placement's bytes / GIB overflowed
        ({"max_total_tokens": 10**400}, "models[0].max_total_tokens"),
    ],
)
def test_regressions_name_the_field(base, fields, field):
    with pytest.raises(ServeConfigError) as e:
        parse_and_place(one_model(base, **fields), base[0])
    assert e.value.field == field


def test_an_unknown_key_that_is_empty_or_not_a_name_is_quoted_in_the_path(base):
    for key, field in [("", "''"), ("a.b", "router.'a.b'"), (None, "launch.None"), (3, "models[0].3")]:
        doc = valid(base)
        where = {"''": doc, "router.'a.b'": doc["router"], "launch.None": doc["launch"]}.get(field, doc["models"][0])
        where[key] = 1
        with pytest.raises(ServeConfigError) as e:
            parse_and_place(doc, base[0])
        assert e.value.field == field and "unknown field" in str(e.value)


def test_a_huge_device_memory_is_refused_before_placement_sees_inf(base):
    doc = valid(base)
    doc["devices"][1]["memory_gb"] = 1e308  # x GIB was inf: placement's GpuCandidate raised ValueError
    with pytest.raises(ServeConfigError) as e:
        parse_and_place(doc, base[0])
    assert e.value.field == "devices[1].memory_gb"
