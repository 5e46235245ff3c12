"""The prefills a running request waits through, per token it gets.

A running request gets a token only from an iteration that decodes it. Upstream runs a new
request's prefill as an iteration of its own (the running batch waits through it), and a mixed
iteration (chunked prefill beside the decodes, the simulator's continuous batching) takes longer
than the decode step alone. ``PrefillStalls`` measures ``q``: the stalled seconds per token
decoded over the recent busy iterations. ``stalled``: all of a prefill iteration while requests
were running, and the part of a mixed iteration beyond its predicted decode step; iterations with
nobody decoding stall nobody.

Why per token, and why the TPOT of a batch of ``b`` is ``step(b) + b * q``: each admission costs
the running batch one stall (its prefill, ``P``). A request of ``n`` output tokens lives about
``n * TPOT`` seconds, and while it runs about ``b`` others are admitted (Little's law: the batch
turns over once per lifetime, whether the server keeps up with the arrivals or works through a
backlog at its cap), so it waits through ``b * P`` of stalls over its ``n`` tokens: ``b * P / n``
per token, and ``P / n`` is what ``q`` measures (stalled seconds over tokens decoded). At the batch
the server runs this is the observed TPOT; a cap below it shrinks the stalls with the batch, as a
backlog does; one request alone waits through about one stall over its lifetime.

Numbers in, numbers out; no clock. Invariant: ``per_token() >= 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_ext.policy._checks import check_int, check_num

__all__ = ["PrefillStalls"]


@dataclass
class PrefillStalls:
    """Exponentially weighted stalled seconds and decoded tokens (each iteration counted
    multiplies the older ones' weight by ``decay``, as ``StepTimeModel`` does with its samples)."""

    decay: float = 0.98
    stalled_s: float = 0.0
    tokens: float = 0.0
    iterations: int = 0  # iterations counted (status)
    stalls: int = 0  # of which some running request waited through prefill (status)

    def __post_init__(self):
        check_num("decay", self.decay, 0.0, strict=True)
        if self.decay > 1:
            raise ValueError(f"decay must be <= 1, got {self.decay}")

    def observe(self, tokens: int, stalled_s: float) -> None:
        """One busy iteration: ``tokens`` requests got a token, and the running requests waited
        ``stalled_s`` of it through prefill."""
        check_int("tokens", tokens, 0)
        check_num("stalled_s", stalled_s, 0.0)
        d = self.decay
        self.stalled_s = d * self.stalled_s + stalled_s
        self.tokens = d * self.tokens + tokens
        self.iterations += 1
        self.stalls += stalled_s > 0

    def observe_iteration(self, seconds: float, decoded: int, stalled: int, prefilled: bool,
                          decode_step_s: float | None) -> None:  # fmt: skip
        """Classify one iteration that ran for ``seconds``: ``decoded`` requests got a token,
        ``stalled`` running requests got none (they waited), ``prefilled``: it computed some prefill.
        ``decode_step_s``: the step a pure decode of the ``decoded`` requests is predicted to take
        (None: not known yet; a mixed iteration then counts no stall)."""
        check_num("seconds", seconds, 0.0)
        check_int("decoded", decoded, 0)
        check_int("stalled", stalled, 0)
        if not prefilled or (decoded and decode_step_s is None):
            if decoded:
                self.observe(decoded, 0.0)
            return
        if decoded == 0:
            if stalled:  # a prefill iteration the running requests waited through
                self.observe(0, seconds)
            return
        self.observe(decoded, max(0.0, seconds - max(0.0, decode_step_s)))

    def per_token(self) -> float:
        """``q``: stalled seconds per decoded token (0 before any token)."""
        return self.stalled_s / self.tokens if self.tokens > 0 else 0.0

    def status(self) -> dict:
        return {"ms_per_token": round(self.per_token() * 1e3, 4), "iterations": self.iterations, "stalls": self.stalls}
