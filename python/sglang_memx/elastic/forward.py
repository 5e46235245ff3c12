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
METER_FAILED = 1 << 62  # a peak no forward reaches: the ranks' maximum then says some meter failed


def run_forward(balloon, device: str, shape: tuple[int, int], forward: Callable,
                agree: Callable[[int], int] | None = None):  # fmt: skip
    """``forward()`` under the balloon, measured when the balloon wants it. ``agree``: at tensor
    parallel size > 1, the ranks' largest peak (``RankAgreement.max_over_ranks``); every rank measures
    the same forwards and records the same peak, and a meter that failed on any rank (``METER_FAILED``,
    larger than any peak) stops the measuring on all."""
    with balloon.mempool.use() if balloon.mempool is not None else contextlib.nullcontext():
        tokens, seqs = shape
        if not balloon.wants_measurement(tokens):
            return forward()
        meter = PeakMeter(device)
        try:
            meter.__enter__()
        except Exception:  # never let measuring break serving
            logger.exception("memx: cannot measure activations; the profile stays as derived")
            meter = None
        try:
            out = forward()
        finally:
            if meter is not None:
                meter.__exit__(None, None, None)
        peak = METER_FAILED if meter is None else meter.peak_bytes
        if agree is not None:  # one collective: a failed meter on any rank is the largest value
            peak = agree(peak)
        if peak == METER_FAILED:
            balloon.stop_measuring()
        else:
            balloon.record_measurement(tokens, max(seqs, 1), peak)
        return out
