"""``memory_ext.policy.park_tpot``: the decode steps a parked request waits for device room, checked
against a step-by-step replay, its predicted TPOT against the SLO, and ``no_harm.govern_prefill``
dropping every parking branch when that TPOT is over the SLO."""

from __future__ import annotations

import random

import pytest

from memory_ext.policy.kv_growth import Running
from memory_ext.policy.no_harm import govern_prefill
from memory_ext.policy.park_tpot import ParkTpot, park_keeps_tpot, parked_tpot_s, wait_steps
from memory_ext.policy.prefill_admission import DEFER, OFFLOAD, ON_GPU, PrefillAsk


def _pages(tokens, page):
    return -(-tokens // page)


def _replay_wait(free, others, page, cand, now):
    """Step by step: the first step ``t`` (0 or later) from which the candidate, counted at its full
    ``frees`` pages, and the others (gone once they produced their last token by then) never
    exceed ``free``."""
    longest = max((r.remaining for r in others), default=0)
    for t in range(longest + 1):
        fits = True
        for k in range(longest + 2):
            t2, used = t + k, now + cand.frees
            for r in others:
                still = t2 < r.remaining if k == 0 else t2 <= r.remaining
                used += _pages(r.tokens + t2, page) - _pages(r.tokens, page) if still else -r.frees
            if used > free:
                fits = False
                break
        if fits:
            return t
    return None


WAITS = [
    # (free pages, others as (tokens, remaining, frees), page, candidate (tokens, remaining, frees), now)
    #   -> steps
    (20, [], 1, (10, 10, 20), 0, 0),  # fits now, its decode included: no wait
    (15, [], 1, (10, 10, 20), 0, None),  # its prompt fits, its decode never will
    (0, [(10, 5, 15)], 1, (5, 10, 15), 0, 5),  # the one running request's 15 pages come back after step 5
    (0, [(10, 5, 15)], 1, (6, 10, 16), 0, None),  # ... and that is all there is
    (2, [(10, 3, 13), (10, 8, 18)], 1, (2, 2, 4), 0, 3),  # the short one frees enough beside the long one's growth
    (2, [(10, 3, 13), (10, 8, 18)], 1, (5, 15, 20), 0, 8),  # not until the long one finishes too
    (16, [(10, 2, 12)], 1, (5, 5, 10), 4, 0),  # prompts under way take their pages first: still room
    (13, [(10, 2, 12)], 1, (5, 5, 10), 4, 2),  # one page less: after the running one finishes
]


@pytest.mark.parametrize("free,others,page,cand,now,expected", WAITS)
def test_wait_steps_hand_worked(free, others, page, cand, now, expected):
    reqs, c = [Running(*r) for r in others], Running(*cand)
    assert wait_steps(free, reqs, page, c, now) == expected == _replay_wait(free, reqs, page, c, now)


@pytest.mark.parametrize("seed", range(12))
def test_wait_steps_equals_the_replay(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])

    def request(remaining_from: int) -> Running:
        tokens, remaining = rng.randint(0, 120), rng.randint(remaining_from, 60)
        return Running(tokens, remaining, _pages(tokens + remaining, page))

    reqs = [request(1) for _ in range(rng.randint(0, 12))]
    cand = request(0)
    free, now = rng.randint(0, 120), rng.randint(0, 10)
    assert wait_steps(free, reqs, page, cand, now) == _replay_wait(free, reqs, page, cand, now)


def test_parked_tpot_counts_the_wait_over_its_own_tokens():
    assert parked_tpot_s(0.1, 0, 10) == pytest.approx(0.1)  # no wait: the step
    assert parked_tpot_s(0.1, 30, 10) == pytest.approx(0.4)  # 30 steps on the host over 10 tokens


# a running request that frees its 20 pages after 9 more steps; the candidate needs 20 pages, decodes 10
OTHERS = [Running(11, 9, 20)]
CANDIDATE = Running(10, 10, 20)


@pytest.mark.parametrize(
    "slo_s,keeps",
    [
        (0.19, True),  # (9 + 10) / 10 x 0.1 s = 0.19 s: exactly at the SLO parks
        (0.18, False),  # over it: parking only moves the lateness after the first token
    ],
)
def test_park_keeps_tpot_at_the_slo(slo_s, keeps):
    assert park_keeps_tpot(ParkTpot(0.1, slo_s), 0, [*OTHERS, CANDIDATE], 1) is keeps


def test_park_keeps_tpot_edges():
    park = ParkTpot(0.1, 0.11)
    assert park_keeps_tpot(park, 0, [*OTHERS, Running(10, 0, 10)], 1)  # done on its first token: nothing waits
    assert park_keeps_tpot(park, 29, [*OTHERS, CANDIDATE], 1)  # room now beside the other's 9: its TPOT is the step
    assert park_keeps_tpot(park, 29, [*OTHERS, CANDIDATE], 1, now_pages=10)  # its own prompt is not counted twice
    assert not park_keeps_tpot(park, 28, [*OTHERS, CANDIDATE], 1)  # a page short: it waits the other's 9 steps
    assert not park_keeps_tpot(park, 0, [Running(0, 5, 5), CANDIDATE], 1)  # never room: it would wait forever
    missed_anyway = ParkTpot(0.1, 0.09)  # the step alone is over the SLO: unparked, it misses too
    assert park_keeps_tpot(missed_anyway, 0, [*OTHERS, CANDIDATE], 1)  # parked TPOT 0.19 s: no TPOT lost
    assert not park_keeps_tpot(missed_anyway, 0, [Running(0, 5, 5), CANDIDATE], 1)  # never room still refuses
    with pytest.raises(ValueError, match="^running"):
        park_keeps_tpot(park, 0, [], 1)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"step_s": -1.0}, "step_s"), ({"slo_s": 0.0}, "slo_s"), ({"slo_s": float("nan")}, "slo_s")],
)
def test_bad_park_numbers_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        ParkTpot(**({"step_s": 0.1, "slo_s": 0.2} | kwargs))


def _park_ask(budget: int, kv: int) -> PrefillAsk:
    """A request the device cannot take now (``kv`` over the room) and the buffer can."""
    return PrefillAsk(budget=budget, reserved=0, reserved_now=0, kv=kv, kv_now=0, act=0, offload_kv=10,
                      buffer_room=100)  # fmt: skip


def test_govern_prefill_parks_only_when_its_tpot_holds():
    """The same parking question with no SLO, an SLO the wait keeps and one it breaks."""
    running = [*OTHERS, CANDIDATE]
    ask = _park_ask(budget=5, kv=30)
    mech, none = govern_prefill(ask, running, 1, 0)
    assert mech.action == OFFLOAD and none.action == OFFLOAD  # harm predicted, parking protects
    _, holds = govern_prefill(ask, running, 1, 0, park=ParkTpot(0.1, 1.0))
    assert (holds.action, holds.reason) == (OFFLOAD, "park_protects_running")
    _, breaks = govern_prefill(ask, running, 1, 0, park=ParkTpot(0.1, 0.11))
    assert (breaks.action, breaks.reason) == (DEFER, "park_over_tpot")


def test_govern_prefill_drops_the_buffer_fallback_of_an_on_device_verdict():
    """On the device if upstream agrees; parking as the fallback only if its TPOT would hold."""
    ask = PrefillAsk(budget=100, reserved=0, reserved_now=0, kv=10, kv_now=0, act=0, offload_kv=10, buffer_room=100)
    running = [Running(0, 50, 60), Running(10, 10, 30)]  # the candidate needs 30 pages; 100 - 60 grown: room now
    mech, gv = govern_prefill(ask, running, 1, 0, park=ParkTpot(0.1, 0.2))
    assert (mech.action, mech.if_refused, gv.action, gv.reason) == (ON_GPU, OFFLOAD, ON_GPU, "mechanism_admits")
    tight = [Running(0, 80, 80), Running(10, 10, 30)]  # the other grows 80 of the 100: 80 steps on the host
    mech, gv = govern_prefill(ask, tight, 1, 0, park=ParkTpot(0.1, 0.2))
    assert (mech.action, mech.if_refused) == (ON_GPU, DEFER)
    assert (gv.action, gv.reason) == (ON_GPU, "park_over_tpot")  # admitted; the dropped fallback is counted
