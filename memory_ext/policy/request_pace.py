"""Per-request TPOT: would one more request push a running request past the TPOT SLO?

The batch rule (``governor``: ``step(b) + b * q``) charges every running request the prefill stalls
of a batch turning over in steady state. In a burst that over-charges: a request sits only through
the prefills admitted after its first token, and several prefills admitted in one pass cost one
iteration, not one each. This rule looks at each running request instead.

A running request's TPOT is (seconds since its first token + what it still waits) / (tokens since
its first token + tokens it still decodes). Admitting a newcomer adds to what it waits: this pass's
prefill iteration grows by the newcomer's prompt (``PrefillTimeModel``: seconds by prefill tokens,
learned online), and every step it still decodes becomes the step of a batch one larger.

``worst_tpot``: the highest predicted TPOT with the newcomer among the running requests that are
*on time* without it (their predicted TPOT without the newcomer is within the SLO); a request that
misses the SLO anyway is not one the newcomer pushes past it, and counting it would close admission
until it finishes (harm to the queue with nothing saved). Tokens still to decode are the
request's ``max_new_tokens`` left: an upper bound when EOS ends it sooner (then the steps are
over-charged and the stall under-charged, per token). Prefills admitted later are judged when
they come, with this request among the running ones.

Numbers in, numbers out; no clock. Invariant: predictions are >= 0 or None while learning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from memory_ext.policy._checks import check_int, check_num
from memory_ext.policy.step_time import StepTimeModel

__all__ = ["PrefillTimeModel", "RunningPace", "worst_tpot"]


class RunningPace(NamedTuple("_Pace", [("elapsed_s", float), ("decoded", int), ("remaining", int)])):
    """One running request: ``elapsed_s`` since its first token, ``decoded`` tokens since it,
    ``remaining`` tokens it may still decode. A tuple, not a dataclass: the simulator builds one
    per running request at every admission question."""

    __slots__ = ()

    def __new__(cls, elapsed_s: float, decoded: int, remaining: int):
        try:
            valid = 0.0 <= elapsed_s < math.inf and type(decoded) is int and type(remaining) is int
            valid = valid and decoded >= 0 and remaining >= 0
        except TypeError:
            valid = False
        if not valid:  # the checks name the field (and accept what only the fast test refused)
            check_num("elapsed_s", elapsed_s, 0.0)
            check_int("decoded", decoded, 0)
            check_int("remaining", remaining, 0)
        return tuple.__new__(cls, (elapsed_s, decoded, remaining))

    def tpot(self, stall_s: float, step_s: float) -> float | None:
        """Its TPOT if it waits ``stall_s`` more and each remaining token takes ``step_s``; None
        when it decodes nothing (a request about to finish, or one with no token yet to come)."""
        if self.remaining <= 0:
            return None
        return (self.elapsed_s + stall_s + self.remaining * step_s) / (self.decoded + self.remaining)


class PrefillTimeModel:
    """Seconds of a prefill iteration by the prompt tokens it computes, ``t = a + b * tokens``: an
    exponentially weighted least-squares fit (``step_time.StepTimeModel``'s, the batch axis counting
    tokens; slopes kept >= 0). None while fewer than ``min_samples`` samples."""

    def __init__(self, decay: float = 0.98, min_samples: int = 4):
        self._fit = StepTimeModel(decay=decay, min_samples=min_samples, use_kv=False)

    @property
    def samples(self) -> int:
        return self._fit.samples

    @property
    def coef(self) -> tuple[float, float] | None:
        """(seconds, seconds per token), or None while learning."""
        c = self._fit.coef
        return None if c is None else (c[0], c[1])

    def observe(self, tokens: int, seconds: float) -> None:
        """One iteration computed ``tokens`` prompt tokens in ``seconds`` (beyond its decode step)."""
        check_int("tokens", tokens, 1)
        self._fit.observe(tokens, 0, seconds)

    def predict(self, tokens: int) -> float | None:
        """Seconds of a prefill iteration of ``tokens`` (0 for none); None while learning."""
        check_int("tokens", tokens, 0)
        if tokens == 0:
            return None if self.coef is None else 0.0
        return self._fit.predict(tokens, 0)


def worst_tpot(paces: Sequence[RunningPace], slo_s: float, stall_without_s: float, stall_with_s: float,
               step_without_s: float, step_with_s: float) -> float | None:  # fmt: skip
    """The highest predicted TPOT with the newcomer (``stall_with_s``, ``step_with_s``) among the
    requests on time without it (``stall_without_s``, ``step_without_s``: predicted <= ``slo_s``);
    None when no running request is on time and decodes more."""
    worst = None
    for pace in paces:
        without = pace.tpot(stall_without_s, step_without_s)
        if without is None or without > slo_s:
            continue
        with_ = pace.tpot(stall_with_s, step_with_s)
        worst = with_ if worst is None else max(worst, with_)
    return worst
