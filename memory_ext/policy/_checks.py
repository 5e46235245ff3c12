"""Input checks shared by the policies: every error is a ValueError whose
message starts with the offending field's name."""

import math


def check_int(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_num(name: str, value, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite number >= ``minimum`` (> when ``strict``; bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None:
        if strict and not value > minimum:
            raise ValueError(f"{name} must be > {minimum}, got {value}")
        if not strict and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_name(name: str, value) -> str:
    """``value`` as a non-empty str."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")
    return value
