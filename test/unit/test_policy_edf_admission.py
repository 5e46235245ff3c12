"""Router admission policy: EDF over TTFT deadlines, priority tie-break, caps, shedding."""

from __future__ import annotations

import pytest

from memory_ext.policy.edf_admission import DEADLINE, ENGINE_DOWN, QUEUE_FULL, EdfAdmission, ModelLimits


def adm(**kw):
    models = kw.pop("models", None) or {
        "fast": ModelLimits(ttft_slo_s=0.5, priority=0, max_inflight=1, max_queued=4, group="dev"),
        "slow": ModelLimits(ttft_slo_s=5.0, priority=1, max_inflight=1, max_queued=4, group="dev"),
    }
    return EdfAdmission(models, **kw)


def test_free_slot_admits_at_once_and_counts():
    a = adm()
    o = a.offer("r1", "fast", now=0.0)
    assert o.verdict == "admit" and o.started == (o.ticket,) and o.ticket.deadline == 0.5
    assert a.inflight("fast") == 1 and a.snapshot()["fast"]["accepted"] == 1


def test_edf_across_models_sharing_a_device():
    a = adm(group_inflight={"dev": 1})
    assert a.offer("busy", "slow", 0.0).verdict == "admit"  # holds the device's only slot
    assert a.offer("s1", "slow", 1.0).verdict == "queue"  # deadline 6.0
    assert a.offer("f1", "fast", 2.0).verdict == "queue"  # deadline 2.5: later arrival, earlier deadline
    assert a.offer("f2", "fast", 2.1).verdict == "queue"  # deadline 2.6
    assert [t.rid for t in a.queued()] == ["f1", "f2", "s1"]
    order = [t.rid for t in a.finish("busy", 3.0)]
    while a.queued():
        order += [t.rid for t in a.finish(order[-1], 4.0)]
    assert order == ["f1", "f2", "s1"]


def test_priority_breaks_equal_deadlines():
    a = adm(models={"lo": ModelLimits(1.0, priority=0, max_inflight=1, group="g"),
                    "hi": ModelLimits(1.0, priority=5, max_inflight=1, group="g")},
            group_inflight={"g": 1})  # fmt: skip
    a.offer("x", "lo", 0.0)
    a.offer("l", "lo", 1.0)
    a.offer("h", "hi", 1.0)
    assert [t.rid for t in a.queued()] == ["h", "l"]
    assert [t.rid for t in a.finish("x", 1.5)] == ["h"]


def test_per_model_inflight_cap_without_group():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=2, max_queued=8)})
    assert [a.offer(f"r{i}", "m", 0.0).verdict for i in range(4)] == ["admit", "admit", "queue", "queue"]
    assert a.inflight("m") == 2
    assert [t.rid for t in a.finish("r0", 0.5)] == ["r2"]
    assert a.inflight("m") == 2


def test_full_queue_rejects_the_newcomer_of_equal_priority():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1, max_queued=1)})
    a.offer("run", "m", 0.0)
    assert a.offer("wait", "m", 0.1).verdict == "queue"
    o = a.offer("late", "m", 0.2)
    assert o.verdict == "reject" and o.reason == QUEUE_FULL and o.retry_after_s >= 1
    assert [t.rid for t in a.queued()] == ["wait"] and a.snapshot()["m"][QUEUE_FULL] == 1


def test_full_queue_sheds_the_lowest_priority_for_a_higher_one():
    a = EdfAdmission({"lo": ModelLimits(10.0, priority=0, max_inflight=1),
                      "hi": ModelLimits(10.0, priority=2, max_inflight=1)}, max_queued_total=2)  # fmt: skip
    a.offer("l0", "lo", 0.0)
    a.offer("h0", "hi", 0.0)
    a.offer("l1", "lo", 0.1)
    a.offer("l2", "lo", 0.2)
    o = a.offer("h1", "hi", 0.3)  # total queue full: l2 (lowest priority, latest deadline) goes
    assert o.verdict == "queue" and [(s.ticket.rid, s.reason) for s in o.shed] == [("l2", QUEUE_FULL)]
    o = a.offer("l3", "lo", 0.4)
    assert o.verdict == "reject" and o.reason == QUEUE_FULL  # the newcomer is the least valuable
    assert {t.rid for t in a.queued()} == {"l1", "h1"}


def test_zero_queue_only_admits_into_free_slots():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1, max_queued=0)})
    assert a.offer("a", "m", 0.0).verdict == "admit"
    assert a.offer("b", "m", 0.0).reason == QUEUE_FULL


def test_hopeless_requests_are_shed_not_kept_forever():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1)}, hopeless_after_slo_x=2.0)
    a.offer("run", "m", 0.0)
    a.offer("w", "m", 0.5)  # deadline 1.5, hopeless after 3.5
    assert a.expire(3.4) == ()
    [s] = a.expire(3.6)
    assert s.ticket.rid == "w" and s.reason == DEADLINE and a.queued() == []


def test_engine_down_sheds_queue_and_refuses_until_up():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1), "n": ModelLimits(1.0)})
    a.offer("run", "m", 0.0)
    a.offer("w", "m", 0.1)
    shed = a.engine_down("m")
    assert [(s.ticket.rid, s.reason) for s in shed] == [("w", ENGINE_DOWN)]
    o = a.offer("x", "m", 0.2)
    assert o.verdict == "reject" and o.reason == ENGINE_DOWN and o.retry_after_s == 5.0
    assert a.offer("y", "n", 0.2).verdict == "admit"  # other models untouched
    a.finish("run", 0.3)
    a.engine_up("m", 0.4)
    assert a.offer("z", "m", 0.5).verdict == "admit"


def test_cancel_and_retry_after_follow_service_time():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1)}, service_ewma=1.0)
    a.offer("r", "m", 0.0)
    a.offer("q", "m", 0.0)
    assert a.cancel("q") and not a.cancel("q")
    a.finish("r", 7.2)  # one request took 7.2 s
    a.offer("r2", "m", 8.0)
    a.offer("q2", "m", 8.0)
    assert a.retry_after_s("m") == 15.0  # 2 waves of 7.2 s, rounded up


def test_bad_inputs():
    with pytest.raises(ValueError, match="ttft_slo_s"):
        ModelLimits(0)
    with pytest.raises(ValueError, match="max_inflight"):
        ModelLimits(1.0, max_inflight=0)
    a = EdfAdmission({"m": ModelLimits(1.0)})
    with pytest.raises(KeyError):
        a.offer("r", "nope", 0.0)
    a.offer("r", "m", 0.0)
    with pytest.raises(ValueError, match="already known"):
        a.offer("r", "m", 0.0)


def test_restarting_engine_queues_then_sheds_the_hopeless_as_engine_restarting():
    from memory_ext.policy.edf_admission import ENGINE_RESTARTING

    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=2, max_queued=4)}, hopeless_after_slo_x=1.0)
    a.engine_restarting("m", now=0.0, expected_s=30.0)
    assert a.offer("r1", "m", 0.0).verdict == "queue" and a.offer("r2", "m", 1.5).verdict == "queue"
    assert a.retry_after_s("m") == 29.0 and a.snapshot()["m"]["state"] == "restarting"  # ceil(30 - 1.5)
    shed = a.expire(2.5)  # r1 is past deadline + 1 SLO; r2 not yet
    assert [(s.ticket.rid, s.reason) for s in shed] == [("r1", ENGINE_RESTARTING)]
    assert 27.0 <= shed[0].retry_after_s <= 28.0  # the restart's expected rest
    assert [t.rid for t in a.engine_up("m", 3.0)] == ["r2"]  # back: the queue starts
    assert a.counters["m"][ENGINE_RESTARTING] == 1 and a.snapshot()["m"]["state"] == "up"


def test_restarting_then_dead_sheds_the_queue_as_engine_down():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1, max_queued=4)})
    a.engine_restarting("m", 0.0)
    a.offer("r1", "m", 0.0)
    assert [(s.ticket.rid, s.reason) for s in a.engine_down("m")] == [("r1", ENGINE_DOWN)]
    assert not a.is_restarting("m") and a.offer("r2", "m", 0.1).verdict == "reject"


def test_set_max_inflight_grows_and_shrinks_a_models_slots_in_edf_order():
    a = EdfAdmission({"m": ModelLimits(1.0, max_inflight=1, max_queued=8)})
    assert a.offer("r0", "m", 0.0).verdict == "admit"
    a.offer("late", "m", 0.2)
    a.offer("early", "m", 0.1)  # offered later, but deadline 1.1 < 1.2: EDF by deadline
    assert [t.rid for t in a.set_max_inflight("m", 2, 0.3)] == ["early"]  # a second replica woke up
    assert a.inflight("m") == 2 and a.models["m"].max_inflight == 2
    assert a.set_max_inflight("m", 1, 0.4) == ()  # a replica left: nothing taken back, nothing started
    assert a.finish("r0", 0.5) == ()  # 1 in flight == the cap
    assert [t.rid for t in a.finish("early", 0.6)] == ["late"]
    with pytest.raises(ValueError, match="max_inflight"):
        a.set_max_inflight("m", 0, 0.7)
