"""``memory_ext.policy.no_harm``: the governor's "do no harm" verdict over a mechanism's admission
(table-driven, "do nothing" included) and the running requests' predicted peak KV demand, checked
against a step-by-step replay."""

from __future__ import annotations

import random

import pytest

from memory_ext.policy.no_harm import (
    NO_PREDICTED_GAIN,
    REASONS,
    STOCK,
    STOCK_ELSE_PARK,
    GovernedVerdict,
    Running,
    judge_with_governor,
    peak_shortfall,
)
from memory_ext.policy.prefill_admission import DEFER, OFFLOAD, ON_GPU

# (mechanism's verdict, harm predicted, governor's batch decision, parking keeps its TPOT) -> (action, reason)
VERDICTS = [
    # do nothing: the mechanism admits, nothing is harmed, the batch may grow -> its admission stands
    (ON_GPU, False, True, True, ON_GPU, "mechanism_admits"),
    (ON_GPU, False, True, False, ON_GPU, "mechanism_admits"),  # no parking asked: the TPOT check is moot
    # the TPOT batch decision refuses first, whatever the mechanism says
    (ON_GPU, False, False, True, DEFER, "over_slo"),
    (OFFLOAD, False, False, True, DEFER, "over_slo"),
    (OFFLOAD, True, False, False, DEFER, "over_slo"),
    (DEFER, False, False, True, DEFER, "over_slo"),
    (DEFER, True, False, True, DEFER, "over_slo"),
    # admitting on the device would preempt a running request: defer, or park if the mechanism would
    (ON_GPU, True, True, True, DEFER, "protects_running"),
    (ON_GPU, True, True, False, DEFER, "protects_running"),
    (DEFER, True, True, True, DEFER, "protects_running"),
    (DEFER, True, True, False, DEFER, "protects_running"),
    (OFFLOAD, True, True, True, OFFLOAD, "park_protects_running"),
    # ... unless its own wait for room puts its TPOT over the SLO: it waits instead
    (OFFLOAD, True, True, False, DEFER, "park_over_tpot"),
    # no predicted harm: a refusal or a parking stock would not make goes to stock's own admission
    (DEFER, False, True, True, STOCK, "no_predicted_gain"),
    (DEFER, False, True, False, STOCK, "no_predicted_gain"),
    (OFFLOAD, False, True, True, STOCK_ELSE_PARK, "stock_first"),
    # ... without the buffer when parking would put its TPOT over the SLO
    (OFFLOAD, False, True, False, STOCK, "park_over_tpot"),
]


@pytest.mark.parametrize("mechanism,harm,batch,keeps,action,reason", VERDICTS)
def test_judge_with_governor(mechanism, harm, batch, keeps, action, reason):
    assert judge_with_governor(mechanism, harm, batch, keeps) == GovernedVerdict(action, reason)


def test_the_table_covers_every_reason_and_every_input():
    assert {row[5] for row in VERDICTS} == set(REASONS)
    every = {(m, h, True, k) for m in (ON_GPU, OFFLOAD, DEFER) for h in (False, True) for k in (False, True)}
    assert {row[:4] for row in VERDICTS} >= every


def test_a_refusal_needs_a_predicted_gain():
    """``DEFER`` only with harm predicted or the batch refused (the module's invariant)."""
    for m in (ON_GPU, OFFLOAD, DEFER):
        for keeps in (True, False):
            assert judge_with_governor(m, harm=False, batch_admits=True, park_keeps_tpot=keeps).action != DEFER
    assert judge_with_governor(DEFER, False).reason == NO_PREDICTED_GAIN


@pytest.mark.parametrize(
    "args,field",
    [
        (("maybe", False, True), "mechanism"),
        ((ON_GPU, 1, True), "harm"),
        ((ON_GPU, False, None), "batch_admits"),
        ((OFFLOAD, False, True, "no"), "park_keeps_tpot"),
    ],
)
def test_bad_verdict_input_names_the_field(args, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        judge_with_governor(*args)


def test_bad_verdict_values_are_refused():
    with pytest.raises(ValueError, match="^action"):
        GovernedVerdict("drop", NO_PREDICTED_GAIN)
    with pytest.raises(ValueError, match="^reason"):
        GovernedVerdict(DEFER, "because")


# ---------------------------------------------------------------- peak_shortfall
def _replay(free, running, page, now):
    """Step by step: pages each running request has added at step t, minus what finished ones freed."""
    worst = now
    horizon = max((r.remaining for r in running), default=0)
    for t in range(1, horizon + 1):
        demand = now
        for r in running:
            if t <= r.remaining:
                demand += -(-(r.tokens + t) // page) - (-(-r.tokens // page))
            else:
                demand -= r.frees
        worst = max(worst, demand)
    return worst - free


PEAKS = [
    # (free pages, running as (tokens, remaining, frees), page, now pages) -> shortfall
    (10, [], 1, 0, -10),  # nothing running, nothing asked: do nothing, all free
    (10, [], 1, 4, -6),  # a candidate's prompt only
    (5, [(10, 3, 13)], 1, 0, -2),  # one request grows 3 tokens then frees
    (2, [(10, 3, 13)], 1, 0, 1),  # ... which 2 free pages cannot hold
    (4, [(10, 4, 14), (10, 1, 11)], 1, 0, -2),  # the short one frees 11 before the long one peaks
    (0, [(16, 1, 2), (15, 1, 1)], 16, 0, 1),  # a full page needs a new one, a page with room does not
    (3, [(10, 20, 2), (0, 40, 3)], 16, 2, 2),  # pages, slack and an immediate prompt together
]


@pytest.mark.parametrize("free,running,page,now,expected", PEAKS)
def test_peak_shortfall_hand_worked(free, running, page, now, expected):
    reqs = [Running(*r) for r in running]
    assert peak_shortfall(free, reqs, page, now) == expected == _replay(free, reqs, page, now)


@pytest.mark.parametrize("seed", range(6))
def test_peak_shortfall_equals_the_replay(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    reqs = []
    for _ in range(rng.randint(1, 25)):
        tokens, remaining = rng.randint(0, 300), rng.randint(0, 120)
        reqs.append(Running(tokens, remaining, -(-(tokens + remaining) // page)))
    free, now = rng.randint(0, 200), rng.randint(0, 30)
    assert peak_shortfall(free, reqs, page, now) == _replay(free, reqs, page, now)


def test_peak_shortfall_does_not_depend_on_order():
    reqs = [Running(30, 5, 3), Running(7, 50, 4), Running(64, 5, 5)]
    assert peak_shortfall(3, reqs, 16) == peak_shortfall(3, reqs[::-1], 16)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"free_pages": -1}, "free_pages"),
        ({"page": 0}, "page"),
        ({"now_pages": 1.5}, "now_pages"),
        ({"running": [Running(-1, 1, 1)]}, "tokens"),
        ({"running": [Running(1, True, 1)]}, "remaining"),
        ({"running": [Running(1, 1, -2)]}, "frees"),
    ],
)
def test_peak_shortfall_bad_input_names_the_field(kwargs, field):
    args = {"free_pages": 4, "running": [], "page": 1, "now_pages": 0} | kwargs
    with pytest.raises(ValueError, match=f"^{field}"):
        peak_shortfall(**args)


# ---------------------------------------------------------------- govern_prefill (the one call of both paths)
def _ask(budget, act=0, reserved=0, kv=1):
    from memory_ext.policy.prefill_admission import PrefillAsk

    return PrefillAsk(budget=budget, reserved=reserved, reserved_now=0, kv=kv, kv_now=0, act=act)


@pytest.mark.parametrize(
    "ask,unit,harm",
    [
        (_ask(32, act=0), 1, False),  # 32 tokens of room = the 2 pages the running request grows into
        (_ask(40, act=8), 1, False),  # the batch's activation is not room: still 32 tokens
        (_ask(40, act=9), 1, True),  # 31 tokens: one page short
        (_ask(2), 16, False),  # the same room asked in pages (the simulator's blocks)
        (_ask(1), 16, True),
    ],
)
def test_govern_prefill_room_is_the_budget_less_the_batch_activation(ask, unit, harm):
    from memory_ext.policy.no_harm import govern_prefill

    running = [Running(0, 32, 2)]  # grows by 32 tokens (2 pages of 16), then frees 2
    verdict, governed = govern_prefill(ask, running, 16, 0, ask_unit=unit)
    assert verdict.action == ON_GPU
    assert governed == judge_with_governor(ON_GPU, harm)


def test_govern_prefill_do_nothing_and_bad_unit():
    from memory_ext.policy.no_harm import govern_prefill

    verdict, governed = govern_prefill(_ask(100), [], 1, 0)  # nothing runs, room for all: the mechanism decides
    assert (verdict.action, governed.action, governed.reason) == (ON_GPU, ON_GPU, "mechanism_admits")
    with pytest.raises(ValueError, match="^ask_unit"):
        govern_prefill(_ask(100), [], 1, 0, ask_unit=0)
