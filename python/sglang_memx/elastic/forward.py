"""One forward of the model under elastic KV's activation balloon (eLLM E1/E2).

The activation profile is measured on real forwards: the first few after start-up (the
server's warm-up request among them) and later ones larger than any measured so far, up
to ``ActivationBalloon.MEASURE_LIMIT`` in all, run under a ``PeakMeter`` (CUDA: allocator
peak; CPU: allocations seen per op). Each peak feeds ``ActivationProfile.observe``, which
raises the profile if the model needs more than its shapes predicted (never lowers it).
On CUDA with the activation arena, every forward runs inside the arena's MemPool: the
tensors it allocates come from the pool's activation chunks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from memory_ext.pool.activation_meter import PeakMeter

logger = logging.getLogger("sglang_memx")


def run_forward(balloon, device: str, shape: tuple[int, int], forward: Callable):
    with balloon.mempool.use() if balloon.mempool is not None else contextlib.nullcontext():
        tokens, seqs = shape
        if not balloon.wants_measurement(tokens):
            return forward()
        meter = PeakMeter(device)
        try:
            meter.__enter__()
        except Exception:  # never let measuring break serving
            logger.exception("memx: cannot measure activations; the profile stays as derived")
            balloon.stop_measuring()
            return forward()
        try:
            out = forward()
        finally:
            meter.__exit__(None, None, None)
        balloon.record_measurement(tokens, max(seqs, 1), meter.peak_bytes)
        return out
