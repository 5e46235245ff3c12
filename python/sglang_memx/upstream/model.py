"""The model being served and its forward (``sglang.srt.configs`` / ``model_executor``), as memx reads them."""

from __future__ import annotations


def text_config(model_config):
    """The Hugging Face config of the served text model (``ModelConfig.hf_text_config``)."""
    return model_config.hf_text_config


def decoder_dims(model_config) -> dict | None:
    """Hidden / intermediate sizes, heads, KV heads, head dim and vocabulary of the decoder, or
    None if the model's config does not have them all.

    These are Hugging Face config fields (not SGLang names): ``num_key_value_heads`` and
    ``head_dim`` are optional there and default the way Hugging Face models read them."""
    hf = text_config(model_config)
    needed = ("num_attention_heads", "hidden_size", "intermediate_size", "vocab_size")
    if any(_hf_optional(hf, name) is None for name in needed):
        return None
    heads = int(hf.num_attention_heads)
    hidden = int(hf.hidden_size)
    return {
        "hidden": hidden,
        "intermediate": int(hf.intermediate_size),
        "num_heads": heads,
        "num_kv_heads": int(_hf_optional(hf, "num_key_value_heads") or heads),
        "head_dim": int(_hf_optional(hf, "head_dim") or hidden // heads),
        "vocab": int(hf.vocab_size),
    }


def architecture(model_config) -> str:
    """The served model's class name (the Hugging Face config's first architecture)."""
    archs = model_config.hf_config.architectures
    return str(archs[0]) if archs else "this model"


def hybrid_swa_architecture(architectures: list[str], text_config_fields: dict) -> bool:
    """Whether upstream's rule (``is_hybrid_swa_model``) serves these architectures with its hybrid
    sliding-window pool, read from a checkpoint's ``config.json`` (the text model's fields)."""
    from types import SimpleNamespace

    from sglang_memx.upstream.manifest import resolve

    rule = resolve("sglang.srt.configs.model_config.is_hybrid_swa_model")
    return bool(rule(list(architectures), SimpleNamespace(**text_config_fields)))


def _hf_optional(hf_config, field: str):
    """An optional Hugging Face config field (None when the model's config has none)."""
    return getattr(hf_config, field, None)


def runner_allocator(runner):
    """A ModelRunner's token allocator (the coordinator hangs on it)."""
    return runner.token_to_kv_pool_allocator


def updater_runner(updater):
    """The ModelRunner a ``WeightUpdater`` writes into."""
    return updater.get_model_runner()


def runner_device(runner) -> str:
    return str(runner.device)


def forward_shape(forward_batch) -> tuple[int, int]:
    """(tokens, sequences) of one forward batch (0 tokens for a forward without input ids)."""
    ids = forward_batch.input_ids
    return (0 if ids is None else int(ids.numel())), int(forward_batch.batch_size)


def forward_is_decode(forward_batch) -> bool:
    return bool(forward_batch.forward_mode.is_decode())


def runner_model(runner):
    return runner.model


def runner_server_args(runner):
    return runner.server_args


class NotHookable(TypeError):
    """The served model's decoder layers cannot be found the way memx hooks them."""


def decoder_layers(causal_lm) -> list:
    """``(index, module)`` of this process's decoder layers, found per architecture class:

    * shaped like ``LlamaForCausalLM`` (most SGLang causal LMs, Mellum's included): a ``model``
      with a ``layers`` ModuleList and ``start_layer`` / ``end_layer`` (this pipeline stage's slice);
    * ``Gemma2ForCausalLM``: ``model.layers`` only; upstream builds it without pipeline stages,
      so every layer is in this process.

    Any other raises ``NotHookable`` naming what is missing."""
    import torch

    from sglang_memx.upstream.manifest import resolve

    name = type(causal_lm).__name__
    try:
        lm_body = causal_lm.model
        layers = lm_body.layers
    except AttributeError as exc:
        raise NotHookable(f"{name} is not shaped like LlamaForCausalLM ({exc})") from None
    if not isinstance(layers, torch.nn.ModuleList):
        raise NotHookable(f"{name}.model.layers is a {type(layers).__name__}, not a ModuleList")
    if isinstance(causal_lm, resolve("sglang.srt.models.gemma2.Gemma2ForCausalLM")):
        return list(enumerate(layers))
    try:
        start, end = causal_lm.start_layer, causal_lm.end_layer
    except AttributeError as exc:
        raise NotHookable(f"{name} is not shaped like LlamaForCausalLM ({exc})") from None
    return [(i, layers[i]) for i in range(start, end)]
