"""Input checks of the Oneiros policies (every error is a ValueError whose message starts with
the offending field's name) and the float slack of their timing inequalities."""

from __future__ import annotations

import math

# Relative slack for the timing inequalities so that exact paper boundaries
# (e.g. 3.0 * 10 <= 1.0 * 30) are not lost to float rounding.
REL_EPS = 1e-12


def leq(a: float, b: float) -> bool:
    return a <= b + REL_EPS * max(abs(a), abs(b), 1.0)


def positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)
