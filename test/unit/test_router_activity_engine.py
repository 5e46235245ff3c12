"""An engine's side of router activity (``sglang_memx.router_activity``) and its hooks, with
in-process fakes (no server, no scheduler): the message reaches the scheduler through
upstream's ``SetInternalStateReq`` (memx's keys answered by the hook, others passed to
upstream), the shared pool's report, the sleep controller, the lendable layers, status and
metrics."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from memory_ext.policy.router_activity import ActivityError, parse_activity
from sglang_memx import router_activity
from sglang_memx.coordinator.components import NoActivation
from sglang_memx.hooks import scheduler as sched_hooks
from sglang_memx.metrics import render_prometheus
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.upstream.manifest import resolve
from sglang_memx.weights import lending, sleep


@pytest.fixture(autouse=True)
def fresh():
    router_activity.reset()
    yield
    router_activity.reset()


def post(**kw):
    doc = {"queued": 0, "inflight": 0, "arrival_rate": 0.0}
    doc.update(kw)
    return router_activity.receive(router_activity.to_wire(parse_activity(doc, 0.0)))


def test_the_wire_round_trip_keeps_every_field_and_none():
    a = post(queued=3, inflight=2, arrival_rate=1.25, queued_tokens=700, since_arrival_s=0.5, ttl_s=4)
    got = (a.queued, a.inflight, a.arrival_rate, a.queued_tokens, a.since_arrival_s, a.ttl_s)
    assert got == (3, 2, 1.25, 700, 0.5, 4.0)
    assert isinstance(a.queued, int) and isinstance(a.queued_tokens, int)
    b = post(queued=1)
    assert b.queued_tokens is None and b.since_arrival_s is None
    assert router_activity.current() is b and router_activity.status()["received_total"] == 2


def test_the_scheduler_hook_takes_memx_keys_and_passes_the_rest_to_upstream():
    req_cls = resolve("sglang.srt.managers.io_struct.SetInternalStateReq")
    calls = []

    def original(controller, recv_req):
        calls.append(recv_req)
        return "upstream's answer"

    wire = router_activity.to_wire(parse_activity({"queued": 2, "inflight": 1, "arrival_rate": 0.5}, 0.0))
    reply = sched_hooks.around_set_internal_state(original, object(), req_cls(server_args=wire))
    assert reply.updated is True and not calls
    assert router_activity.current().queued == 2
    other = req_cls(server_args={"pp_max_micro_batch_size": 4})
    assert sched_hooks.around_set_internal_state(original, object(), other) == "upstream's answer"
    assert calls == [other]
    bad = dict(wire, memx_activity_queued=-3)
    assert sched_hooks.around_set_internal_state(original, object(), req_cls(server_args=bad)).updated is False
    assert router_activity.current().queued == 2  # the bad message changed nothing


def test_receive_refuses_a_bad_number_by_field():
    with pytest.raises(ActivityError, match="^inflight"):
        router_activity.receive({"memx_activity_queued": 1, "memx_activity_inflight": 0.5,
                                 "memx_activity_arrival_rate": 0})  # fmt: skip


def fake_kv(group_rows=64, chunks_per_group=2):
    return SimpleNamespace(buffers=SimpleNamespace(group_rows=group_rows, chunks_per_group=chunks_per_group))


def test_the_report_keeps_headroom_for_the_routers_queue_and_says_busy():
    kv = fake_kv()
    assert router_activity.report_numbers(kv, idle=40, headroom=2, busy=False) == (2, False)  # no router
    post(queued=2, queued_tokens=130)  # 130 tokens -> 3 groups of 64 -> 6 chunks
    assert router_activity.report_numbers(kv, idle=40, headroom=2, busy=False) == (8, True)
    post(queued=2)  # no estimate: one group per queued request
    assert router_activity.report_numbers(kv, idle=40, headroom=0, busy=False) == (4, True)
    post(queued=5, queued_tokens=130, ttl_s=0.05)
    time.sleep(0.1)
    assert router_activity.report_numbers(kv, idle=40, headroom=2, busy=False) == (2, False)  # expired


def sleepy(monkeypatch, *, sleeping, idle_for, busy=False):
    calls = []
    monkeypatch.setattr(up_sched, "waiting", lambda s: ["r"] if busy else [])
    monkeypatch.setattr(up_sched, "admitted_reqs", lambda s: [])
    monkeypatch.setattr(sleep, "wake", lambda w, kv, lent: calls.append("wake"))
    monkeypatch.setattr(sleep, "fall_asleep", lambda w, kv, lent, a, t, s, activation: calls.append("sleep"))
    w = SimpleNamespace(sleep_after_s=30.0, sleeping=sleeping, last_busy=time.monotonic() - idle_for)
    kv = SimpleNamespace(weights=w, lent=object())
    sleep.step(w, kv, kv.lent, None, None, None, NoActivation())
    return calls, w


def test_sleep_controller_stays_awake_while_the_router_holds_requests(monkeypatch):
    assert sleepy(monkeypatch, sleeping=False, idle_for=60)[0] == ["sleep"]  # without a router: sleeps
    post(queued=1)
    assert sleepy(monkeypatch, sleeping=False, idle_for=60)[0] == []
    post(since_arrival_s=10.0)  # nothing held, but an arrival 10 s ago (< sleep_after_s)
    assert sleepy(monkeypatch, sleeping=False, idle_for=60)[0] == []
    post(since_arrival_s=45.0)
    assert sleepy(monkeypatch, sleeping=False, idle_for=60)[0] == ["sleep"]
    post(queued=1, ttl_s=0.05)
    time.sleep(0.1)
    assert sleepy(monkeypatch, sleeping=False, idle_for=60)[0] == ["sleep"]  # the router's word expired


def test_a_sleeping_engine_wakes_ahead_of_the_routers_queued_requests(monkeypatch):
    assert sleepy(monkeypatch, sleeping=True, idle_for=60)[0] == []
    post(queued=2)
    calls, w = sleepy(monkeypatch, sleeping=True, idle_for=60)
    assert calls == ["wake"] and time.monotonic() - w.last_busy < 5  # its idle timer restarts
    assert sleepy(monkeypatch, sleeping=True, idle_for=60, busy=True)[0] == ["wake"]


def test_lendable_layers_shrink_with_the_routers_arrival_rate(monkeypatch):
    monkeypatch.setattr(lending.remap, "model_state",
                        lambda w, kv, lent, busy: SimpleNamespace(active=False, compute_s=1.0))  # fmt: skip
    monkeypatch.setattr(lending, "model_limit", lambda state, mode: (21, "test"))
    monkeypatch.setattr(lending.remap, "buffer_mode", lambda depth: None)
    w = SimpleNamespace(mode="remap", alpha=0, depth=None, idle_after_s=30.0, store=SimpleNamespace(slot_chunks=3))
    kv = SimpleNamespace(weights=w)
    full = lending.lendable_chunks(w, kv, object())
    assert full == (21 - 2) * 3
    post(arrival_rate=0.01)  # 0.3 expected arrivals within idle_after_s: 70 % of the layers
    slow = lending.lendable_chunks(w, kv, object())
    post(arrival_rate=0.02)
    fast = lending.lendable_chunks(w, kv, object())
    assert full > slow > fast > 0
    assert slow == (int(21 * 0.7) - 2) * 3
    post(queued=1)
    assert lending.lendable_chunks(w, kv, object()) == 0


def test_status_and_metrics_show_the_last_activity():
    assert router_activity.status() is None
    post(queued=3, inflight=1, arrival_rate=2.0, queued_tokens=300)
    doc = router_activity.status()
    assert doc["queued"] == 3 and doc["arrival_rate"] == 2.0 and doc["live"] and 0 <= doc["age_s"] < 5
    text = render_prometheus({"schedulers": [{"dp_rank": 0, "router_activity": doc}]})
    assert 'memx_router_activity_queued{dp_rank="0"} 3' in text
    assert 'memx_router_activity_arrival_rate{dp_rank="0"} 2' in text
    assert 'memx_router_activity_queued_tokens{dp_rank="0"} 300' in text
    assert 'memx_router_activity_live{dp_rank="0"} 1' in text
    assert "memx_router_activity" not in render_prometheus({"schedulers": [{"dp_rank": 0, "router_activity": None}]})


def test_tensor_parallel_ranks_apply_rank0s_answer_to_sleep_or_wake(monkeypatch):
    """Each rank's clock and its stamp of the router's message may differ: the rank that would sleep
    does not when rank 0 says no, and one that would not wake does when rank 0 says so."""
    calls = []
    monkeypatch.setattr(up_sched, "waiting", lambda s: [])
    monkeypatch.setattr(up_sched, "admitted_reqs", lambda s: [])
    monkeypatch.setattr(sleep, "wake", lambda w, kv, lent: calls.append("wake"))
    monkeypatch.setattr(sleep, "fall_asleep", lambda w, kv, lent, a, t, s, activation: calls.append("sleep"))
    rows = []

    def rank0_says(answer):
        return lambda row: rows.append(row) or answer

    awake = SimpleNamespace(sleep_after_s=30.0, sleeping=False, last_busy=time.monotonic() - 60)
    sleep.step(awake, None, None, None, None, None, NoActivation(), rank0s=rank0_says([0, 0]))
    asleep = SimpleNamespace(sleep_after_s=30.0, sleeping=True, last_busy=time.monotonic() - 60)
    sleep.step(asleep, None, None, None, None, None, NoActivation(), rank0s=rank0_says([1, 0]))
    assert rows == [[0, 1], [0, 0]] and calls == ["wake"]  # this rank's row went out; rank 0's was applied
