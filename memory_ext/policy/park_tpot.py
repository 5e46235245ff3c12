"""Does parking a prefill on the host keep its own TPOT within the SLO?

A request parked in the host buffer gets its first token at once, then waits, its KV on the
host, until the device has room for it beside the running requests, then decodes. Its TPOT
(time per output token after the first) therefore carries the wait. Measured on the issue's
``bench_serving`` load (docs/router.md, "Step time at equal batch size"): the running requests'
decode steps are not slower with parking, but the parked requests' inter-token p99 was 4.5-16 s
against stock's 2.8-5.3 s, and each resume costs the running requests one more prefill forward.
When the wait pushes the parked request's TPOT past the SLO, parking only turns a late first
token into late tokens after it, at that cost to the others: no predicted gain.

* ``wait_steps(free_pages, others, page, candidate, now_pages)``: the decode steps of the
  running requests (``others``, ``kv_growth.Running``; ``now_pages``: prompts under way) until the
  candidate's pages (``frees``: its KV back and its decode, all of it) fit beside the others'
  peak demand from then on (nobody preempted, as ``kv_growth.peak_shortfall`` asks); 0: now, None:
  never (every running request finishes and still too little is free). Counting the candidate
  at its full size from the start makes this an upper bound on its wait (it grows into its
  pages while the others finish), so the rule errs toward not parking, i.e. stock's behaviour.
  That peak only falls when a request finishes (``kv_growth.finish_sweep``), so the first step
  it fits is 0 or a finishing step: those are the ones tried.
* ``ParkTpot(step_s, slo_s)``: the predicted decode step (seconds, the governor's TPOT of the
  running batch with the request) and the TPOT SLO.
* ``park_keeps_tpot(park, free_pages, running, page, now_pages)``: ``running``'s last entry is the
  candidate (as ``no_harm.govern_prefill`` receives it). Predicted TPOT of the parked candidate:
  ``step_s * (wait + remaining) / remaining`` (its ``remaining`` tokens after the first); within
  the SLO (``<=``) or nothing left to decode: True. Unparked, waiting in the queue, its TPOT would
  be the step: when the step is already over the SLO, the request misses it either way and
  parking costs no TPOT it would meet (True; as the batch cap, an SLO nothing meets does not
  bind). Never room: False. The prompts under way are ``now_pages`` less its own prompt (it is
  among them when asked).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ._checks import check_int, check_num
from .kv_growth import Running, finish_sweep

__all__ = ["ParkTpot", "park_keeps_tpot", "parked_tpot_s", "wait_steps"]


@dataclass(frozen=True)
class ParkTpot:
    """The governor's numbers for the parking question: predicted decode step and TPOT SLO (s)."""

    step_s: float
    slo_s: float

    def __post_init__(self):
        check_num("step_s", self.step_s, 0.0)
        check_num("slo_s", self.slo_s, 0.0, strict=True)


def wait_steps(free_pages: int, others: Sequence[Running], page: int, candidate: Running,
               now_pages: int = 0) -> int | None:  # fmt: skip
    """Decode steps of ``others`` until ``candidate``'s pages fit beside their peak from then on
    (module docstring); 0: now, None: never. One sweep: the others' demand peaks just before a
    request finishes, so the peak from a start on is a suffix maximum over the finishing steps."""
    check_int("free_pages", free_pages)
    check_int("now_pages", now_pages)
    room = free_pages - now_pages - candidate.frees
    steps = list(finish_sweep(others, page))
    # later_peak[i]: the others' largest demand at or after finishing step i, just before it frees
    later_peak = [0] * (len(steps) + 1)
    later_peak[-1] = -(1 << 62)
    for i in range(len(steps) - 1, -1, -1):
        later_peak[i] = max(later_peak[i + 1], steps[i].grown - steps[i].freed_before)
    if room >= max(0, later_peak[0]):
        return 0
    for i, step in enumerate(steps):  # started right after the requests finishing at this step
        if room >= max(step.grown_after - step.freed_after, later_peak[i + 1]):
            return step.t
    return None


def parked_tpot_s(step_s: float, wait: int, remaining: int) -> float:
    """A parked request's TPOT: ``wait`` steps on the host, then ``remaining`` tokens at ``step_s``."""
    check_int("wait", wait)
    check_int("remaining", remaining, 1)
    return step_s * (wait + remaining) / remaining


def park_keeps_tpot(park: ParkTpot, free_pages: int, running: Sequence[Running], page: int,
                    now_pages: int = 0) -> bool:  # fmt: skip
    """Whether parking ``running[-1]`` keeps its predicted TPOT within ``park.slo_s`` (module docstring)."""
    if not running:
        raise ValueError("running must end with the candidate, got no request")
    *others, candidate = running
    if candidate.remaining == 0:
        return True  # it finishes on its first token: nothing waits
    own_prompt = math.ceil(candidate.tokens / page)
    wait = wait_steps(free_pages, others, page, candidate, max(now_pages - own_prompt, 0))
    if wait is None:
        return False
    if park.step_s > park.slo_s:
        return True  # a miss unparked too (its TPOT is the step): parking costs no TPOT it would meet
    return parked_tpot_s(park.step_s, wait, candidate.remaining) <= park.slo_s
