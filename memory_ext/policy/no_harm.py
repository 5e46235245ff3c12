"""Do no harm: a mechanism's admission decision passes the governor only where the predicted
effect on the running requests' SLOs is not worse than stock's.

Numbers in, one verdict out. Two questions:

* ``peak_shortfall(free_pages, running, page, now_pages)`` (``kv_growth``'s, re-exported): the
  running requests (each its KV tokens now, the tokens it may still generate and the pages it
  frees when it finishes) and a candidate's immediate pages, with no further admission: the
  largest number of pages they will need beyond ``free_pages`` at any future decode step (<= 0:
  nobody is ever preempted). Exact for known remaining lengths (the simulator's output lengths;
  the server passes upstream's own estimate, the remaining ``max_new_tokens`` times its
  new-token ratio): at step ``t`` a request holding ``c`` tokens has added ``ceil((c + t) /
  page) - ceil(c / page)`` pages while it runs, and has freed its pages once it has produced its
  last token. The peak is at one of the steps where a request produces its last token (in
  between, demand only grows), so it costs a sort and one sweep.
* ``govern_prefill(ask, running, page, now_pages, batch_admits)``: the one call both the server's
  admission hook and the simulator's ``governed_ellm`` scheduler make: eLLM's verdict
  (``judge_prefill(ask)``), the harm prediction against the room the running requests may grow
  into (``room``, converted to pages) and the governed verdict below.
* ``judge_with_governor(mechanism, harm, batch_admits, park_keeps_tpot)``: the mechanism's verdict
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
  7. ``PARK_OVER_TPOT``: rule 2 or 5 would park, but with a TPOT SLO the parked request's own
     predicted TPOT, its wait on the host for device room included, is over it
     (``park_tpot.park_keeps_tpot``): parking would only trade its late first token for late
     tokens after it, and cost the running requests a resume forward. Rule 2's parking becomes
     a deferral, rule 5's stock's own admission without the buffer; an on-device admission
     whose fallback was the buffer keeps its action, loses the fallback and counts here
     (``govern_prefill``).

Invariant: ``DEFER`` only with a predicted gain (a TPOT within SLO, a running request kept) or
when the caller's stock admission refuses too; nothing is ever dropped (a deferred request waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._checks import check_int
from .kv_growth import Running, peak_shortfall
from .park_tpot import ParkTpot, park_keeps_tpot
from .prefill_admission import DEFER, OFFLOAD, ON_GPU, PrefillAsk, PrefillVerdict, judge_prefill

__all__ = [
    "STOCK",
    "STOCK_ELSE_PARK",
    "GovernedVerdict",
    "ParkTpot",
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
PARK_OVER_TPOT = "park_over_tpot"
REASONS = (OVER_SLO, PARK_PROTECTS, PROTECTS_RUNNING, MECHANISM_ADMITS, STOCK_FIRST, NO_PREDICTED_GAIN, PARK_OVER_TPOT)


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


def judge_with_governor(mechanism: str, harm: bool, batch_admits: bool = True,
                        park_keeps_tpot: bool = True) -> GovernedVerdict:  # fmt: skip
    """The mechanism's verdict passed through the governor (module docstring, rules 1-6; with
    ``park_keeps_tpot`` False, a parking in rules 2 and 5 becomes rule 7's)."""
    if mechanism not in (ON_GPU, OFFLOAD, DEFER):
        raise ValueError(f"mechanism must be {ON_GPU!r}, {OFFLOAD!r} or {DEFER!r}, got {mechanism!r}")
    for name, v in (("harm", harm), ("batch_admits", batch_admits), ("park_keeps_tpot", park_keeps_tpot)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")
    if not batch_admits:
        return GovernedVerdict(DEFER, OVER_SLO)
    if harm:
        if mechanism != OFFLOAD:
            return GovernedVerdict(DEFER, PROTECTS_RUNNING)
        if not park_keeps_tpot:
            return GovernedVerdict(DEFER, PARK_OVER_TPOT)
        return GovernedVerdict(OFFLOAD, PARK_PROTECTS)
    if mechanism == ON_GPU:
        return GovernedVerdict(ON_GPU, MECHANISM_ADMITS)
    if mechanism == OFFLOAD:
        if not park_keeps_tpot:
            return GovernedVerdict(STOCK, PARK_OVER_TPOT)
        return GovernedVerdict(STOCK_ELSE_PARK, STOCK_FIRST)
    return GovernedVerdict(STOCK, NO_PREDICTED_GAIN)


def govern_prefill(ask: PrefillAsk, running: Sequence[Running], page: int, now_pages: int,
                   batch_admits: bool = True, ask_unit: int = 1, room: int | None = None,
                   park: ParkTpot | None = None) -> tuple[PrefillVerdict, GovernedVerdict]:  # fmt: skip
    """The mechanism's verdict for one prefill and that verdict passed through the governor
    (module docstring): ``running`` includes the candidate, ``now_pages`` its prompt's pages (and
    any prompt under way). ``room`` (ask units): what they may grow into; default the ask's
    budget less the batch's activation (the server, whose KV grows into idle activation and whose
    later batches wait for their activation instead of preempting); the simulator passes its free
    + evictable KV (its later iterations need the activation reserve back). ``ask_unit``: tokens
    per ask unit (the server asks in tokens: 1; the simulator in blocks: ``page``). ``park``: the
    governor's step and TPOT SLO (``park_tpot``; None: no TPOT SLO or no prediction yet, parking
    is judged as before); when parking the candidate (``running``'s last entry) would put its own
    TPOT over the SLO, no branch parks it: rule 7, and an on-device verdict loses its buffer
    fallback (``if_refused``; admitted on the device, the governed verdict is then ``ON_GPU`` with
    reason ``PARK_OVER_TPOT``, so that the dropped fallback is counted)."""
    check_int("ask_unit", ask_unit, 1)
    if room is None:
        room = ask.budget - ask.act
    verdict = judge_prefill(ask)
    free_pages = max(room, 0) * ask_unit // page
    harm = peak_shortfall(free_pages, running, page, now_pages) > 0
    parks = verdict.action == OFFLOAD or verdict.if_refused == OFFLOAD  # asked only where parking is at stake
    keeps = park is None or not parks or park_keeps_tpot(park, free_pages, running, page, now_pages)
    dropped = not keeps and verdict.if_refused == OFFLOAD
    if dropped:
        verdict = PrefillVerdict(ON_GPU)
    governed = judge_with_governor(verdict.action, harm, batch_admits, keeps)
    if dropped and governed.action == ON_GPU:  # admitted on the device without its fallback: rule 7's count
        governed = GovernedVerdict(ON_GPU, PARK_OVER_TPOT)
    return verdict, governed
