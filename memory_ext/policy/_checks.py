"""Input checks shared by the policies: every error is a ValueError whose
message starts with the offending field's name."""


def check_int(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
