"""Per-layer roofline timing of one engine iteration.

An iteration runs a mixed batch: prefill chunks and decode tokens. For each
layer, two operator groups are timed separately, each as
``max(flops / effective_flops, bytes / effective_bandwidth)``:

* linear (QKV, O, MLP): ``2 * layer_params * tokens`` FLOPs; reads the layer's
  weights once per iteration (so decode is weight-bandwidth bound at small
  batch, prefill compute bound);
* attention: ``4 * heads * head_dim`` FLOPs per (query, key) pair (QK^T and
  PV); reads every KV token of every sequence in the batch once.

The LM head runs only for sampled sequences (decodes and prefills whose last
chunk ends in this iteration). A fixed per-iteration overhead models
scheduling and launch cost. ``share`` (0, 1] scales both peaks for spatial
sharing of one GPU. All times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import GpuSpec
from .models import DTYPE_BYTES, ModelSpec

__all__ = ["Roofline", "BatchShape"]


@dataclass
class BatchShape:
    """Aggregate shape of one iteration's batch (what the roofline needs).

    ``tokens``: query tokens (decodes + prefill chunk tokens); ``attn_pairs``:
    causal (query, key) pairs; ``kv_tokens``: KV tokens read (per layer);
    ``sampled``: sequences that produce a token."""

    tokens: int = 0
    attn_pairs: float = 0.0
    kv_tokens: int = 0
    sampled: int = 0

    def add_decode(self, context: int) -> None:
        """One decode token attending to ``context`` stored tokens plus itself."""
        self.tokens += 1
        self.attn_pairs += context + 1
        self.kv_tokens += context + 1
        self.sampled += 1

    def add_prefill(self, prefix: int, chunk: int, last_chunk: bool) -> None:
        """A prefill chunk of ``chunk`` tokens after ``prefix`` stored tokens."""
        self.tokens += chunk
        self.attn_pairs += chunk * prefix + chunk * (chunk + 1) / 2
        self.kv_tokens += prefix + chunk
        if last_chunk:
            self.sampled += 1


class Roofline:
    """Iteration time of one model on one GPU (see module docstring)."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        weight_dtype: str = "bf16",
        kv_dtype: str = "bf16",
        overhead_s: float = 5e-4,
        share: float = 1.0,
    ):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.model, self.gpu = model, gpu
        compute_dtype = "fp8" if weight_dtype == "fp8" else "bf16"
        self.flops = gpu.flops(compute_dtype) * share
        self.bw = gpu.mem_bw * share
        self.overhead_s = overhead_s
        self.layers = model.layers
        self._lin_flops_per_token = 2.0 * model.layer_params
        self._lin_bytes = model.layer_weight_bytes(weight_dtype)
        self._attn_flops_per_pair = 4.0 * model.heads * model.head_dim
        self._kv_bytes_per_token = model.kv_bytes_per_token_layer(kv_dtype)
        self._head_flops_per_seq = 2.0 * model.vocab * model.hidden
        self._head_bytes = model.vocab * model.hidden * DTYPE_BYTES[weight_dtype]

    def layer_time(self, tokens: int, attn_pairs: float, kv_tokens: float) -> float:
        """One transformer layer for the given batch aggregates."""
        if tokens <= 0:
            return 0.0
        lin = max(self._lin_flops_per_token * tokens / self.flops, self._lin_bytes / self.bw)
        attn = max(self._attn_flops_per_pair * attn_pairs / self.flops, self._kv_bytes_per_token * kv_tokens / self.bw)
        return lin + attn

    def head_time(self, sampled: int) -> float:
        if sampled <= 0:
            return 0.0
        return max(self._head_flops_per_seq * sampled / self.flops, self._head_bytes / self.bw)

    def iteration_time(self, shape: BatchShape) -> float:
        """Whole iteration: layers x layer_time + LM head + overhead (0 if empty)."""
        if shape.tokens <= 0:
            return 0.0
        return (
            self.layers * self.layer_time(shape.tokens, shape.attn_pairs, shape.kv_tokens)
            + self.head_time(shape.sampled)
            + self.overhead_s
        )

    def decode_time(self, batch: int, mean_context: float) -> float:
        """Convenience: a pure decode iteration of ``batch`` sequences."""
        s = BatchShape()
        for _ in range(batch):
            s.add_decode(int(mean_context))
        return self.iteration_time(s)

    def prefill_time(self, prompt: int) -> float:
        """Convenience: one whole prompt as a single chunk."""
        s = BatchShape()
        s.add_prefill(0, prompt, True)
        return self.iteration_time(s)
