"""``judge_prefill``: one prefill's admission question, its whole verdict asked once.

The server's admission used to ask the old one-answer rule up to three times per request (the
verdict; with the request's device KV set to "never fits" for a buffer-only answer when a parked
request was ahead or upstream refused it; with the buffer's room also "never fits" to tell a full
buffer from a refusal). ``OLD_FLOW`` below is that flow, kept as the reference: every case of the
table and every point of a small grid must be decided as it decided.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from memory_ext.policy.prefill_admission import DEFER, OFFLOAD, ON_GPU, PrefillAsk, PrefillVerdict, judge_prefill

NEVER_FITS = 1 << 62


def _old_admit_prefill(ask: PrefillAsk) -> str:
    """The one-answer rule as it stood (Alg. 1 lines 5-11)."""
    if ask.reserved + ask.kv + ask.act <= ask.budget:
        return ON_GPU
    if ask.reserved_now + ask.kv_now + ask.act <= ask.budget and 0 < ask.offload_kv <= ask.buffer_room:
        return OFFLOAD
    return DEFER


def OLD_FLOW(ask: PrefillAsk) -> tuple[str, str, bool]:
    """(action, what upstream's refusal led to, offload_no_room counted) as the caller's three
    questions decided them; ``ask.parked_ahead`` stands for "behind a parked request, plain text"."""
    base = replace(ask, parked_ahead=False)
    buffer_only = _old_admit_prefill(replace(base, kv=NEVER_FITS))
    action = _old_admit_prefill(base)
    if action == ON_GPU and ask.parked_ahead:  # call 1: a parked request is ahead, buffer only
        action = buffer_only
    if_refused = OFFLOAD if action == ON_GPU and buffer_only == OFFLOAD else DEFER  # call 2
    no_room = (  # call 3
        action == DEFER
        and base.offload_kv > base.buffer_room
        and _old_admit_prefill(replace(base, kv=NEVER_FITS, buffer_room=NEVER_FITS)) == OFFLOAD
    )
    return action, if_refused, no_room


def _ask(budget=100, reserved=0, reserved_now=0, kv=10, kv_now=5, act=0, offload_kv=0, buffer_room=0, parked=False):
    return PrefillAsk(budget, reserved, reserved_now, kv, kv_now, act, offload_kv, buffer_room, parked)


CASES = [
    # (name, ask, (action, if_refused, buffer_full))
    ("fits the device, no buffer", _ask(), (ON_GPU, DEFER, False)),
    ("fits exactly", _ask(budget=30, reserved=15, kv=10, act=5), (ON_GPU, DEFER, False)),
    ("fits the device; refused, the buffer takes it", _ask(offload_kv=8, buffer_room=8), (ON_GPU, OFFLOAD, False)),
    ("fits the device; refused, the buffer is too small", _ask(offload_kv=8, buffer_room=7), (ON_GPU, DEFER, False)),
    (
        "fits the device; refused, no physical room now",
        _ask(budget=20, reserved=5, reserved_now=5, kv=10, kv_now=16, offload_kv=8, buffer_room=50),
        (ON_GPU, DEFER, False),
    ),
    ("parked ahead: the buffer takes it", _ask(offload_kv=8, buffer_room=9, parked=True), (OFFLOAD, DEFER, False)),
    ("parked ahead: the buffer is full", _ask(offload_kv=8, buffer_room=3, parked=True), (DEFER, DEFER, True)),
    ("parked ahead: cannot be parked", _ask(parked=True), (DEFER, DEFER, False)),
    (
        "parked ahead: no physical room now",
        _ask(budget=20, kv=10, kv_now=21, offload_kv=8, buffer_room=50, parked=True),
        (DEFER, DEFER, False),
    ),
    (
        "parked ahead, beyond the device: the buffer takes it",
        _ask(budget=20, kv=30, offload_kv=8, buffer_room=8, parked=True),
        (OFFLOAD, DEFER, False),
    ),
    (
        "beyond the device: offloaded",
        _ask(budget=20, reserved=15, kv=10, offload_kv=8, buffer_room=8),
        (OFFLOAD, DEFER, False),
    ),
    (
        "beyond the device: offload fits the physical room exactly",
        _ask(budget=20, reserved=15, reserved_now=10, kv=10, kv_now=7, act=3, offload_kv=8, buffer_room=8),
        (OFFLOAD, DEFER, False),
    ),
    (
        "beyond the device: the buffer is full",
        _ask(budget=20, kv=30, offload_kv=8, buffer_room=0),
        (DEFER, DEFER, True),
    ),
    (
        "beyond the device and the physical room",
        _ask(budget=20, reserved_now=10, kv=30, kv_now=11, offload_kv=8, buffer_room=0),
        (DEFER, DEFER, False),
    ),
    ("beyond the device, cannot be parked (no host buffer)", _ask(budget=20, kv=30), (DEFER, DEFER, False)),
    (
        "the activation tips it over",
        _ask(budget=20, kv=10, act=11, kv_now=5, offload_kv=4, buffer_room=4),
        (OFFLOAD, DEFER, False),
    ),
]


@pytest.mark.parametrize("name,ask,expected", CASES, ids=[c[0] for c in CASES])
def test_each_case_is_decided_as_the_three_old_questions_decided_it(name, ask, expected):
    verdict = judge_prefill(ask)
    assert (verdict.action, verdict.if_refused, verdict.buffer_full) == expected
    assert OLD_FLOW(ask) == expected, "the table itself must hold the old decisions"


def test_the_table_covers_each_old_question():
    parked = [c for c in CASES if c[1].parked_ahead]
    assert {c[2][0] for c in parked} == {OFFLOAD, DEFER}  # call 1 both ways
    assert {c[2][1] for c in CASES if c[2][0] == ON_GPU} == {OFFLOAD, DEFER}  # call 2 both ways
    assert {c[2][2] for c in CASES if c[2][0] == DEFER} == {True, False}  # call 3 both ways


def test_a_grid_is_decided_as_the_three_old_questions_decided_it():
    decided = set()
    for budget, reserved, reserved_now, kv, kv_now, act, offload_kv, room, parked in itertools.product(
        range(0, 9, 2), range(3), range(3), range(0, 7, 2), range(0, 5, 2), range(2), range(3), range(3), (False, True)
    ):
        ask = PrefillAsk(budget, reserved, reserved_now, kv, kv_now, act, offload_kv, room, parked)
        verdict = judge_prefill(ask)
        got = (verdict.action, verdict.if_refused, verdict.buffer_full)
        assert got == OLD_FLOW(ask), ask
        decided.add(got)
    assert decided == {
        (ON_GPU, DEFER, False),
        (ON_GPU, OFFLOAD, False),
        (OFFLOAD, DEFER, False),
        (DEFER, DEFER, False),
        (DEFER, DEFER, True),
    }


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: _ask(parked=1), "parked_ahead"),
        (lambda: PrefillVerdict("later"), "action"),
        (lambda: PrefillVerdict(ON_GPU, if_refused=ON_GPU), "if_refused"),
        (lambda: PrefillVerdict(OFFLOAD, if_refused=OFFLOAD), "if_refused"),
        (lambda: PrefillVerdict(ON_GPU, buffer_full=True), "buffer_full"),
    ],
)
def test_bad_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
