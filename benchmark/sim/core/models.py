"""Model architectures (public ``config.json`` values) and the sizes derived
from them: parameter count, weight bytes, KV bytes per token, FLOPs.

Invariant: every derived quantity is a pure function of the architecture
fields; nothing is looked up. Parameter counts ignore norms and biases (<0.1%)
and count the embedding and LM head separately (tied or not).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelSpec", "MODELS", "model_spec", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``gated_mlp``: three MLP matrices (SwiGLU,
    Llama/Qwen/Mistral) instead of two (OPT)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True
    head_dim_override: int | None = None

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return q_o + k_v + mlp

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    def weight_bytes(self, dtype: str = "bf16") -> float:
        return self.params * DTYPE_BYTES[dtype]

    def layer_weight_bytes(self, dtype: str = "bf16") -> float:
        return self.layer_params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token_layer(self, kv_dtype: str = "bf16") -> float:
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        return self.layers * self.kv_bytes_per_token_layer(kv_dtype)

    def activation_bytes(self, tokens: int, dtype: str = "bf16") -> float:
        """Peak activation memory of one forward pass over ``tokens`` tokens:
        the widest live tensors of a layer (hidden in/out, QKV, MLP
        gate+up), an estimate, not a measurement."""
        per_token = 4 * self.hidden + 2 * self.intermediate
        return tokens * per_token * DTYPE_BYTES[dtype]


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256),
        ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256),
        ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000),
        ModelSpec("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000),
        ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064),
        ModelSpec("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064),
        ModelSpec("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, head_dim_override=128),
        ModelSpec("Qwen3-14B", 40, 5120, 40, 8, 17408, 151936, head_dim_override=128),
        ModelSpec("Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, head_dim_override=128),
        ModelSpec("Mistral-7B", 32, 4096, 32, 8, 14336, 32000),
        ModelSpec("OPT-6.7B", 32, 4096, 32, 32, 16384, 50272, gated_mlp=False),
        ModelSpec("OPT-13B", 40, 5120, 40, 40, 20480, 50272, gated_mlp=False),
        ModelSpec("OPT-30B", 48, 7168, 56, 56, 28672, 50272, gated_mlp=False),
    ]
}


def model_spec(name: str) -> ModelSpec:
    """Look a model up by name; raises ``KeyError`` listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
