"""Upstream subsystem: model executor (``sglang.srt.model_executor``).

* ``ModelRunner.forward`` (around): with elastic KV, the activation profile is
  measured on real forwards: the first few forwards after start-up (the
  server's warm-up request among them) and later ones larger than any
  measured so far, up to ``ActivationBalloon.MEASURE_LIMIT`` in all, run
  under a ``PeakMeter`` (CUDA: allocator peak; CPU: allocations seen per
  op). Each peak feeds ``ActivationProfile.observe``, which raises the
  profile if the model needs more than its shapes predicted (never lowers it).
  On CUDA with the activation arena, every forward runs inside
  ``torch.cuda.use_mem_pool``: the tensors it allocates come from the pool's
  activation chunks (``memory_ext.pool.segment_arena``).
"""

from __future__ import annotations

import contextlib
import logging

from sglang_memx.hooks import HookSpec

logger = logging.getLogger("sglang_memx")


def around_forward(original, runner, forward_batch, *args, **kwargs):
    kv = getattr(getattr(runner, "token_to_kv_pool_allocator", None), "_memx_elastic", None)
    balloon = getattr(kv, "activation", None)
    if balloon is None:
        return original(runner, forward_batch, *args, **kwargs)
    with balloon.mempool.use() if balloon.mempool is not None else contextlib.nullcontext():
        return _measured_forward(original, balloon, runner, forward_batch, *args, **kwargs)


def _measured_forward(original, balloon, runner, forward_batch, *args, **kwargs):
    input_ids = getattr(forward_batch, "input_ids", None)
    tokens = int(input_ids.numel()) if input_ids is not None else 0
    if not balloon.wants_measurement(tokens):
        return original(runner, forward_batch, *args, **kwargs)
    from memory_ext.pool.activation_meter import PeakMeter

    meter = PeakMeter(getattr(runner, "device", "cpu"))
    try:
        meter.__enter__()
    except Exception:  # never let measuring break serving
        logger.exception("memx: cannot measure activations; the profile stays as derived")
        balloon.stop_measuring()
        return original(runner, forward_batch, *args, **kwargs)
    try:
        out = original(runner, forward_batch, *args, **kwargs)
    finally:
        meter.__exit__(None, None, None)
    balloon.record_measurement(tokens, int(getattr(forward_batch, "batch_size", 1) or 1), meter.peak_bytes)
    return out


HOOKS = (
    HookSpec(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        "around",
        around_forward,
        expects=("self", "forward_batch"),
        why="measure the activation profile on the first forwards (eLLM ballooning)",
    ),
)
