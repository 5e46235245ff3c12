"""Input checks of the Select-N policies (every error is a ValueError whose message starts with
the offending field's name) and the float slack of their comparisons."""

from __future__ import annotations

import math

# Relative slack for float comparisons of modelled latency against a budget.
EPS = 1e-9


def positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def positive_number(name: str, v, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)
