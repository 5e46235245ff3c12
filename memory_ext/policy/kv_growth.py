"""The running requests' KV growth in pages, read at the steps where one of them finishes.

``Running`` is one request that will hold KV: the tokens it holds now, the tokens it may still
generate, the pages it gives back when it finishes. ``finish_sweep(running, page)`` walks the
distinct finishing steps in order (a request with ``remaining`` tokens to go produces its last
one at step ``remaining``) and yields, for each step ``t``, ``FinishStep``: the pages every
request still decoding at ``t`` has added by then (``grown``, the finishers included: they wrote
their last token), the pages the requests that finished before ``t`` gave back (``freed_before``),
and the same two after the finishers at ``t`` have gone (``grown_after``, ``freed_after``).

At step ``t`` a request holding ``c`` tokens has added ``ceil((c + t) / page) - ceil(c / page)``
pages; between two finishing steps demand only grows and room only shrinks, so the finishing
steps are where the peak demand (just before they free) and the most room (just after) are.
Exact for known remaining lengths; a cost of one sort and one sweep.

``peak_shortfall(free_pages, running, page, now_pages)``: the largest number of pages the running
requests (and ``now_pages`` taken at once: a candidate's prompt, prefills under way) will need
beyond ``free_pages`` at any future decode step, with no further admission (<= 0: nobody is ever
preempted); the peak is just before a request finishes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ._checks import check_int

__all__ = ["FinishStep", "Running", "finish_sweep", "peak_shortfall"]


@dataclass(frozen=True)
class Running:
    """One request that will hold KV: ``tokens`` it holds now (prompt + generated), ``remaining``
    tokens it may still generate, ``frees`` pages it gives back when it finishes (its own, not
    a shared prefix's)."""

    tokens: int
    remaining: int
    frees: int


@dataclass(frozen=True)
class FinishStep:
    """The pages at one finishing step ``t`` (module docstring)."""

    t: int
    grown: int
    freed_before: int
    grown_after: int
    freed_after: int


def finish_sweep(running: Sequence[Running], page: int) -> Iterator[FinishStep]:
    """The finishing steps of ``running`` in order, each with its pages (module docstring)."""
    check_int("page", page, 1)
    reqs = sorted(running, key=lambda r: r.remaining)
    for r in reqs:
        check_int("tokens", r.tokens)
        check_int("remaining", r.remaining)
        check_int("frees", r.frees)
    # slack[o]: requests with o free token slots in their last page; one with slack o has added
    # q + 1 - [o > s] pages after t steps, t - 1 = q * page + s (0 before its first step)
    slack_count = [0] * page
    for r in reqs:
        slack_count[(-r.tokens) % page] += 1
    alive, freed, i = len(reqs), 0, 0

    def grown_at(t: int) -> int:
        if t <= 0:
            return 0
        q, s = divmod(t - 1, page)
        return alive * (q + 1) - sum(slack_count[s + 1 :])

    while i < len(reqs):
        t = reqs[i].remaining
        grown, freed_before = grown_at(t), freed
        while i < len(reqs) and reqs[i].remaining == t:  # they finish: their pages come back
            r = reqs[i]
            freed += r.frees
            slack_count[(-r.tokens) % page] -= 1
            alive -= 1
            i += 1
        yield FinishStep(t, grown, freed_before, grown_at(t), freed)


def peak_shortfall(free_pages: int, running: Sequence[Running], page: int, now_pages: int = 0) -> int:
    """Largest future demand beyond ``free_pages`` (module docstring); <= 0: no preemption predicted."""
    check_int("free_pages", free_pages)
    check_int("now_pages", now_pages)
    peak = now_pages
    for step in finish_sweep(running, page):
        if step.t > 0:
            peak = max(peak, now_pages + step.grown - step.freed_before)
    return peak - free_pages
