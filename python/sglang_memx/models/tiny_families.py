"""Deterministic tiny random models of the attention families beyond Llama-like MHA/GQA.

Each family is one Hugging Face architecture class that upstream SGLang has a model for:

- ``mla``: ``DeepseekV2ForCausalLM`` with multi-head latent attention (no q LoRA, like
  DeepSeek-V2-Lite); every layer's MLP is dense (``first_k_dense_replace == num_layers``) so
  the model exercises MLA and nothing else new.
- ``mla_v3``: ``DeepseekV3ForCausalLM``, the same with a q LoRA (``q_a_proj`` / ``q_b_proj``).
- ``sliding_window``: ``Gemma2ForCausalLM``, sliding-window layers beside full-attention ones
  (even layers slide), soft-capped logits, tied embeddings.
- ``swa_gpt_oss``: ``GptOssForCausalLM``, a sliding-window architecture upstream serves from its
  SWA KV pool (``SWAKVPool``, two sub-pools): attention sinks, a top-2 mixture of 4 bf16 experts.
- ``swa_mellum``: ``MellumForCausalLM``, another SWA-pool architecture (Qwen3-style q/k norms,
  per-layer-type RoPE), every MLP dense (``mlp_layer_types``) so the SWA pool is the only new part.
- ``hybrid_linear``: ``Qwen3NextForCausalLM``, gated-delta-net linear-attention layers beside
  full-attention ones (every second layer), a top-2 mixture of 4 experts plus a shared expert.

Every model shares the tiny models' tokenizer (:func:`sglang_memx.models.tiny.train_tokenizer`)
and is written as bf16 safetensors. Invariant: the same :class:`TinyFamilySpec` always writes
byte-identical files (weights come from a private ``torch.Generator`` seeded with ``seed``,
filled in the order of :func:`weight_table`); ``memx_tiny.json`` records the spec, its
fingerprint and :func:`~sglang_memx.models.tiny.checkpoint_checksum` of the files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from sglang_memx.models.tiny import checkpoint_checksum, materialize, train_tokenizer, write_tokenizer_files

ARCHITECTURES = {
    "mla": "DeepseekV2ForCausalLM",
    "mla_v3": "DeepseekV3ForCausalLM",
    "sliding_window": "Gemma2ForCausalLM",
    "swa_gpt_oss": "GptOssForCausalLM",
    "swa_mellum": "MellumForCausalLM",
    "hybrid_linear": "Qwen3NextForCausalLM",
}
_MODEL_TYPES = {
    "mla": "deepseek_v2",
    "mla_v3": "deepseek_v3",
    "sliding_window": "gemma2",
    "swa_gpt_oss": "gpt_oss",
    "swa_mellum": "mellum",
    "hybrid_linear": "qwen3_next",
}
_GENERATOR_VERSION = "tiny-families-v2"  # bump on any change to what a spec writes
NUM_HEADS = 4
NUM_KV_HEADS = 2
NUM_EXPERTS = 4
SLIDING_WINDOW = 8
# MLA shapes (per head): a 32-wide latent, 16 + 8 query/key dims (no-rope + rope), 16 value dims.
KV_LORA_RANK, Q_LORA_RANK, QK_NOPE_DIM, QK_ROPE_DIM, V_HEAD_DIM = 32, 32, 16, 8, 16
CONV_KERNEL = 4


@dataclasses.dataclass(frozen=True)
class TinyFamilySpec:
    """Shape of a tiny model of ``family``; heads, experts and latent sizes are the constants above."""

    family: str
    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    seed: int = 0

    def validate(self) -> None:
        if self.family not in ARCHITECTURES:
            raise ValueError(f"family: {self.family!r} is not one of {sorted(ARCHITECTURES)}")
        for name in ("num_layers", "hidden_size", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.hidden_size % (2 * NUM_HEADS):
            raise ValueError(f"hidden_size: must be a multiple of {2 * NUM_HEADS}, got {self.hidden_size}")
        if self.num_layers < 2:
            raise ValueError(f"num_layers: at least 2 (one layer of each kind), got {self.num_layers}")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size: at least 300 needed for a byte-level BPE, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // NUM_HEADS

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.family]

    @property
    def name(self) -> str:
        return f"tiny-{self.family.replace('_', '-')}-l{self.num_layers}-h{self.hidden_size}-s{self.seed}"

    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True) + _GENERATOR_VERSION
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def layer_types(self) -> list[str]:
        """Per-layer attention kind: odd layers are full attention, even ones the family's other kind."""
        other = "sliding_attention" if self.family in ("sliding_window", "swa_gpt_oss", "swa_mellum") else None
        if self.family == "hybrid_linear":
            other = "linear_attention"
        if other is None:
            return ["full_attention"] * self.num_layers
        return [other if i % 2 == 0 else "full_attention" for i in range(self.num_layers)]


# ----------------------------------------------------------------------------- configs
def hf_config(spec: TinyFamilySpec, vocab_size: int, eos_id: int) -> dict:
    """The ``config.json`` of ``spec`` (fields upstream's model class and transformers' config read)."""
    cfg = {
        "architectures": [spec.architecture],
        "model_type": _MODEL_TYPES[spec.family],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    cfg.update(_FAMILY_CONFIG[spec.family](spec))
    return cfg


def _mla_config(spec: TinyFamilySpec) -> dict:
    return {
        "num_key_value_heads": NUM_HEADS,
        "kv_lora_rank": KV_LORA_RANK,
        "q_lora_rank": Q_LORA_RANK if spec.family == "mla_v3" else None,
        "qk_nope_head_dim": QK_NOPE_DIM,
        "qk_rope_head_dim": QK_ROPE_DIM,
        "v_head_dim": V_HEAD_DIM,
        "head_dim": QK_ROPE_DIM,
        # YaRN like the real DeepSeek-V2/V3 configs (upstream's CPU rope for MLA is DeepSeek-YaRN only)
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings // 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "first_k_dense_replace": spec.num_layers,  # every MLP dense: MLA is the only new part
        "moe_layer_freq": 1,
        "n_routed_experts": NUM_EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": spec.intermediate_size // 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy" if spec.family == "mla" else "noaux_tc",
        "scoring_func": "softmax" if spec.family == "mla" else "sigmoid",
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "attention_bias": False,
    }


def _gemma2_config(spec: TinyFamilySpec) -> dict:
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.head_dim,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": spec.layer_types(),
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
    }


def _gpt_oss_config(spec: TinyFamilySpec) -> dict:
    return {
        "intermediate_size": spec.hidden_size,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": spec.layer_types(),
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": spec.max_position_embeddings // 32,
        },
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
    }


def _mellum_config(spec: TinyFamilySpec) -> dict:
    return {
        "sliding_window": SLIDING_WINDOW,
        "layer_types": spec.layer_types(),
        "mlp_layer_types": ["dense"] * spec.num_layers,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "num_local_experts": NUM_EXPERTS,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": spec.intermediate_size // 4,
        "norm_topk_prob": True,
        "attention_bias": False,
    }


def _qwen3_next_config(spec: TinyFamilySpec) -> dict:
    return {
        "full_attention_interval": 2,
        "layer_types": spec.layer_types(),
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "linear_key_head_dim": spec.head_dim,
        "linear_value_head_dim": spec.head_dim,
        "linear_num_key_heads": NUM_KV_HEADS,
        "linear_num_value_heads": NUM_HEADS,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": spec.intermediate_size // 4,
        "shared_expert_intermediate_size": spec.intermediate_size // 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "attention_bias": False,
    }


_FAMILY_CONFIG = {
    "mla": _mla_config,
    "mla_v3": _mla_config,
    "sliding_window": _gemma2_config,
    "swa_gpt_oss": _gpt_oss_config,
    "swa_mellum": _mellum_config,
    "hybrid_linear": _qwen3_next_config,
}


# ----------------------------------------------------------------------------- weights
# How each tensor is drawn: "linear" N(0, fan_in^-1/2) with fan_in the last dim ("expert": the
# middle dim of a fused [experts, in, out] tensor); "norm" 1 + N(0, 0.1); "offset_norm" N(0, 0.1)
# (Gemma-style norms scale by 1 + w); "small" N(0, 0.02) (biases, sinks, dt bias); "a_log"
# log U(1, 16) (the gated delta net's decay); "embed" N(0, 1); "lm_head" N(0, 4 / sqrt(hidden)).
def weight_table(spec: TinyFamilySpec, vocab_size: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the checkpoint as (name, shape, how it is drawn), in generation order."""
    h = spec.hidden_size
    offset = spec.family in ("sliding_window", "hybrid_linear")
    norm = "offset_norm" if offset else "norm"
    table = [("model.embed_tokens.weight", (vocab_size, h), "embed")]
    for i, kind in enumerate(spec.layer_types()):
        p = f"model.layers.{i}."
        table += [(p + "input_layernorm.weight", (h,), norm), (p + "post_attention_layernorm.weight", (h,), norm)]
        table += [(p + n, s, k) for n, s, k in _ATTENTION[spec.family](spec, kind)]
        table += [(p + n, s, k) for n, s, k in _MLP[spec.family](spec)]
    table.append(("model.norm.weight", (h,), norm))
    if spec.family != "sliding_window":  # Gemma2 ties the output head to the embedding
        table.append(("lm_head.weight", (vocab_size, h), "lm_head"))
    return table


def _dense_mlp(spec: TinyFamilySpec, prefix: str = "mlp.", inter: int | None = None):
    h, i = spec.hidden_size, inter or spec.intermediate_size
    return [
        (prefix + "gate_proj.weight", (i, h), "linear"),
        (prefix + "up_proj.weight", (i, h), "linear"),
        (prefix + "down_proj.weight", (h, i), "linear"),
    ]


def _mla_attention(spec: TinyFamilySpec, kind: str):
    h, qk = spec.hidden_size, QK_NOPE_DIM + QK_ROPE_DIM
    if spec.family == "mla_v3":
        q = [
            ("self_attn.q_a_proj.weight", (Q_LORA_RANK, h), "linear"),
            ("self_attn.q_a_layernorm.weight", (Q_LORA_RANK,), "norm"),
            ("self_attn.q_b_proj.weight", (NUM_HEADS * qk, Q_LORA_RANK), "linear"),
        ]
    else:
        q = [("self_attn.q_proj.weight", (NUM_HEADS * qk, h), "linear")]
    return q + [
        ("self_attn.kv_a_proj_with_mqa.weight", (KV_LORA_RANK + QK_ROPE_DIM, h), "linear"),
        ("self_attn.kv_a_layernorm.weight", (KV_LORA_RANK,), "norm"),
        ("self_attn.kv_b_proj.weight", (NUM_HEADS * (QK_NOPE_DIM + V_HEAD_DIM), KV_LORA_RANK), "linear"),
        ("self_attn.o_proj.weight", (h, NUM_HEADS * V_HEAD_DIM), "linear"),
    ]


def _qkvo(spec: TinyFamilySpec, *, q_factor: int = 1, bias: bool = False):
    h, q, kv = spec.hidden_size, NUM_HEADS * spec.head_dim, NUM_KV_HEADS * spec.head_dim
    out = []
    for name, rows, cols in (("q", q * q_factor, h), ("k", kv, h), ("v", kv, h), ("o", h, q)):
        out.append((f"self_attn.{name}_proj.weight", (rows, cols), "linear"))
        if bias:
            out.append((f"self_attn.{name}_proj.bias", (rows,), "small"))
    return out


def _gemma2_attention(spec: TinyFamilySpec, kind: str):
    return _qkvo(spec)


def _gemma2_mlp(spec: TinyFamilySpec):
    h = spec.hidden_size
    return _dense_mlp(spec) + [
        ("pre_feedforward_layernorm.weight", (h,), "offset_norm"),
        ("post_feedforward_layernorm.weight", (h,), "offset_norm"),
    ]


def _gpt_oss_attention(spec: TinyFamilySpec, kind: str):
    return _qkvo(spec, bias=True) + [("self_attn.sinks", (NUM_HEADS,), "small")]


def _gpt_oss_mlp(spec: TinyFamilySpec):
    h = i = spec.hidden_size
    return [
        ("mlp.router.weight", (NUM_EXPERTS, h), "linear"),
        ("mlp.router.bias", (NUM_EXPERTS,), "small"),
        ("mlp.experts.gate_up_proj", (NUM_EXPERTS, h, 2 * i), "expert"),
        ("mlp.experts.gate_up_proj_bias", (NUM_EXPERTS, 2 * i), "small"),
        ("mlp.experts.down_proj", (NUM_EXPERTS, i, h), "expert"),
        ("mlp.experts.down_proj_bias", (NUM_EXPERTS, h), "small"),
    ]


def _mellum_attention(spec: TinyFamilySpec, kind: str):
    d = spec.head_dim
    return _qkvo(spec) + [("self_attn.q_norm.weight", (d,), "norm"), ("self_attn.k_norm.weight", (d,), "norm")]


def _qwen3_next_attention(spec: TinyFamilySpec, kind: str):
    d = spec.head_dim
    if kind == "full_attention":  # q_proj also yields the output gate
        return _qkvo(spec, q_factor=2) + [
            ("self_attn.q_norm.weight", (d,), "offset_norm"),
            ("self_attn.k_norm.weight", (d,), "offset_norm"),
        ]
    h, key, value = spec.hidden_size, NUM_KV_HEADS * d, NUM_HEADS * d
    return [
        ("linear_attn.dt_bias", (NUM_HEADS,), "small"),
        ("linear_attn.A_log", (NUM_HEADS,), "a_log"),
        ("linear_attn.conv1d.weight", (2 * key + value, 1, CONV_KERNEL), "linear"),
        ("linear_attn.in_proj_qkvz.weight", (2 * key + 2 * value, h), "linear"),
        ("linear_attn.in_proj_ba.weight", (2 * NUM_HEADS, h), "linear"),
        ("linear_attn.norm.weight", (d,), "norm"),
        ("linear_attn.out_proj.weight", (h, value), "linear"),
    ]


def _qwen3_next_mlp(spec: TinyFamilySpec):
    h, i = spec.hidden_size, spec.intermediate_size // 4
    out = [("mlp.gate.weight", (NUM_EXPERTS, h), "linear")]
    for e in range(NUM_EXPERTS):
        out += _dense_mlp(spec, f"mlp.experts.{e}.", i)
    out += _dense_mlp(spec, "mlp.shared_expert.", i)
    return out + [("mlp.shared_expert_gate.weight", (1, h), "linear")]


_ATTENTION = {
    "mla": _mla_attention,
    "mla_v3": _mla_attention,
    "sliding_window": _gemma2_attention,
    "swa_gpt_oss": _gpt_oss_attention,
    "swa_mellum": _mellum_attention,
    "hybrid_linear": _qwen3_next_attention,
}
_MLP = {
    "mla": _dense_mlp,
    "mla_v3": _dense_mlp,
    "sliding_window": _gemma2_mlp,
    "swa_gpt_oss": _gpt_oss_mlp,
    "swa_mellum": _dense_mlp,
    "hybrid_linear": _qwen3_next_mlp,
}


def _weights(spec: TinyFamilySpec, vocab_size: int) -> dict:
    """Draw :func:`weight_table` in order from a private generator: identical on every machine."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    out = {}
    for name, shape, how in weight_table(spec, vocab_size):
        noise = torch.randn(*shape, generator=gen)
        if how == "linear":
            value = noise * shape[-1] ** -0.5
        elif how == "expert":
            value = noise * shape[1] ** -0.5
        elif how == "norm":
            value = 1.0 + 0.1 * noise
        elif how == "offset_norm":
            value = 0.1 * noise
        elif how == "small":
            value = 0.02 * noise
        elif how == "a_log":
            value = torch.log(1.0 + 15.0 * torch.rand(*shape, generator=gen))
        elif how == "embed":
            value = noise
        else:  # lm_head
            value = noise * spec.hidden_size**-0.5 * 4
        out[name] = value.to(torch.bfloat16).contiguous()
    return out


# ----------------------------------------------------------------------------- files
def generate_family_model(spec: TinyFamilySpec, out_dir: str | os.PathLike) -> Path:
    """Write the checkpoint of ``spec`` into ``out_dir`` (created) with its ``memx_tiny.json``."""
    from safetensors.torch import save_file

    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, eos_id = write_tokenizer_files(
        out, train_tokenizer(spec.vocab_size, spec.seed), spec.max_position_embeddings
    )
    (out / "config.json").write_text(json.dumps(hf_config(spec, vocab_size, eos_id), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "bos_token_id": eos_id}, indent=2))
    # One metadata key only: safetensors writes a metadata map in hash order.
    save_file(_weights(spec, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    manifest = {
        "spec": dataclasses.asdict(spec),
        "fingerprint": spec.fingerprint(),
        "checksum": checkpoint_checksum(out),
    }
    (out / "memx_tiny.json").write_text(json.dumps(manifest, indent=2))
    return out


def tiny_family_model(spec: TinyFamilySpec, cache_root: str | os.PathLike) -> Path:
    """Return the directory of ``spec`` under ``cache_root``, generating it once (atomically)."""
    spec.validate()
    final = Path(cache_root) / f"{spec.name}-{spec.fingerprint()}"
    return materialize(final, lambda out: generate_family_model(spec, out))


def verify_family_model(model_dir: str | os.PathLike) -> str:
    """Recompute the checksum of a generated model; raise ``ValueError`` naming the directory if it changed."""
    model_dir = Path(model_dir)
    manifest = json.loads((model_dir / "memx_tiny.json").read_text())
    actual = checkpoint_checksum(model_dir)
    if actual != manifest["checksum"]:
        raise ValueError(f"{model_dir}: checksum {actual} differs from memx_tiny.json's {manifest['checksum']}")
    return actual
