"""Router activity as an engine's input (``memory_ext.policy.router_activity``): parsing with
errors by field, TTL, and the decisions (busy + headroom, no sleep while queued, wake-ahead,
lending ranked by arrival rate, the arrival-rate EWMA)."""

from __future__ import annotations

import math

import pytest

from memory_ext.policy.router_activity import (
    DEFAULT_TTL_S,
    ActivityError,
    ArrivalRate,
    expected_arrival_s,
    lend_fraction,
    live,
    may_sleep,
    parse_activity,
    queued_demand_tokens,
    report_numbers,
    wake_ahead,
)


def act(now=100.0, **kw):
    doc = {"queued": 0, "inflight": 0, "arrival_rate": 0.0}
    doc.update(kw)
    return parse_activity(doc, now)


# ------------------------------------------------------------------ parsing
def test_parse_keeps_the_numbers_and_stamps_the_receivers_clock():
    a = parse_activity({"model": "m", "queued": 3, "inflight": 1, "arrival_rate": 2.5, "queued_tokens": 900,
                        "since_arrival_s": 0.4, "ttl_s": 2}, now=7.0)  # fmt: skip
    assert (a.queued, a.inflight, a.arrival_rate, a.queued_tokens, a.since_arrival_s, a.ttl_s, a.received_at) == (
        3, 1, 2.5, 900, 0.4, 2.0, 7.0)  # fmt: skip
    b = act()
    assert b.ttl_s == DEFAULT_TTL_S and b.queued_tokens is None and b.since_arrival_s is None


@pytest.mark.parametrize(
    "doc,field",
    [
        ([], "body"), ("x", "body"), (None, "body"),
        ({"inflight": 0, "arrival_rate": 0}, "queued"),
        ({"queued": -1, "inflight": 0, "arrival_rate": 0}, "queued"),
        ({"queued": 1.5, "inflight": 0, "arrival_rate": 0}, "queued"),
        ({"queued": True, "inflight": 0, "arrival_rate": 0}, "queued"),
        ({"queued": 0, "inflight": "1", "arrival_rate": 0}, "inflight"),
        ({"queued": 0, "inflight": 0}, "arrival_rate"),
        ({"queued": 0, "inflight": 0, "arrival_rate": float("nan")}, "arrival_rate"),
        ({"queued": 0, "inflight": 0, "arrival_rate": -0.1}, "arrival_rate"),
        ({"queued": 0, "inflight": 0, "arrival_rate": 0, "queued_tokens": -5}, "queued_tokens"),
        ({"queued": 0, "inflight": 0, "arrival_rate": 0, "since_arrival_s": float("inf")}, "since_arrival_s"),
        ({"queued": 0, "inflight": 0, "arrival_rate": 0, "ttl_s": 0}, "ttl_s"),
        ({"queued": 0, "inflight": 0, "arrival_rate": 0, "ttl_s": 1e9}, "ttl_s"),
        ({"queued": 0, "inflight": 0, "arrival_rate": 0, "model": 3}, "model"),
        ({"queued": 0, "inflight": 0, "arrival_rate": 0, "queue": 3}, "queue"),
    ],
)  # fmt: skip
def test_a_malformed_message_names_its_field(doc, field):
    with pytest.raises(ActivityError) as e:
        parse_activity(doc, 0.0)
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_an_activity_expires_after_its_ttl():
    a = act(now=10.0, queued=2, ttl_s=3)
    assert live(a, 12.9) is a and live(a, 13.0) is a
    assert live(a, 13.01) is None and live(None, 0.0) is None
    assert wake_ahead(a, 12.0) and not wake_ahead(a, 14.0)  # a dead router's queue no longer wakes anyone


# ------------------------------------------------------------------ report to the arbiter
def test_router_queued_demand_makes_the_model_busy_with_headroom():
    a = act(queued=4, queued_tokens=1000)
    assert queued_demand_tokens(a, 100.0, tokens_per_request=64) == 1000
    assert report_numbers(idle=50, headroom=2, busy=False, act=a, now=100.0, queued_chunks=10) == (12, True)
    assert report_numbers(idle=8, headroom=2, busy=False, act=a, now=100.0, queued_chunks=10) == (8, True)  # <= idle


def test_without_a_token_estimate_each_queued_request_counts_a_default():
    assert queued_demand_tokens(act(queued=3), 100.0, tokens_per_request=64) == 192
    assert queued_demand_tokens(act(queued=0, queued_tokens=500), 100.0, 64) == 0
    assert queued_demand_tokens(None, 100.0, 64) == 0


def test_in_flight_only_is_work_without_extra_headroom():
    a = act(inflight=2)
    assert report_numbers(idle=50, headroom=0, busy=False, act=a, now=100.0, queued_chunks=0) == (0, True)


def test_no_or_stale_or_empty_activity_changes_nothing():
    for a, now in ((None, 100.0), (act(queued=5, ttl_s=1), 102.0), (act(arrival_rate=3.0), 100.0)):
        assert report_numbers(idle=50, headroom=3, busy=False, act=a, now=now, queued_chunks=20) == (3, False)
        assert report_numbers(idle=50, headroom=3, busy=True, act=a, now=now, queued_chunks=20) == (3, True)


# ------------------------------------------------------------------ sleep and wake
def test_no_sleep_while_the_router_holds_requests_or_saw_one_recently():
    assert may_sleep(None, 100.0, 30.0)
    assert not may_sleep(act(queued=1), 100.0, 30.0)
    assert not may_sleep(act(inflight=1), 100.0, 30.0)
    recent = act(now=100.0, since_arrival_s=20.0)
    assert expected_arrival_s(recent, 105.0) == pytest.approx(25.0)  # the message's age counts
    assert not may_sleep(recent, 105.0, sleep_after_s=30.0)
    assert may_sleep(recent, 105.0, sleep_after_s=25.0)
    assert may_sleep(act(), 100.0, 30.0)  # the router never saw an arrival
    assert may_sleep(act(now=100.0, queued=3, ttl_s=1.0), 101.5, 30.0)  # stale: the engine's own timer rules


def test_wake_ahead_when_the_router_holds_requests():
    assert wake_ahead(act(queued=1), 100.0)
    assert wake_ahead(act(inflight=1), 100.0)
    assert not wake_ahead(act(arrival_rate=5.0, since_arrival_s=0.0), 100.0)
    assert not wake_ahead(None, 100.0)


# ------------------------------------------------------------------ lending ranked by arrival rate
def test_lend_fraction_ranks_idle_models_by_arrival_rate():
    idle_after = 30.0
    assert lend_fraction(None, 100.0, idle_after) == 1.0
    rates = [0.0, 0.005, 0.02, 0.05]
    shares = [lend_fraction(act(arrival_rate=r), 100.0, idle_after) for r in rates]
    assert shares[0] == 1.0 and shares == sorted(shares, reverse=True) and len(set(shares)) == len(shares)
    assert shares[1] == pytest.approx(1 - 0.005 * 30)
    assert shares[3] == 0.0  # >= 1 expected arrival within idle_after_s: lends nothing
    assert lend_fraction(act(queued=1), 100.0, idle_after) == 0.0
    assert lend_fraction(act(queued=1, ttl_s=1.0), 102.0, idle_after) == 1.0


# ------------------------------------------------------------------ the rate
def test_arrival_rate_of_a_steady_stream_and_its_decay():
    r = ArrivalRate(window_s=5.0)
    assert r.rate(0.0) == 0.0 and r.last_arrival is None
    t = 0.0
    for _ in range(200):  # 4 requests/s for 50 s (10 windows)
        t += 0.25
        r.arrive(t)
    assert r.rate(t) == pytest.approx(4.0, rel=0.15)
    assert r.last_arrival == t
    assert r.rate(t + 5.0) == pytest.approx(r.rate(t) * math.exp(-1))
    assert r.rate(t + 100.0) < 1e-6
    with pytest.raises(ValueError, match="window_s"):
        ArrivalRate(0)
