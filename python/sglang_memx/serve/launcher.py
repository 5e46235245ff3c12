"""One SGLang server per placed model replica, a shared memx pool per device, nothing left behind.

``engine_specs`` is pure (config + placement -> command lines and environments);
``Engine`` runs one ``python -m sglang.launch_server`` and ``Launcher`` runs them all.

Invariants:

* Every engine (each replica of each model, ``engine_specs.py``) is started, supervised and
  stopped alike, keyed by its instance name in ``Launcher.engines`` (replica 0: the
  model's name).
* If this process dies, a sentinel process (``sentinel.py``) stops every engine group
  whatever state it was in, and the pool's arbiter ends with this process too
  (``--owner-pid``); each engine also gets SIGTERM (``engine.py``). ``stop_all`` kills every group,
  stops the pool arbiters the engines started and the sentinel: after it returns, no
  process this launcher started is running.
* Health (``Launcher.supervise``): one supervisor thread polls every engine; an engine
  whose process exited (crash, SIGKILL, OOM kill) is cleaned up (its process group is
  killed, the pool's arbiter frees its chunks when its socket closes) and started again
  with the same command line on the same port after a backoff (``RestartPolicy``:
  exponential, at most ``max_restarts`` attempts within ``window_s``, then the engine is
  ``dead``). Every restart, failure and its duration is logged and counted. The supervisor
  thread is also the one that spawns restarted engines and lives until ``stop_all``
  (``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits).
* Hangs (``HealthProbe``): an awake engine whose process is alive is probed every
  ``interval_s`` (one probe at a time per engine, in its own thread, so a probe that waits
  never delays the supervision of the others); a probe without a 200 while the engine's
  process group used at least ``BUSY_CPU_FRACTION`` of a core is "busy" (a long forward on a
  slow CPU) and ends a row of failures; after ``failures`` probes in a row without a 200
  and without that CPU use the engine is hung: it leaves ``awake`` first (the router stops sending to it and
  treats its broken connections as a failed engine), its process group is SIGKILLed (a
  stopped or deadlocked process does not act on SIGTERM) and it goes the dead engine's way
  (same port, backoff, ``max_restarts``). A probe's result counts only for the process it
  probed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from memory_ext.pool.compute_board import ComputeBoard

from .. import compute_share
from ..compute_share import ComputeShares

# Re-exported: ``sglang_memx.serve.launcher`` stays the one import for the whole launch side.
from .engine import (
    AWAKE,
    DEAD,
    ENGINE_STATES,
    RESTARTING,
    SLEEPING,
    STARTING,
    WAKING,
    Engine,
    describe_exit,
)
from .engine_specs import EngineSpec, default_pool_dir, engine_specs, free_port
from .sentinel import Sentinel
from .supervision import (
    BUSY_CPU_FRACTION,
    READY_PATH,
    READY_TIMEOUT_S,
    SLEEP_POLL_S,
    HealthProbe,
    RestartBudget,
    RestartPolicy,
)

__all__ = ["EngineSpec", "engine_specs", "default_pool_dir", "free_port", "Engine", "Launcher", "EngineStartError",
           "RestartPolicy", "RestartBudget", "ENGINE_STATES", "STARTING", "AWAKE", "RESTARTING", "DEAD",
           "SLEEPING", "WAKING", "describe_exit", "HealthProbe", "stop_pool", "process_running"]  # fmt: skip


class EngineStartError(RuntimeError):
    pass


class Launcher:
    """Start every engine concurrently, wait until all answer /health, stop them all."""

    def __init__(self, specs: list[EngineSpec], log=None):
        self.engines = {s.key: Engine(s) for s in specs}  # by instance name (replica 0: the model's name)
        self._pools = sorted({(s.pool, s.pool_dir) for s in specs})
        self._boards = {s.env[compute_share.BOARD_ENV]: len(ComputeShares.parse(s.env[compute_share.SHARES_ENV]).shares)
                        for s in specs if compute_share.BOARD_ENV in s.env}  # fmt: skip
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._health: HealthProbe | None = None  # set by ``supervise``: no probing before
        self._sentinel: Sentinel | None = None

    def start_all(self, timeout_s: float) -> None:
        if self.engines and self._sentinel is None:  # stops every engine group if this process is killed
            first = Path(next(iter(self.engines.values())).spec.log_path).parent
            self._sentinel = Sentinel.spawn(first / f".sglang-memx-serve-{os.getpid()}.groups")
            for e in self.engines.values():
                e.on_started = self._sentinel.track
        for path, slots in self._boards.items():  # before any engine reads it
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            ComputeBoard.create(path, slots).close()
        for e in self.engines.values():
            e.start()
            self._log(f"sglang-memx serve: starting {e.spec.key} on {e.spec.device} (pid {e.pid}, port {e.port}, "
                      f"log {e.spec.log_path})")  # fmt: skip
        deadline = time.monotonic() + timeout_s
        waiting = dict(self.engines)
        retried = set()
        try:
            while waiting:
                for name, e in list(waiting.items()):
                    if name not in retried and e.port_taken():
                        retried.add(name)
                        e.restart_on_new_port()
                        continue
                    if not e.alive():
                        raise EngineStartError(f"engine {name!r} exited with status {e.proc.returncode} during "
                                               f"start-up; log {e.spec.log_path}:\n{e.log_tail()}")  # fmt: skip
                    if e.healthy():
                        e.startup_s = time.monotonic() - e._t0
                        e.state = AWAKE
                        self._log(f"sglang-memx serve: {name} ready at {e.url} in {e.startup_s:.1f} s")
                        del waiting[name]
                if waiting and time.monotonic() > deadline:
                    names = ", ".join(waiting)
                    raise EngineStartError(f"engine(s) {names} not healthy after {timeout_s:.0f} s")
                if waiting:
                    time.sleep(0.5)
        except BaseException:
            self.stop_all()
            raise

    def dead(self) -> list[str]:
        return [n for n, e in self.engines.items() if not e.alive()]

    # ------------------------------------------------------------------ health
    def supervise(self, policy: RestartPolicy | None = None, startup_timeout_s: float = 600.0,
                  interval_s: float = 0.2, clock=time.monotonic,
                  health: HealthProbe | None = None) -> None:  # fmt: skip
        """Start the supervisor thread (after ``start_all``): dead engines are restarted, and with
        ``health`` live ones are probed and restarted when hung."""
        self.configure_restarts(policy, startup_timeout_s, clock, health)
        self._stop_evt = threading.Event()
        self._thread = threading.Thread(target=self._supervise_loop, args=(interval_s,), name="memx-serve-supervisor",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def configure_restarts(self, policy: RestartPolicy | None, startup_timeout_s: float, clock=time.monotonic,
                           health: HealthProbe | None = None):  # fmt: skip
        self._policy = policy or RestartPolicy()
        self._startup_timeout_s = startup_timeout_s
        self._clock = clock
        self._health = health
        now = clock()
        for e in self.engines.values():
            if e.budget is None:
                e.budget = RestartBudget(self._policy)
            if health is not None:
                e.reset_probes(now, health.interval_s)

    def _supervise_loop(self, interval_s: float) -> None:
        while not self._stop_evt.wait(interval_s):
            try:
                self.tick(self._clock())
            except Exception as exc:  # never let the supervisor die: log and go on
                self._log(f"sglang-memx serve: supervisor error: {type(exc).__name__}: {exc}")

    def tick(self, now: float) -> None:
        """One supervision step over every engine (the thread calls it; tests call it directly)."""
        for e in self.engines.values():
            if getattr(self, "_stop_evt", None) is not None and self._stop_evt.is_set():
                return
            self._tick_engine(e, now)

    def _schedule(self, e: Engine, now: float) -> None:
        delay = e.budget.next_delay(now)
        if delay is None:
            e.state = DEAD
            e._try_at = None
            n = len(e.budget.attempts)
            self._log(f"sglang-memx serve: {e.spec.key} is dead: {n} restart attempt(s) within "
                      f"{self._policy.window_s:g} s; not restarting it again (log {e.spec.log_path})")  # fmt: skip
            return
        e._try_at = now + delay
        self._log(f"sglang-memx serve: restarting {e.spec.key} in {delay:g} s (attempt "
                  f"{len(e.budget.attempts) + 1} of {self._policy.max_restarts})")  # fmt: skip

    def _tick_engine(self, e: Engine, now: float) -> None:
        name = e.spec.key
        if e.state == AWAKE:
            if e.alive():
                if self._health is not None and self._check_health(e, now):
                    return
                if now - e._sleep_polled >= SLEEP_POLL_S:
                    e._sleep_polled = now
                    e.poll_sleep()
                return
            e.last_exit = describe_exit(e.proc.returncode if e.proc is not None else None)
            self._log(f"sglang-memx serve: {name} (pid {e.pid}, port {e.port}) {e.last_exit}; log tail:\n"
                      f"{e.log_tail(10)}")  # fmt: skip
            e.state = RESTARTING  # first: the router stops sending to it at once
            e._down_since = now
            e.stop(grace_s=2.0)  # its scheduler / detokenizer leftovers
            self._schedule(e, now)
        elif e.state == RESTARTING:
            if e.proc is None:
                if e._try_at is not None and now >= e._try_at:
                    e.budget.record(now)
                    e.start(append=True)
                    e._ready_by = now + self._startup_timeout_s
                    self._log(f"sglang-memx serve: started {name} again (pid {e.pid}, port {e.port})")
                return
            if not e.alive() or now > e._ready_by:
                why = describe_exit(e.proc.returncode) if not e.alive() else "not healthy in time"
                e.restart_failures += 1
                self._log(f"sglang-memx serve: restart of {name} failed ({why}); log tail:\n{e.log_tail(10)}")
                e.stop(grace_s=2.0)
                self._schedule(e, now)
            elif self._ready(e):
                if self._health is not None:
                    e.reset_probes(now, self._health.interval_s)
                took = now - e._down_since
                e.restarts += 1
                e.restart_seconds_total += took
                e.last_restart_s = took
                e.state = AWAKE
                self._log(f"sglang-memx serve: {name} restarted at {e.url} in {took:.1f} s "
                          f"(restart {e.restarts})")  # fmt: skip

    @staticmethod
    def _ready(e: Engine) -> bool:
        """Whether the restarted process answered a readiness probe (``READY_PATH`` within
        ``READY_TIMEOUT_S``); starts the next one when none is in flight. Probes run in their own
        thread: the supervisor never waits on one engine while it watches the others. A probe of
        an earlier process (a health probe in flight when it died) counts for nothing."""
        done = e.probe_outcome()
        if done is not None and done[0] is e.proc and done[1] is None:
            return True
        if e._probe_thread is None:
            e.start_probe(READY_PATH, READY_TIMEOUT_S)
        return False

    def _check_health(self, e: Engine, now: float) -> bool:
        """Take a finished probe's result, start the next one when due; True when ``e`` was found
        hung (then it is killed and scheduled for a restart)."""
        h = self._health
        done = e.probe_outcome()
        if done is not None:
            probed, error, busy = done
            e._probe_at = now + h.interval_s
            if probed is e.proc:  # a result about an earlier process counts for nothing
                if error is None:
                    e.probe_failures, e.last_probe_error, e._answered_at = 0, None, now
                elif busy >= BUSY_CPU_FRACTION:  # computing (e.g. one long prefill): slow, not hung
                    e.busy_probes += 1
                    e.probe_failures, e.last_probe_error = 0, f"{error} (busy: {busy:.0%} of a core)"
                else:
                    e.probe_failures += 1
                    e.last_probe_error = error
                    if e.probe_failures >= h.failures:
                        self._hung(e, now)
                        return True
        if e._probe_thread is None and e._probe_at is not None and now >= e._probe_at:
            e.start_probe(h.path, h.timeout_s)
        return False

    def _hung(self, e: Engine, now: float) -> None:
        silent = now - (e._answered_at if e._answered_at is not None else now)
        path = self._health.path
        e.last_exit = f"hung: no {path} answer for {silent:.0f} s"
        e.hangs += 1
        e.state = RESTARTING  # first: the router stops sending to it, its broken connections count as a failure
        e._down_since = now
        self._log(f"sglang-memx serve: {e.spec.key} (pid {e.pid}, port {e.port}) is hung: no {path} answer for "
                  f"{silent:.1f} s ({e.probe_failures} probes in a row failed, last: {e.last_probe_error}); "
                  f"killing its process group (SIGKILL); log tail:\n{e.log_tail(10)}")  # fmt: skip
        e.kill()
        self._schedule(e, now)

    def stop_supervising(self) -> None:
        evt, thread = getattr(self, "_stop_evt", None), getattr(self, "_thread", None)
        if evt is not None:
            evt.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def stop_all(self) -> None:
        self.stop_supervising()
        for e in self.engines.values():
            if e.alive():
                try:
                    os.killpg(e.proc.pid, signal.SIGTERM)  # all at once, then wait for each
                except ProcessLookupError:
                    pass
        for e in self.engines.values():
            e.stop()
        for pool, directory in self._pools:
            stop_pool(pool, directory)
        for path in self._boards:
            Path(path).unlink(missing_ok=True)
        if self._sentinel is not None:  # nothing left for it to stop
            self._sentinel.stop()
            self._sentinel = None


def stop_pool(name: str, directory: str, timeout_s: float = 10.0) -> bool:
    """SIGTERM the arbiter of pool ``name`` (its pid file) and wait for it; False if none ran."""
    pid_file = Path(directory) / f"{name}.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_running(pid):
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def process_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an exited arbiter may wait for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
