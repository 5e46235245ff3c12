"""Deterministic tiny models of the MLA, sliding-window and hybrid linear-attention families."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from sglang_memx.cli import main
from sglang_memx.models.tiny import checkpoint_checksum
from sglang_memx.models.tiny_families import (
    ARCHITECTURES,
    KV_LORA_RANK,
    QK_ROPE_DIM,
    SLIDING_WINDOW,
    TinyFamilySpec,
    generate_family_model,
    tiny_family_model,
    verify_family_model,
    weight_table,
)

SPECS = [TinyFamilySpec(family=f, num_layers=4 if f == "hybrid_linear" else 2) for f in sorted(ARCHITECTURES)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {spec.family: tiny_family_model(spec, root) for spec in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_config_and_tokenizer_load_with_the_family_fields(spec, built):
    from transformers import AutoConfig, AutoTokenizer

    out = built[spec.family]
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == [ARCHITECTURES[spec.family]]
    assert cfg.num_hidden_layers == spec.num_layers and cfg.hidden_size == spec.hidden_size
    if spec.family.startswith("mla"):
        assert cfg.kv_lora_rank == KV_LORA_RANK and cfg.qk_rope_head_dim == QK_ROPE_DIM
        assert cfg.first_k_dense_replace == spec.num_layers  # every MLP dense
        assert (cfg.q_lora_rank is None) == (spec.family == "mla")
        # upstream's CPU rope for MLA is DeepSeek-YaRN only, like the real checkpoints' configs
        assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
    if spec.family in ("sliding_window", "swa_gpt_oss", "swa_mellum"):
        assert cfg.sliding_window == SLIDING_WINDOW
        assert cfg.layer_types == ["sliding_attention", "full_attention"]
    if spec.family == "hybrid_linear":
        assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
        assert cfg.full_attention_interval == 2
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is")["input_ids"]
    assert tok.decode(ids) == "The capital of France is" and max(ids) < cfg.vocab_size


def _fused_expert_names(keys):
    """transformers keeps a mixture's experts fused in memory; checkpoints (and upstream) list them per expert."""
    return {k for k in keys if ".mlp.experts." in k}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.family)
def test_tensors_are_the_ones_transformers_model_class_declares(spec, built):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = built[spec.family]
    cfg = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    declared = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        declared.pop("lm_head.weight", None)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        written = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        assert {str(f.get_tensor(k).dtype) for k in list(f.keys())[:3]} == {"torch.bfloat16"}
    if spec.family == "hybrid_linear":  # per-expert in the file, fused in transformers' memory
        per_expert = _fused_expert_names(written)
        assert len(per_expert) == 3 * 4 * (spec.num_layers)
        written = {k: v for k, v in written.items() if k not in per_expert}
        declared = {k: v for k, v in declared.items() if k not in _fused_expert_names(declared)}
    assert written == declared
    names = [name for name, _, _ in weight_table(spec, cfg.vocab_size)]
    assert len(set(names)) == len(names) and sorted(names) == sorted(keys)  # the table is the file, no name twice
    assert (out / "model.safetensors").stat().st_size < 2_000_000  # tiny: fits the 2-core box


def test_two_builds_same_checksum_other_seed_other_checksum(tmp_path):
    spec = TinyFamilySpec(family="mla", seed=5)
    a = generate_family_model(spec, tmp_path / "a")
    b = generate_family_model(spec, tmp_path / "b")
    c = generate_family_model(TinyFamilySpec(family="mla", seed=6), tmp_path / "c")
    recorded = json.loads((a / "memx_tiny.json").read_text())["checksum"]
    assert checkpoint_checksum(a) == checkpoint_checksum(b) == recorded
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert checkpoint_checksum(c) != checkpoint_checksum(a)


def test_verify_names_the_directory_of_a_changed_model(built):
    out = built["sliding_window"]
    assert verify_family_model(out) == checkpoint_checksum(out)
    cfg_path = out / "generation_config.json"
    original = cfg_path.read_text()
    try:
        cfg_path.write_text(original + " ")
        with pytest.raises(ValueError, match="checksum .* differs") as err:
            verify_family_model(out)
        assert str(out) in str(err.value)
    finally:
        cfg_path.write_text(original)


def test_cache_reuses_the_directory(tmp_path):
    spec = TinyFamilySpec(family="swa_gpt_oss")
    first = tiny_family_model(spec, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_family_model(spec, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"family": "mamba"}, "family"),
        ({"family": "mla", "num_layers": 1}, "num_layers"),
        ({"family": "mla", "hidden_size": 36}, "hidden_size"),
        ({"family": "mla", "vocab_size": 100}, "vocab_size"),
    ],
)
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TinyFamilySpec(**kwargs).validate()


def test_cli_models_family(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["models", "family", "--out", str(out), "--family", "hybrid_linear", "--layers", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]
    assert main(["models", "family", "--out", str(tmp_path / "n"), "--family", "rwkv"]) == 2
    assert "family" in capsys.readouterr().err and not (tmp_path / "n").exists()
