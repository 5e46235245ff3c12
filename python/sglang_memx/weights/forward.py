"""One forward with remappable weights: pending layer changes first, then the timed forward."""

from __future__ import annotations

import time
from collections.abc import Callable


def run_with_weights(weights, decode: bool, shape: tuple[int, int], forward: Callable):
    """``shape``: (tokens, sequences) of the forward batch."""
    weights.pipeline.begin_forward()
    t0 = time.perf_counter()
    try:
        return forward()
    finally:
        weights.pipeline.end_forward()
        weights.note_forward(decode, time.perf_counter() - t0, weights.pipeline.last_layer_seconds, *shape)
