"""Layer-by-layer timing of one iteration whose streamed layers come over a link.

The simulator's own execution model for weight streaming, deliberately not the
policies' closed forms (Select-N Fig. 7, Oneiros Eq. 4/5), so that the
intervals they pick are checked against a finer model: a compute stream runs
the ``n`` layers in order; a copy stream loads the streamed layers one after
another, each into one of ``slots`` device buffers. The k-th load (counting
across iterations) may start when the copy stream is free and the buffer it
reuses is released, i.e. when the layer loaded ``slots`` loads earlier has
finished computing; a streamed layer computes once its load is done.

Steady state: three back-to-back iterations are timed from an idle start and
the third one is returned, so the wrap-around (the first streamed layer of the
next iteration loading during the last layers of this one) is included.
Invariants: the result is >= ``n * t_c`` and >= ``len(streamed) * t_tr``, and
equals ``n * t_c`` when nothing is streamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

__all__ = ["pipeline_seconds"]


def pipeline_seconds(n: int, streamed: Sequence[int], t_c: float, t_tr: float, slots: int = 1) -> float:
    """Seconds of one steady-state iteration (module docstring).

    ``streamed``: 0-based indices of the layers loaded every iteration;
    ``t_c``: one layer's compute; ``t_tr``: one layer's load at the bandwidth
    the link gives this iteration."""
    if n < 1 or slots < 1 or t_c < 0 or t_tr < 0:
        raise ValueError(f"need n >= 1, slots >= 1, t_c >= 0, t_tr >= 0, got {n}, {slots}, {t_c}, {t_tr}")
    layers = tuple(sorted(set(streamed)))
    if layers and (layers[0] < 0 or layers[-1] >= n):
        raise ValueError(f"streamed layers must be in [0, {n}), got {layers}")
    return _pipeline(n, layers, float(t_c), float(t_tr), slots)


@lru_cache(maxsize=4096)
def _pipeline(n: int, layers: tuple[int, ...], t_c: float, t_tr: float, slots: int) -> float:
    if not layers:
        return n * t_c
    streamed = set(layers)
    load_end: list[float] = []  # per load, in load order (across iterations)
    computed: list[float] = []  # compute end of each loaded layer, same order
    copy_free = t = 0.0
    ends = []
    for _ in range(3):
        for j in range(n):
            if j not in streamed:
                t += t_c
                continue
            k = len(computed)
            while len(load_end) <= k:  # FIFO copy stream; a load waits for its buffer
                q = len(load_end)
                release = computed[q - slots] if q >= slots else 0.0
                copy_free = max(copy_free, release) + t_tr
                load_end.append(copy_free)
            t = max(t, load_end[k]) + t_c
            computed.append(t)
        ends.append(t)
    return ends[2] - ends[1]
