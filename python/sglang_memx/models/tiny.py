"""Deterministic tiny random models for tests.

A tiny model is a complete Hugging Face checkpoint directory (config.json,
bf16 safetensors, a BPE tokenizer trained with `tokenizers`, a ChatML chat
template) that upstream SGLang loads like any real model. The same
``TinyModelSpec`` always produces byte-identical weights and tokenizer, so
greedy outputs are comparable across processes and runs.

Invariant: generation takes no network access and well under 5 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a one two three model memory token cache page chunk layer weight "
    "pool server request answer question capital city france paris river "
    "blue green small large fast slow light dark north south east west "
    "gpu cpu host device map unmap share borrow return budget batch decode "
    "prefill prompt stream user assistant system hello world what is of and"
).split()


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. ``num_kv_heads == num_heads`` is MHA, fewer is GQA."""

    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    seed: int = 0

    def validate(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch: {self.arch!r} is not one of {sorted(ARCHITECTURES)}")
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size: at least 300 needed for a byte-level BPE, got {self.vocab_size}")

    @property
    def name(self) -> str:
        kind = "mha" if self.num_kv_heads == self.num_heads else "gqa"
        return f"tiny-{self.arch}-{kind}-l{self.num_layers}-h{self.hidden_size}-d{self.head_dim}-s{self.seed}"

    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True) + _GENERATOR_VERSION
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_GENERATOR_VERSION = "tiny-v1"


def _corpus(seed: int) -> list[str]:
    """A deterministic pseudo-text corpus (no randomness from the OS)."""
    lines = []
    state = seed * 2654435761 + 12345
    for i in range(400):
        words = []
        for _ in range(6 + i % 9):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            words.append(_WORDS[(state >> 33) % len(_WORDS)])
        lines.append(" ".join(words).capitalize() + ("?" if i % 5 == 0 else "."))
    return lines


def _train_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    return tok


def _hf_config(spec: TinyModelSpec, vocab_size: int, eos_id: int) -> dict:
    cfg = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
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
        "attention_bias": spec.arch == "qwen2",
    }
    if spec.arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def _weights(spec: TinyModelSpec, vocab_size: int) -> dict:
    """Random weights from a private generator: identical on every machine."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d

    def rand(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rand(vocab_size, h, std=1.0)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = rand(q_out, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, q_out)
        if spec.arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(q_out, std=0.02)
            w[p + "self_attn.k_proj.bias"] = rand(kv_out, std=0.02)
            w[p + "self_attn.v_proj.bias"] = rand(kv_out, std=0.02)
        if spec.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h)
        w[p + "mlp.up_proj.weight"] = rand(inter, h)
        w[p + "mlp.down_proj.weight"] = rand(h, inter)
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = rand(vocab_size, h, std=h**-0.5 * 4)
    return w


def train_tokenizer(vocab_size: int, seed: int):
    """The byte-level BPE every tiny model uses (same ``vocab_size`` and ``seed``: same tokenizer)."""
    return _train_tokenizer(TinyModelSpec(vocab_size=vocab_size, seed=seed))


def write_tokenizer_files(out: Path, tok, model_max_length: int) -> tuple[int, int]:
    """Write ``tok`` with its ChatML config into ``out``; return (vocab size, eos id)."""
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": model_max_length,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHATML_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )
    return vocab_size, eos_id


def checkpoint_checksum(model_dir: str | os.PathLike) -> str:
    """sha256 over every file of a checkpoint directory (names and bytes, sorted by name),
    except the ``memx_*.json`` manifests that record it."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and not (path.name.startswith("memx_") and path.suffix == ".json"):
            digest.update(path.name.encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def generate_tiny_model(spec: TinyModelSpec, out_dir: str | os.PathLike) -> Path:
    """Write the checkpoint for ``spec`` into ``out_dir`` (created; must not hold a model)."""
    from safetensors.torch import save_file

    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec)
    vocab_size, eos_id = write_tokenizer_files(out, tok, spec.max_position_embeddings)
    (out / "config.json").write_text(json.dumps(_hf_config(spec, vocab_size, eos_id), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "bos_token_id": eos_id}, indent=2))
    # One metadata key only: safetensors writes a metadata map in hash order.
    save_file(_weights(spec, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "memx_tiny.json").write_text(
        json.dumps({"spec": dataclasses.asdict(spec), "fingerprint": spec.fingerprint()}, indent=2)
    )
    return out


def tiny_model(spec: TinyModelSpec, cache_root: str | os.PathLike) -> Path:
    """Return the directory of ``spec`` under ``cache_root``, generating it once."""
    final = Path(cache_root) / f"{spec.name}-{spec.fingerprint()}"
    return materialize(final, lambda out: generate_tiny_model(spec, out))


def materialize(final: Path, generate) -> Path:
    """Return ``final``, calling ``generate(directory)`` once if it holds no ``memx_tiny.json``.

    Generation goes to a temporary sibling and is renamed into place, so
    concurrent callers never see a half-written model.
    """
    if (final / "memx_tiny.json").exists():
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is meant to be shared
        generate(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "memx_tiny.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
