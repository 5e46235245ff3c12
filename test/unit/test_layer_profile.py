"""Performance record format (memory_ext/policy/layer_profile.py)."""

import json

import pytest

from memory_ext.policy.layer_profile import SCHEMA, LayerProfile


def _profile(**kw):
    base = dict(
        model="OPT-6.7B",
        device="cuda:NVIDIA A10",
        dtype="bf16",
        n_layers=32,
        layer_bytes=400_000_000,
        link_bytes_per_s=25e9,
        decode_layer_s={1: 0.8e-3, 4: 0.9e-3, 16: 1.2e-3},
        prefill_layer_s_per_token=5e-6,
        seq_len=512,
        measured_at="2026-11-30T10:00:00+00:00",
        command="sglang-memx profile --model-path m",
    )
    base.update(kw)
    return LayerProfile(**base)


def test_transfer_time_is_bytes_over_bandwidth():
    assert _profile().layer_transfer_s == pytest.approx(0.016)


def test_decode_interpolation_flat_below_linear_between_and_above():
    p = _profile()
    assert p.decode_layer_seconds(1) == pytest.approx(0.8e-3)
    # below the smallest measured batch: flat (there is no batch 0)
    assert _profile(decode_layer_s={4: 1e-3, 8: 2e-3}).decode_layer_seconds(2) == pytest.approx(1e-3)
    # between 1 and 4: a third of the way
    assert p.decode_layer_seconds(2) == pytest.approx(0.8e-3 + 0.1e-3 / 3)
    assert p.decode_layer_seconds(4) == pytest.approx(0.9e-3)
    assert p.decode_layer_seconds(10) == pytest.approx(1.05e-3)
    # above 16: the last segment's slope (0.3 ms per 12) continues
    assert p.decode_layer_seconds(28) == pytest.approx(1.5e-3)


def test_decode_extrapolation_never_falls_and_one_point_is_flat():
    noisy = _profile(decode_layer_s={8: 2e-3, 16: 1.9e-3})
    assert noisy.decode_layer_seconds(64) == pytest.approx(1.9e-3)
    one = _profile(decode_layer_s={8: 2e-3})
    assert one.decode_layer_seconds(1) == one.decode_layer_seconds(512) == pytest.approx(2e-3)


def test_decode_table_is_sorted_and_prefill_is_linear():
    p = _profile(decode_layer_s={16: 3e-3, 1: 1e-3})
    assert list(p.decode_layer_s) == [1, 16]
    assert p.prefill_layer_seconds(1000) == pytest.approx(5e-3)


def test_json_round_trip(tmp_path):
    p = _profile()
    obj = p.to_json()
    assert obj["schema"] == SCHEMA
    assert obj["decode_layer_s"] == {"1": 0.8e-3, "4": 0.9e-3, "16": 1.2e-3}
    assert LayerProfile.from_json(json.loads(json.dumps(obj))) == p
    path = tmp_path / "sub" / "opt.json"
    p.save(path)
    assert LayerProfile.load(path) == p
    assert json.loads(path.read_text())["schema"] == "memx.layer_profile/1"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"schema": "memx.layer_profile/2"}, "schema"),
        ({"schema": None}, "schema"),
        ({"n_layers": "32"}, "n_layers"),
        ({"n_layers": 0}, "n_layers"),
        ({"n_layers": True}, "n_layers"),
        ({"layer_bytes": 1.5}, "layer_bytes"),
        ({"link_bytes_per_s": 0}, "link_bytes_per_s"),
        ({"link_bytes_per_s": float("inf")}, "link_bytes_per_s"),
        ({"decode_layer_s": {}}, "decode_layer_s"),
        ({"decode_layer_s": [1, 2]}, "decode_layer_s"),
        ({"decode_layer_s": {"x": 1e-3}}, "decode_layer_s"),
        ({"decode_layer_s": {"0": 1e-3}}, "decode_layer_s"),
        ({"decode_layer_s": {"4": -1e-3}}, "decode_layer_s"),
        ({"decode_layer_s": {"4": "fast"}}, "decode_layer_s"),
        ({"prefill_layer_s_per_token": 0.0}, "prefill_layer_s_per_token"),
        ({"seq_len": -1}, "seq_len"),
        ({"measured_at": "yesterday"}, "measured_at"),
        ({"model": ""}, "model"),
        ({"device": 3}, "device"),
        ({"dtype": None}, "dtype"),
        ({"command": 7}, "command"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_json_names_the_field(change, field):
    obj = _profile().to_json()
    obj.update(change)
    with pytest.raises(ValueError, match=rf"^layer profile field '{field}': "):
        LayerProfile.from_json(obj)


@pytest.mark.parametrize("field", ["model", "n_layers", "decode_layer_s", "seq_len", "measured_at", "command"])
def test_missing_field_is_named(field):
    obj = _profile().to_json()
    del obj[field]
    with pytest.raises(ValueError, match=rf"^layer profile field '{field}': missing"):
        LayerProfile.from_json(obj)


def test_constructor_validates_like_the_loader():
    with pytest.raises(ValueError, match="^layer profile field 'decode_layer_s'"):
        _profile(decode_layer_s={2: 1e-3, "2": 2e-3})
    with pytest.raises(ValueError, match="^layer profile field 'measured_at'"):
        _profile(measured_at="")
    assert _profile(measured_at="2026-11-30T10:00:00Z").measured_at.endswith("Z")


def test_bad_files_and_arguments(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        LayerProfile.load(bad)
    with pytest.raises(ValueError, match="JSON object"):
        LayerProfile.from_json([1])
    with pytest.raises(ValueError, match="^batch"):
        _profile().decode_layer_seconds(0)
    with pytest.raises(ValueError, match="^tokens"):
        _profile().prefill_layer_seconds(True)
