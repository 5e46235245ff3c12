"""Deterministic tiny random models."""

import hashlib
import json
import time

import pytest
from safetensors import safe_open

from sglang_memx.models.tiny import TinyModelSpec, generate_tiny_model, tiny_model


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    "spec",
    [
        TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, head_dim=16),
        TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=4, head_dim=32, num_layers=3),
        TinyModelSpec(arch="qwen3", num_heads=4, num_kv_heads=1, head_dim=64, num_layers=1),
        TinyModelSpec(arch="qwen2", num_heads=2, num_kv_heads=2, head_dim=16, num_layers=2),
    ],
    ids=lambda s: s.name,
)
def test_generation_is_fast_complete_and_loadable(spec, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.perf_counter()
    out = generate_tiny_model(spec, tmp_path / "m")
    assert time.perf_counter() - t0 < 5.0
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.num_hidden_layers == spec.num_layers
    assert cfg.num_key_value_heads == spec.num_kv_heads
    assert cfg.head_dim == spec.head_dim
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is")["input_ids"]
    assert 0 < len(ids) < 20 and tok.decode(ids) == "The capital of France is"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (cfg.vocab_size, spec.hidden_size)
        assert str(f.get_tensor("lm_head.weight").dtype) == "torch.bfloat16"
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) == (spec.arch == "qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (spec.arch == "qwen2")


def test_same_spec_same_bytes_other_seed_other_weights(tmp_path):
    a = generate_tiny_model(TinyModelSpec(seed=3), tmp_path / "a")
    b = generate_tiny_model(TinyModelSpec(seed=3), tmp_path / "b")
    c = generate_tiny_model(TinyModelSpec(seed=4), tmp_path / "c")
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_transformers_forward_runs(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = generate_tiny_model(TinyModelSpec(arch="qwen3"), tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_cache_reuses_the_directory(tmp_path):
    spec = TinyModelSpec()
    first = tiny_model(spec, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model(spec, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    meta = json.loads((first / "memx_tiny.json").read_text())
    assert meta["fingerprint"] == spec.fingerprint()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("arch", "gpt2", "arch"),
        ("num_kv_heads", 3, "num_kv_heads"),
        ("head_dim", 15, "head_dim"),
        ("num_layers", 0, "num_layers"),
        ("vocab_size", 100, "vocab_size"),
    ],
)
def test_bad_spec_names_the_field(field, value, fragment, tmp_path):
    import dataclasses

    spec = dataclasses.replace(TinyModelSpec(), **{field: value})
    with pytest.raises(ValueError, match=fragment):
        generate_tiny_model(spec, tmp_path / "m")
