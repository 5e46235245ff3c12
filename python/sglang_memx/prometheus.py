"""Prometheus text exposition format 0.0.4: the one renderer behind ``/memx/metrics``
(``sglang_memx.metrics``) and the router's ``/metrics`` (``sglang_memx.serve.metrics``).

* ``labels_text(labels)``: ``{k="v",...}`` with keys sorted and ``\\`` / ``"`` escaped in values
  (empty string for no labels).
* ``number(value)``: a sample value as ``float`` with 17 significant digits (``1``, ``0.5``,
  ``inf``).
* ``sample(name, labels, value)``: one sample line; ``value`` is printed as given (``number(v)``
  for a float, or an int count printed as is).
* ``Histogram``: cumulative ``le`` buckets then ``+Inf``, ``_sum`` and ``_count``.
* ``Samples``: sample lines collected by family name (``add``, ``extend``).
* ``render(families, samples)``: one ``# HELP`` / ``# TYPE`` block per family that has samples,
  in the order of ``families``, newline-terminated.

``prometheus_client`` is not used: its value formatting and label order differ from what
dashboards and tests of memx read today.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["CONTENT_TYPE", "Histogram", "Samples", "labels_text", "number", "render", "sample"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def labels_text(labels: Mapping[str, Any]) -> str:
    """``{k="v",...}`` sorted by key, values as ``str`` with backslash and double quote escaped."""
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def number(value: float) -> str:
    """A sample value as text: ``float(value)`` with 17 significant digits (round-trips)."""
    return f"{float(value):.17g}"


def sample(name: str, labels: Mapping[str, Any], value: Any) -> str:
    """One sample line; ``value`` is printed as given (``number(v)``, or an int)."""
    return f"{name}{labels_text(labels)} {value}"


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, then +Inf)."""

    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: Mapping[str, Any]) -> list[str]:
        """The ``_bucket`` lines (cumulative counts), ``_sum`` and ``_count`` of ``name``."""
        out, acc = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            acc += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(sample(f"{name}_bucket", {**labels, "le": le}, acc))
        out.append(sample(f"{name}_sum", labels, number(self.sum)))
        out.append(sample(f"{name}_count", labels, self.count))
        return out


class Samples:
    """Sample lines by family name, each family's lines in the order they were added."""

    def __init__(self) -> None:
        self.by_name: dict[str, list[str]] = {}

    def add(self, name: str, labels: Mapping[str, Any], value: Any) -> None:
        """Append ``sample(name, labels, value)`` to family ``name``."""
        self.by_name.setdefault(name, []).append(sample(name, labels, value))

    def extend(self, name: str, lines: Iterable[str]) -> None:
        """Append ready lines (a histogram's) to family ``name``."""
        self.by_name.setdefault(name, []).extend(lines)


def render(families: Mapping[str, tuple[str, str]], samples: Samples | Mapping[str, Sequence[str]]) -> str:
    """``families``: name -> (type, help), in output order; ``samples``: a ``Samples`` or name ->
    sample lines. A family without samples is left out (as is a sample of a family not listed);
    the text ends with a newline (just one when empty)."""
    by_name = samples.by_name if isinstance(samples, Samples) else samples
    out: list[str] = []
    for name, (kind, text) in families.items():
        lines = by_name.get(name)
        if not lines:
            continue
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"
