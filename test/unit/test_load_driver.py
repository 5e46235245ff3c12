"""benchmark/load_driver.py: the soak's and the fault run's load driver, with an in-process
client (no server): every event sent once, at or after its offset, outcomes tallied per
kind, failed/error outcomes listed, ``stop`` ends a phase early, phases add up."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from benchmark.load_driver import LoadDriver, add_load_arguments


class FakeClient:
    """Answers by kind: ``ok`` / ``shed`` / ``error`` / ``failed`` (the kind's name picks it)."""

    def __init__(self):
        self.calls: list[tuple[str, str, int, float]] = []
        self._lock = threading.Lock()

    def run(self, name: str, kind: str, n: int) -> tuple[str, str]:
        with self._lock:
            self.calls.append((name, kind, n, time.monotonic()))
        return kind, f"detail of {n}" if kind in ("error", "failed") else ""


def test_every_event_is_sent_once_at_its_offset_and_tallied():
    client = FakeClient()
    events = [(0.0, "a", "ok"), (0.05, "b", "ok"), (0.1, "a", "shed"), (0.15, "b", "error"), (0.2, "a", "failed")]
    load = LoadDriver(workers=3)
    t0 = time.monotonic()
    load.start(client, events)
    load.join(10)
    assert not load.is_alive()
    assert sorted(n for _, _, n, _ in client.calls) == [0, 1, 2, 3, 4]
    for name, kind, n, t in client.calls:
        assert (name, kind) == events[n][1:]
        assert t - t0 >= events[n][0] - 0.005  # never before its offset
    assert load.counts == {"ok": {"ok": 2}, "shed": {"shed": 1}, "error": {"error": 1}, "failed": {"failed": 1}}
    assert sorted((f["model"], f["kind"], f["detail"]) for f in load.failures) == [
        ("a", "failed", "detail of 4"),
        ("b", "error", "detail of 3"),
    ]
    assert all(f["t"] >= 0 and f["latency_s"] >= 0 for f in load.failures)


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
    load.start(client, [(0.0, "b", "ok")])  # a new phase after a stop sends again
    load.join(10)
    assert load.counts == {"ok": {"ok": 2}} and [c[:2] for c in client.calls] == [("a", "ok"), ("b", "ok")]


def test_bad_workers_and_a_second_start_while_running_are_refused():
    with pytest.raises(ValueError, match="workers"):
        LoadDriver(workers=0)
    load = LoadDriver(workers=1)
    load.start(FakeClient(), [(30.0, "a", "ok")])
    try:
        with pytest.raises(RuntimeError, match="still running"):
            load.start(FakeClient(), [])
    finally:
        load.stop()
        load.join(10)


def test_shared_flags_and_their_defaults():
    ap = argparse.ArgumentParser()
    add_load_arguments(ap, "soak", rate=1.5)
    args = ap.parse_args([])
    assert (args.seed, args.rate, args.memory_mb) == (None, 1.5, 8.0)
    assert (args.host_buffer_gb, args.sleep_after_s) == (0.05, 8.0)
    assert (args.request_timeout_s, args.workers, args.out) == (180.0, 24, "soak")
    assert args.results_dir.endswith("benchmark/results/soak")
    args = ap.parse_args(["--rate", "2", "--workers", "3", "--seed", "7"])
    assert (args.rate, args.workers, args.seed) == (2.0, 3, 7)
