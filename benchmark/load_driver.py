"""The load driver shared by ``benchmark/soak.py`` and ``benchmark/faults.py``: timed requests
sent through a client on a daemon thread, every outcome tallied per request kind.

A client is any object with ``run(model, kind, n) -> (outcome, detail)`` (``soak.Client``);
events are ``(offset s, model, kind)`` sorted by offset (``soak.traffic``). Invariants: each
event is sent at most once, never before its offset; ``counts[kind][outcome]`` adds up to the
requests that finished; every ``failed`` or ``error`` outcome is also in ``failures`` with its
time, model, kind, latency and detail.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def drive(client, events, t_start: float, stop: threading.Event, counts: dict, failures: list,
          lock: threading.Lock, workers: int) -> None:  # fmt: skip
    """Send ``events`` at their offsets from ``t_start`` until they run out or ``stop`` is set;
    returns once every request sent has finished (at most ``workers`` in flight)."""

    def one(i: int, name: str, kind: str):
        t0 = time.monotonic()
        outcome, detail = client.run(name, kind, i)
        with lock:
            counts.setdefault(kind, {}).setdefault(outcome, 0)
            counts[kind][outcome] += 1
            if outcome in ("failed", "error"):
                failures.append({"t": round(time.monotonic() - t_start, 1), "model": name, "kind": kind,
                                 "outcome": outcome, "latency_s": round(time.monotonic() - t0, 2),
                                 "detail": detail})  # fmt: skip

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, (offset, name, kind) in enumerate(events):
            if stop.wait(max(0.0, t_start + offset - time.monotonic())):
                break
            pool.submit(one, i, name, kind)


class LoadDriver:
    """``drive`` on a daemon thread. ``counts`` and ``failures`` accumulate over every
    ``start`` (soak's warm-up and soak phases add up); ``stop`` ends the current phase early
    (no event sent after it; requests in flight finish)."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers!r}")
        self.workers = workers
        self.counts: dict[str, dict[str, int]] = {}
        self.failures: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, client, events) -> None:
        """Send ``events`` at their offsets from now, on a new thread (a new phase)."""
        if self.is_alive():
            raise RuntimeError("the previous phase is still running")
        self._stop = threading.Event()
        args = (client, events, time.monotonic(), self._stop, self.counts, self.failures, self._lock, self.workers)
        self._thread = threading.Thread(target=drive, args=args, daemon=True)
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
    (``--request-timeout-s``, ``--workers``) and where results go (``benchmark/results/<name>/<name>.json``)."""
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--rate", type=float, default=rate, help="requests/s per model while ON")
    ap.add_argument("--memory-mb", type=float, default=8.0, help="the CPU device's memory for all three models")
    ap.add_argument("--host-buffer-gb", type=float, default=0.05)
    ap.add_argument("--sleep-after-s", type=float, default=8.0)
    ap.add_argument("--request-timeout-s", type=float, default=180.0)
    ap.add_argument("--workers", type=int, default=24, help="client threads (requests in flight at most)")
    ap.add_argument("--results-dir", default=str(REPO / "benchmark" / "results" / name))
    ap.add_argument("--out", default=name)
