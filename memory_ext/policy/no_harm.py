"""Do no harm: a mechanism's admission decision passes the governor only where the predicted
effect on the running requests' SLOs is not worse than stock's.

Numbers in, one verdict out. Two questions:

* ``peak_shortfall(free_pages, running, page, now_pages)``: the running requests (each its KV
  tokens now, the tokens it may still generate and the pages it frees when it finishes) and a
  candidate's immediate pages, with no further admission: the largest number of pages they will
  need beyond ``free_pages`` at any future decode step (<= 0: nobody is ever preempted). Exact
  for known remaining lengths (the simulator's output lengths; the server passes upstream's own
  estimate, the remaining ``max_new_tokens`` times its new-token ratio): at step ``t`` a request
  holding ``c`` tokens has added ``ceil((c + t) / page) - ceil(c / page)`` pages while it runs,
  and has freed its pages once it has produced its last token. The peak is at one of the steps
  where a request produces its last token (in between, demand only grows), so it costs a sort
  and one sweep.
* ``govern_prefill(ask, running, page, now_pages, batch_admits)``: the one call both the server's
  admission hook and the simulator's ``governed_ellm`` scheduler make: eLLM's verdict
  (``judge_prefill(ask)``), the harm prediction against the room the running requests may grow
  into (``room``, converted to pages) and the governed verdict below.
* ``judge_with_governor(mechanism, harm, batch_admits)``: the mechanism's verdict
  (``prefill_admission``: ``ON_GPU`` / ``OFFLOAD`` / ``DEFER``), whether admitting the request on
  the device is predicted to preempt a running request (``harm``: ``peak_shortfall > 0``) and the
  governor's TPOT batch decision. In order (``REASONS``):

  1. ``OVER_SLO``: the governor refuses batch growth (the running requests' predicted TPOT): defer;
  2. ``PARK_PROTECTS``: harm predicted, the mechanism would park its KV: park (nothing
     running loses its KV to it);
  3. ``PROTECTS_RUNNING``: harm predicted: defer (the gain: no running request is preempted);
  4. ``MECHANISM_ADMITS``: the mechanism admits on the device (ballooning included): admit;
  5. ``STOCK_FIRST``: the mechanism would park a request stock may admit on the device: stock's
     own admission decides, parking only if stock refuses (parking costs the request a fetch
     before its first decode, a TPOT loss with no gain when the device has room);
  6. ``NO_PREDICTED_GAIN``: the mechanism defers (its decode reserve, its activation cost, a
     parked request ahead) but nothing running is predicted to lose its KV: stock's own admission
     decides (a refusal stock would not make is allowed only with a predicted gain).

Invariant: ``DEFER`` only with a predicted gain (a TPOT within SLO, a running request kept) or
when the caller's stock admission refuses too; nothing is ever dropped (a deferred request waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._checks import check_int
from .prefill_admission import DEFER, OFFLOAD, ON_GPU, PrefillAsk, PrefillVerdict, judge_prefill

__all__ = [
    "STOCK",
    "STOCK_ELSE_PARK",
    "GovernedVerdict",
    "Running",
    "REASONS",
    "govern_prefill",
    "judge_with_governor",
    "peak_shortfall",
]

STOCK = "stock"  # stock's own admission decides (no mechanism memory)
STOCK_ELSE_PARK = "stock_else_park"  # stock's own admission; if it refuses, park the KV
ACTIONS = (ON_GPU, OFFLOAD, DEFER, STOCK, STOCK_ELSE_PARK)

OVER_SLO = "over_slo"
PARK_PROTECTS = "park_protects_running"
PROTECTS_RUNNING = "protects_running"
MECHANISM_ADMITS = "mechanism_admits"
STOCK_FIRST = "stock_first"
NO_PREDICTED_GAIN = "no_predicted_gain"
REASONS = (OVER_SLO, PARK_PROTECTS, PROTECTS_RUNNING, MECHANISM_ADMITS, STOCK_FIRST, NO_PREDICTED_GAIN)


@dataclass(frozen=True)
class Running:
    """One request that will hold KV: ``tokens`` it holds now (prompt + generated), ``remaining``
    tokens it may still generate, ``frees`` pages it gives back when it finishes (its own, not
    a shared prefix's)."""

    tokens: int
    remaining: int
    frees: int


@dataclass(frozen=True)
class GovernedVerdict:
    """``action``: one of ``ON_GPU``, ``OFFLOAD`` (park), ``DEFER``, ``STOCK``, ``STOCK_ELSE_PARK``;
    ``reason``: one of ``REASONS``."""

    action: str
    reason: str

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if self.reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {self.reason!r}")


def peak_shortfall(free_pages: int, running: Sequence[Running], page: int, now_pages: int = 0) -> int:
    """Largest future demand beyond ``free_pages`` (module docstring); <= 0: no preemption predicted.
    ``now_pages``: pages taken at once (a candidate's prompt, prefills under way)."""
    check_int("free_pages", free_pages)
    check_int("page", page, 1)
    check_int("now_pages", now_pages)
    reqs = sorted(running, key=lambda r: r.remaining)
    for r in reqs:
        check_int("tokens", r.tokens)
        check_int("remaining", r.remaining)
        check_int("frees", r.frees)
    # slack[i]: free token slots in the last page; a request with slack o has added
    # q + 1 - [o > s] pages after t steps, t - 1 = q * page + s (0 before its first step)
    slack_count = [0] * page
    for r in reqs:
        slack_count[(-r.tokens) % page] += 1
    alive = len(reqs)
    freed = 0
    peak = now_pages
    i = 0
    while i < len(reqs):
        t = reqs[i].remaining  # the last step of every request with this remaining length
        if t > 0:
            q, s = divmod(t - 1, page)
            grown = alive * (q + 1) - sum(slack_count[s + 1 :])
            peak = max(peak, now_pages + grown - freed)
        while i < len(reqs) and reqs[i].remaining == t:  # they finish: their pages come back
            r = reqs[i]
            freed += r.frees
            slack_count[(-r.tokens) % page] -= 1
            alive -= 1
            i += 1
    return peak - free_pages


def judge_with_governor(mechanism: str, harm: bool, batch_admits: bool = True) -> GovernedVerdict:
    """The mechanism's verdict passed through the governor (module docstring, rules 1-6)."""
    if mechanism not in (ON_GPU, OFFLOAD, DEFER):
        raise ValueError(f"mechanism must be {ON_GPU!r}, {OFFLOAD!r} or {DEFER!r}, got {mechanism!r}")
    for name, v in (("harm", harm), ("batch_admits", batch_admits)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    if not batch_admits:
        return GovernedVerdict(DEFER, OVER_SLO)
    if harm:
        if mechanism == OFFLOAD:
            return GovernedVerdict(OFFLOAD, PARK_PROTECTS)
        return GovernedVerdict(DEFER, PROTECTS_RUNNING)
    if mechanism == ON_GPU:
        return GovernedVerdict(ON_GPU, MECHANISM_ADMITS)
    if mechanism == OFFLOAD:
        return GovernedVerdict(STOCK_ELSE_PARK, STOCK_FIRST)
    return GovernedVerdict(STOCK, NO_PREDICTED_GAIN)


def govern_prefill(ask: PrefillAsk, running: Sequence[Running], page: int, now_pages: int,
                   batch_admits: bool = True, ask_unit: int = 1,
                   room: int | None = None) -> tuple[PrefillVerdict, GovernedVerdict]:  # fmt: skip
    """The mechanism's verdict for one prefill and that verdict passed through the governor
    (module docstring): ``running`` includes the candidate, ``now_pages`` its prompt's pages (and
    any prompt under way). ``room`` (ask units): what they may grow into; default the ask's
    budget less the batch's activation (the server, whose KV grows into idle activation and whose
    later batches wait for their activation instead of preempting); the simulator passes its free
    + evictable KV (its later iterations need the activation reserve back). ``ask_unit``: tokens
    per ask unit (the server asks in tokens: 1; the simulator in blocks: ``page``)."""
    check_int("ask_unit", ask_unit, 1)
    if room is None:
        room = ask.budget - ask.act
    verdict = judge_prefill(ask)
    harm = peak_shortfall(max(room, 0) * ask_unit // page, running, page, now_pages) > 0
    return verdict, judge_with_governor(verdict.action, harm, batch_admits)
