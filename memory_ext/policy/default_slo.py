"""The TPOT SLO a governor holds when nobody gives one: ``scale`` x the solo decode step measured
at start (issue 26: "when none is given, a documented default derived from the latency measured
at start").

* **The latency**: the median of the first ``samples`` pure decode steps that ran one request
  alone. Upstream's start-up warm-up request decodes 7 tokens alone, so a server that warms up
  derives its default before the first user request; the median keeps a first, cold step out.
* **The scale** (``DEFAULT_SCALE`` = 20): what a batch cap at that SLO can cost. With the
  governor's step model ``step(b) = a + b * beta`` (``beta`` a request's share of the step, its KV
  and its prefill stalls included) and ``s`` the solo step, ``a <= s`` (slopes are never negative),
  so at the capped batch, where ``step = scale * s``, the decode throughput ``b / step(b) =
  (1 - a / (scale * s)) / beta`` is at least ``(1 - 1 / scale)`` of the ``1 / beta`` that no batch
  size exceeds, at any KV per request. Scale 20 gives up at most 5 % of the decode throughput the
  model predicts any batch could reach, and bounds TPOT at 20 solo steps. Where one request alone
  already exceeds the SLO (a long context) the governor admits as stock (``slo_infeasible``).

Invariants: derived once, then fixed (later load does not move it); until then there is none (the
governor admits as without an SLO); ``scale`` 0 turns the default off. Numbers in, decision out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from memory_ext.policy._checks import check_int, check_num

__all__ = ["DEFAULT_SAMPLES", "DEFAULT_SCALE", "SoloStepDefault", "check_scale"]

DEFAULT_SCALE = 20.0
DEFAULT_SAMPLES = 5


def check_scale(name: str, value) -> float:
    """A default-SLO scale: 0 (no default) or a finite number > 1 (at 1 or below the SLO would be
    the solo step itself, which no batch but one meets); else ValueError naming ``name``."""
    value = check_num(name, value, 0.0)
    if value != 0 and value <= 1:
        raise ValueError(f"{name} must be > 1 (or 0: no default SLO), got {value}")
    return float(value)


@dataclass
class SoloStepDefault:
    """The default TPOT SLO: ``scale`` x the median of the first ``samples`` solo decode steps."""

    scale: float = DEFAULT_SCALE
    samples: int = DEFAULT_SAMPLES
    # the first ``samples`` solo decode steps, seconds
    solo_steps: list[float] = field(default_factory=list, init=False)
    _solo_s: float | None = field(default=None, init=False, repr=False)  # their median, once complete

    def __post_init__(self) -> None:
        self.scale = check_scale("scale", self.scale)
        check_int("samples", self.samples, 1)

    @property
    def enabled(self) -> bool:
        return self.scale > 0

    @property
    def solo_step_s(self) -> float | None:
        """The measured solo decode step (None until ``samples`` of them were seen)."""
        return self._solo_s

    @property
    def slo_s(self) -> float | None:
        """The default TPOT SLO in seconds (None while off or still measuring)."""
        solo = self.solo_step_s
        return None if solo is None or not self.enabled else self.scale * solo

    def observe(self, batch: int, step_s: float) -> bool:
        """One pure decode step of ``batch`` requests; True when it completes the measurement.
        Once complete (every later decode step of the server) it returns at once."""
        if not self.enabled or len(self.solo_steps) >= self.samples:
            return False
        check_int("batch", batch, 1)
        check_num("step_s", step_s, 0.0)
        if batch != 1:
            return False
        self.solo_steps.append(float(step_s))
        if len(self.solo_steps) < self.samples:
            return False
        self._solo_s = statistics.median(self.solo_steps)  # read at every admission question: computed once
        return True

    def status(self) -> dict:
        """JSON-ready: the scale, the solo step and the samples it came from, the SLO (None until derived)."""
        solo, slo = self.solo_step_s, self.slo_s
        return {
            "scale": self.scale,
            "solo_samples": len(self.solo_steps),
            "samples_needed": self.samples,
            "solo_step_ms": None if solo is None else round(solo * 1e3, 4),
            "tpot_slo_ms": None if slo is None else round(slo * 1e3, 4),
        }
