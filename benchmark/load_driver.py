"""The load driver shared by ``benchmark/soak.py`` and ``benchmark/faults.py``: timed requests
sent through a client on a daemon thread, one ``accounting.Outcome`` per scheduled request.

A client is any object with ``run(model, kind, n) -> dict``: ``result`` (ok | shed | aborted |
error | failed) and what it read (``status``, ``finish_reason``, ``tokens``, ``expected_tokens``,
``text``, ``expected_text``, ``error``); see ``soak_client.Client``. Events are ``(offset s,
model, kind)`` sorted by offset (``soak.traffic``). Invariants: each event is sent at most once,
never before its offset; every event whose offset the phase reached (all of them unless
``stop`` ended it early) has exactly one outcome in ``outcomes``, ``sent=False`` if it never went
out; ``counts[kind][result]`` adds up to the requests that finished.

Fault switch (``--inject-fault``, for testing the judge end to end): ``drop`` never sends the
``every``-th event; ``abort`` / ``reset`` / ``wrong`` turn its answer into a 200 with
``finish_reason`` abort, a reset connection, or a greedy answer that differs from the one expected.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.accounting import Outcome, error_code

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("drop", "abort", "reset", "wrong")


def injected(answer: dict, fault: str) -> dict:
    """``answer`` as the fault switch ``fault`` makes it (not ``drop``: that one is never sent)."""
    if fault == "abort":
        return {**answer, "result": "ok", "status": 200, "finish_reason": "abort"}
    if fault == "reset":
        return {"result": "error", "error": "connection: ConnectionResetError(104, 'Connection reset by peer')"}
    if fault == "wrong":
        expected = answer.get("expected_text") or "the expected answer"
        return {**answer, "result": "ok", "finish_reason": answer.get("finish_reason") or "length",
                "expected_text": expected, "text": expected + " (injected difference)"}  # fmt: skip
    raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")


class Phase:
    """One ``start``: its events, the outcomes of those sent, and where the clock stood."""

    def __init__(self, driver: LoadDriver, client, events, name: str):
        self.driver, self.client, self.events, self.name = driver, client, events, name
        self.t_start = time.monotonic()

    def one(self, o: Outcome) -> None:
        d = self.driver
        o.sent, o.sent_at = True, round(time.monotonic() - d.origin, 3)
        answer = self.client.run(o.model, o.kind, o.index)
        if d.fault is not None and o.index % d.fault_every == d.fault_every - 1:
            answer = injected(answer, d.fault)
        o.ended_at = round(time.monotonic() - d.origin, 3)
        o.latency_s = round(o.ended_at - o.sent_at, 3)
        for k, v in answer.items():
            setattr(o, "error" if k == "detail" else k, v)
        if o.result in ("error", "failed") and o.error_code is None:
            o.error_code = error_code(o.error)
        with d.lock:
            d.counts.setdefault(o.kind, {}).setdefault(o.result, 0)
            d.counts[o.kind][o.result] += 1

    def run(self, stop: threading.Event) -> None:
        """Send the events at their offsets until they run out or ``stop`` is set; returns once
        every request sent has finished (at most ``workers`` in flight)."""
        d = self.driver
        reached = len(self.events)
        with ThreadPoolExecutor(max_workers=d.workers) as pool:
            for i, (offset, name, kind) in enumerate(self.events):
                if stop.wait(max(0.0, self.t_start + offset - time.monotonic())):
                    reached = i
                    break
                o = Outcome(index=d.next_index + i, model=name, kind=kind, scheduled_at=round(offset, 3),
                            phase=self.name)  # fmt: skip
                with d.lock:
                    d.outcomes.append(o)
                if d.fault == "drop" and o.index % d.fault_every == d.fault_every - 1:
                    continue
                pool.submit(self.one, o)
        with d.lock:
            d.next_index += reached


class LoadDriver:
    """Phases on a daemon thread. ``outcomes`` and ``counts`` accumulate over every ``start``
    (soak's warm-up and soak phases add up); ``stop`` ends the current phase early (no event sent
    after it; requests in flight finish). Outcome times count from ``origin`` (monotonic; default:
    the first start), so a caller can put its own events (kills) on the same clock."""

    def __init__(self, workers: int, origin: float | None = None, fault: str | None = None, fault_every: int = 7):
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers!r}")
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault: choose from {', '.join(FAULTS)}, got {fault!r}")
        self.workers, self.origin, self.fault, self.fault_every = workers, origin, fault, max(1, fault_every)
        self.counts: dict[str, dict[str, int]] = {}
        self.outcomes: list[Outcome] = []
        self.next_index = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def failures(self) -> list[Outcome]:
        """The outcomes the client itself called ``failed`` or ``error``."""
        with self.lock:
            return [o for o in self.outcomes if o.result in ("failed", "error")]

    def start(self, client, events, phase: str = "") -> None:
        """Send ``events`` at their offsets from now, on a new thread (a new phase)."""
        if self.is_alive():
            raise RuntimeError("the previous phase is still running")
        if self.origin is None:
            self.origin = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=Phase(self, client, list(events), phase).run, args=(self._stop,),
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()


def add_load_arguments(ap: argparse.ArgumentParser, name: str, rate: float) -> None:
    """The flags both scripts share: the traffic (``--seed``, ``--rate``), the serve config
    (``--memory-mb``, ``--host-buffer-gb``, ``--sleep-after-s``), the client and driver
    (``--request-timeout-s``, ``--workers``, ``--shed-budget``, ``--inject-fault``) and where
    results go (``benchmark/results/<name>/<name>.json``)."""
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--rate", type=float, default=rate, help="requests/s per model while ON")
    ap.add_argument("--memory-mb", type=float, default=8.0, help="the CPU device's memory for all three models")
    ap.add_argument("--host-buffer-gb", type=float, default=0.05)
    ap.add_argument("--sleep-after-s", type=float, default=8.0)
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--workers", type=int, default=24, help="client threads (requests in flight at most)")
    ap.add_argument("--shed-budget", type=int, default=0, help="429s allowed (0: the run does not test overload)")
    ap.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default=None,
        help="test the checks: drop / abort / reset / wrong every 7th request (the run must FAIL)",
    )
    ap.add_argument("--results-dir", default=str(REPO / "benchmark" / "results" / name))
    ap.add_argument("--out", default=name)
