"""Placement for ``sglang-memx serve``: sizes read from checkpoints, FineServe Alg. 1 decides."""

from __future__ import annotations

import json

import pytest

from memory_ext.policy.placement import GpuCandidate, ModelDemand, place_models
from sglang_memx.serve.config import ServeConfigError, parse_config
from sglang_memx.serve.placement import GIB, ModelSize, plan_placement, read_model_size
from support.fake_checkpoint import fake_model


def test_sizes_from_checkpoint_rescaled_to_serving_dtype(tmp_path):
    d = fake_model(tmp_path, "m", layers=3, kv_heads=2, head_dim=32, weight_bytes=4000, dtype="bfloat16")
    s = read_model_size(d)
    assert s.weight_bytes == 4000 and s.kv_bytes_per_token == 3 * 2 * 32 * 2 * 2
    f32 = read_model_size(d, "float32")
    assert f32.weight_bytes == 8000 and f32.kv_bytes_per_token == 3 * 2 * 32 * 2 * 4
    fp8 = read_model_size(d, "float32", "fp8_e4m3")
    assert fp8.kv_bytes_per_token == 3 * 2 * 32 * 2 * 1


def test_the_models_width_is_read_and_zero_when_the_config_lacks_it(tmp_path):
    assert read_model_size(fake_model(tmp_path, "w", hidden=576)).hidden_size == 576
    d = fake_model(tmp_path, "n")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_model_size(d).hidden_size == 0


def test_no_weights_or_geometry_is_an_error(tmp_path):
    d = fake_model(tmp_path, "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weight files"):
        read_model_size(d)


def _cfg(tmp_path, models, devices):
    for m in models:
        fake_model(tmp_path, m["name"])
        m.setdefault("path", m["name"])
    return parse_config({"models": models, "devices": devices}, base_dir=tmp_path)


def test_placement_matches_alg1_on_the_same_numbers(tmp_path):
    cfg = _cfg(tmp_path, [{"name": n, "kv_reserve_tokens": 100} for n in "abc"],
               [{"name": "d0", "memory_gb": 1}, {"name": "d1", "memory_gb": 1}])  # fmt: skip
    sizes = {"a": ModelSize(int(0.5 * GIB), 1000, 2, 2, 16, 2), "b": ModelSize(int(0.4 * GIB), 100, 2, 2, 16, 2),
             "c": ModelSize(int(0.3 * GIB), 500, 2, 2, 16, 2)}  # fmt: skip
    p = plan_placement(cfg, sizes)
    fm = {n: s.weight_bytes + 100 * s.kv_bytes_per_token for n, s in sizes.items()}
    demands = [ModelDemand(n, fm[n], 1 / sizes[n].kv_bytes_per_token) for n in "abc"]
    ref = place_models(demands, [GpuCandidate("d0", GIB), GpuCandidate("d1", GIB)])
    assert {n: pm.device for n, pm in p.models.items()} == ref.assignment
    for d in p.devices.values():
        assert d.pool_budget_bytes == GIB - sum(sizes[n].weight_bytes for n in d.models)
        assert set(d.models) == set(ref.residents[d.name])


def test_model_that_fits_nowhere_is_named(tmp_path):
    cfg = _cfg(tmp_path, [{"name": "small"}, {"name": "huge"}], [{"name": "d0", "memory_gb": 1}])
    sizes = {"small": ModelSize(1000, 10, 1, 1, 2, 2), "huge": ModelSize(2 * GIB, 10, 1, 1, 2, 2)}
    with pytest.raises(ServeConfigError) as e:
        plan_placement(cfg, sizes)
    assert e.value.field == "models[1]" and "'huge' needs 2.0000 GB" in str(e.value)


def test_pinned_model_charged_to_its_device(tmp_path):
    cfg = _cfg(tmp_path, [{"name": "a", "device": "d1"}, {"name": "b"}],
               [{"name": "d0", "memory_gb": 1}, {"name": "d1", "memory_gb": 1}])  # fmt: skip
    sizes = {"a": ModelSize(int(0.9 * GIB), 10, 1, 1, 2, 2), "b": ModelSize(int(0.5 * GIB), 10, 1, 1, 2, 2)}
    p = plan_placement(cfg, sizes)
    assert p.models["a"].device == "d1" and p.models["b"].device == "d0"
    cfg = _cfg(tmp_path, [{"name": "a", "device": "d0"}], [{"name": "d0", "memory_gb": 0.5}])
    with pytest.raises(ServeConfigError, match="its device 'd0'"):
        plan_placement(cfg, sizes)


def test_two_small_models_share_one_device_and_default_tokens(tmp_path):
    cfg = _cfg(tmp_path, [{"name": "a"}, {"name": "b", "max_total_tokens": 4096}], [{"name": "cpu", "memory_gb": 0.5}])
    p = plan_placement(cfg)  # sizes read from the fake checkpoints
    assert p.devices["cpu"].models == ("a", "b")
    assert p.models["b"].max_total_tokens == 4096 and p.models["a"].max_total_tokens == 65536
    assert "cpu (cpu): a, b" in p.describe()


def test_replicas_are_instances_of_alg1_spread_over_devices(tmp_path):
    cfg = _cfg(tmp_path, [{"name": "a", "min_replicas": 2, "kv_reserve_tokens": 10}, {"name": "b"}],
               [{"name": "d0", "memory_gb": 1}, {"name": "d1", "memory_gb": 1}])  # fmt: skip
    sizes = {"a": ModelSize(int(0.2 * GIB), 100, 2, 2, 16, 2), "b": ModelSize(int(0.1 * GIB), 100, 2, 2, 16, 2)}
    p = plan_placement(cfg, sizes)
    assert p.models["a"].replicas == (
        ("a", p.models["a"].replica_devices[0]),
        ("a#1", p.models["a"].replica_devices[1]),
    )
    assert set(p.models["a"].replica_devices) == {"d0", "d1"}  # apart, although both fit on one device
    fa = sizes["a"].weight_bytes + 10 * 100
    demands = [ModelDemand("a", fa, 1 / 100), ModelDemand("a#1", fa, 1 / 100),
               ModelDemand("b", sizes["b"].weight_bytes + 1024 * 100, 1 / 100)]  # fmt: skip
    ref = place_models(demands, [GpuCandidate("d0", GIB), GpuCandidate("d1", GIB)], spread={"a": "a", "a#1": "a"})
    assert {d.name: d.models for d in p.devices.values()} == ref.residents
    for d in p.devices.values():  # every replica's weights are its own, outside the pool
        w = sum(sizes[n.split("#")[0]].weight_bytes for n in d.models)
        assert d.weight_bytes == w and d.pool_budget_bytes == GIB - w


def test_replicas_share_one_device_when_there_is_one(tmp_path):
    cfg = _cfg(tmp_path, [{"name": "a", "min_replicas": 3}], [{"name": "cpu", "memory_gb": 1}])
    sizes = {"a": ModelSize(int(0.1 * GIB), 100, 2, 2, 16, 2)}
    p = plan_placement(cfg, sizes)
    assert p.devices["cpu"].models == ("a", "a#1", "a#2") and p.models["a"].replica_devices == ("cpu",) * 3
    assert p.devices["cpu"].pool_budget_bytes == GIB - 3 * sizes["a"].weight_bytes
    assert "cpu (cpu): a, a#1, a#2" in p.describe()


def test_replicas_that_do_not_all_fit_name_min_replicas(tmp_path):
    sizes = {"a": ModelSize(int(0.4 * GIB), 100, 2, 2, 16, 2)}
    cfg = _cfg(tmp_path, [{"name": "a", "min_replicas": 3}], [{"name": "cpu", "memory_gb": 1}])
    with pytest.raises(ServeConfigError) as e:
        plan_placement(cfg, sizes)
    assert e.value.field == "models[0].min_replicas" and "replica 3 of 3" in str(e.value)
    pinned = _cfg(tmp_path, [{"name": "a", "min_replicas": 3, "device": "cpu"}], [{"name": "cpu", "memory_gb": 1}])
    with pytest.raises(ServeConfigError) as e:
        plan_placement(pinned, sizes)
    assert e.value.field == "models[0].min_replicas" and "its device 'cpu'" in str(e.value)
    two = _cfg(tmp_path, [{"name": "a", "min_replicas": 2, "device": "cpu"}], [{"name": "cpu", "memory_gb": 1}])
    assert plan_placement(two, sizes).devices["cpu"].models == ("a", "a#1")
