"""How the docs' tables write a set of figures, shared by every renderer.

* ``median_range(values, fmt)``: ``median [min, max]`` (the median of an even count is the mean of
  the middle two, ``statistics.median``);
* ``stat_range(st, fmt)``: the same from a ``{median, min, max}`` record; ``–`` when one is NaN;
* ``span(values, fmt)``: ``lo–hi``, or one value when both ends print the same.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

__all__ = ["median_range", "span", "stat_range"]


def median_range(values: Sequence[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def stat_range(st: Mapping[str, float], fmt: str = ".3f") -> str:
    ends = (st["median"], st["min"], st["max"])
    if any(isinstance(v, float) and math.isnan(v) for v in ends):
        return "–"
    return f"{ends[0]:{fmt}} [{ends[1]:{fmt}}, {ends[2]:{fmt}}]"


def span(values: Sequence[float], fmt: str = "") -> str:
    lo, hi = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return lo if lo == hi else f"{lo}–{hi}"
