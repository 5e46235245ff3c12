"""benchmark/load_driver.py: the soak's and the fault run's load driver, with an in-process
client (no server): one outcome per scheduled event, each sent once at or after its offset,
results tallied per kind, ``stop`` ends a phase early (later events are not scheduled), phases
add up; the fault switch spoils every ``fault_every``-th request and the soak's verdict fails."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from benchmark.accounting import LeakLimits, soak_verdict
from benchmark.load_driver import LoadDriver, add_load_arguments


class FakeClient:
    """Answers by kind: ``ok`` (a full answer) / ``shed`` / ``error`` / ``failed``."""

    def __init__(self):
        self.calls: list[tuple[str, str, int, float]] = []
        self._lock = threading.Lock()

    def run(self, name: str, kind: str, n: int) -> dict:
        with self._lock:
            self.calls.append((name, kind, n, time.monotonic()))
        if kind == "ok":
            return {"result": "ok", "status": 200, "finish_reason": "length", "tokens": 8, "expected_tokens": 8}
        return {"result": kind, "detail": f"detail of {n}" if kind in ("error", "failed") else ""}


def test_every_event_is_sent_once_at_its_offset_and_tallied():
    client = FakeClient()
    events = [(0.0, "a", "ok"), (0.05, "b", "ok"), (0.1, "a", "shed"), (0.15, "b", "error"), (0.2, "a", "failed")]
    load = LoadDriver(workers=3)
    t0 = time.monotonic()
    load.start(client, events, "p")
    load.join(10)
    assert not load.is_alive()
    assert sorted(n for _, _, n, _ in client.calls) == [0, 1, 2, 3, 4]
    for name, kind, n, t in client.calls:
        assert (name, kind) == events[n][1:]
        assert t - t0 >= events[n][0] - 0.005  # never before its offset
    assert load.counts == {"ok": {"ok": 2}, "shed": {"shed": 1}, "error": {"error": 1}, "failed": {"failed": 1}}
    assert sorted((o.model, o.kind, o.error) for o in load.failures) == [
        ("a", "failed", "detail of 4"),
        ("b", "error", "detail of 3"),
    ]
    assert [o.index for o in sorted(load.outcomes, key=lambda o: o.index)] == [0, 1, 2, 3, 4]
    for o in load.outcomes:
        assert o.sent and o.phase == "p" and 0 <= o.sent_at <= o.ended_at and o.latency_s >= 0
    assert next(o for o in load.outcomes if o.index == 0).finish_reason == "length"


def test_stop_ends_the_phase_before_later_events_and_phases_add_up():
    client = FakeClient()
    load = LoadDriver(workers=2)
    load.start(client, [(0.0, "a", "ok"), (30.0, "a", "ok")])
    deadline = time.monotonic() + 10
    while not client.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    t = time.monotonic()
    load.stop()
    load.join(10)
    assert not load.is_alive() and time.monotonic() - t < 5  # did not wait for the 30 s event
    assert [c[2] for c in client.calls] == [0] and load.counts == {"ok": {"ok": 1}}
    assert len(load.outcomes) == 1  # the 30 s event was never due: not scheduled
    load.start(client, [(0.0, "b", "ok")])  # a new phase after a stop sends again
    load.join(10)
    assert load.counts == {"ok": {"ok": 2}} and [c[:2] for c in client.calls] == [("a", "ok"), ("b", "ok")]
    assert [o.index for o in load.outcomes] == [0, 1]  # indices continue across phases


def test_bad_workers_faults_and_a_second_start_while_running_are_refused():
    with pytest.raises(ValueError, match="workers"):
        LoadDriver(workers=0)
    with pytest.raises(ValueError, match="fault"):
        LoadDriver(workers=1, fault="melt")
    load = LoadDriver(workers=1)
    load.start(FakeClient(), [(30.0, "a", "ok")])
    try:
        with pytest.raises(RuntimeError, match="still running"):
            load.start(FakeClient(), [])
    finally:
        load.stop()
        load.join(10)


@pytest.mark.parametrize(
    "fault, reason",
    [("drop", "scheduled but never sent (dropped)"), ("abort", "answered 200 with finish_reason 'abort'"),
     ("reset", "connection error outside any kill window"), ("wrong", "wrong greedy answer")],
)  # fmt: skip
def test_the_fault_switch_fails_the_soak_naming_it(fault, reason):
    events = [(0.01 * i, "a", "ok") for i in range(14)]
    clean = LoadDriver(workers=4)
    clean.start(FakeClient(), events)
    clean.join(10)
    checks, details = soak_verdict(clean.outcomes, {}, {}, {}, LeakLimits(), 0, 14)
    assert all(checks.values()), details
    load = LoadDriver(workers=4, fault=fault)
    load.start(FakeClient(), events)
    load.join(10)
    assert len(load.outcomes) == 14
    checks, details = soak_verdict(load.outcomes, {}, {}, {}, LeakLimits(), 0, 14)
    assert not all(checks.values())
    reasons = details["judgement"]["failure_reasons"]
    assert list(reasons) == [reason] and next(iter(reasons.values())) == 2  # the 7th and the 14th
    spoiled = sorted(o.index for o in load.outcomes if o.verdict.startswith("fail"))
    assert spoiled == [6, 13]


def test_shared_flags_and_their_defaults():
    ap = argparse.ArgumentParser()
    add_load_arguments(ap, "soak", rate=1.5)
    args = ap.parse_args([])
    assert (args.seed, args.rate, args.memory_mb) == (None, 1.5, 8.0)
    assert (args.host_buffer_gb, args.sleep_after_s) == (0.05, 8.0)
    assert (args.request_timeout_s, args.workers, args.out) == (180.0, 24, "soak")
    assert (args.shed_budget, args.inject_fault) == (0, None)
    assert args.results_dir.endswith("benchmark/results/soak")
    args = ap.parse_args(["--rate", "2", "--workers", "3", "--seed", "7", "--inject-fault", "reset"])
    assert (args.rate, args.workers, args.seed, args.inject_fault) == (2.0, 3, 7, "reset")
