"""Input checks of the SwiftCache policies: every error is a ValueError whose message starts with
the offending field's name."""

from __future__ import annotations

import math


def number(name: str, value, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} and finite, got {value}")
    return value


def whole_bytes(name: str, value) -> int:
    """A product that must be a whole number of bytes (R2)."""
    rounded = round(value)
    if abs(value - rounded) > 1e-9:
        raise ValueError(f"{name} is not a whole number of bytes: {value}")
    return int(rounded)
