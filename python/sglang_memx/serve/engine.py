"""One engine process: ``python -m sglang.launch_server`` started from its ``EngineSpec``,
probed, stopped.

Invariants:

* Each engine runs in its own session (its scheduler and detokenizer in its process
  group, whose id is its pid) and gets SIGTERM if the thread that started it dies
  (``PR_SET_PDEATHSIG``); ``stop`` and ``kill`` end the whole group.
* A probe runs in its own thread and its result names the process it probed
  (``probe_outcome``), so a result about an earlier process can be told apart.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .engine_specs import EngineSpec, free_port
from .supervision import RestartBudget

__all__ = ["Engine", "ENGINE_STATES", "STARTING", "AWAKE", "RESTARTING", "DEAD", "SLEEPING", "WAKING",
           "describe_exit", "group_cpu_s"]  # fmt: skip

# Engine states, as /memx/serve, `sglang-memx top` and the router's metrics show them.
STARTING, AWAKE, RESTARTING, DEAD = "starting", "awake", "restarting", "dead"
SLEEPING, WAKING = "sleeping", "waking"  # reported from the engine's own status (``Engine.sleep``), not set here
ENGINE_STATES = (STARTING, AWAKE, SLEEPING, WAKING, RESTARTING, DEAD)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``."""
    ticks = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(f) > 12 and f[2] == str(pgid):  # fields 5 (pgrp), 14 (utime), 15 (stime) of proc(5)
            ticks += int(f[11]) + int(f[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class _Probe(threading.Thread):
    """One health probe of one engine process; ``outcome`` = (that Popen, error or None, the
    fraction of one core its process group used meanwhile) when done."""

    def __init__(self, engine: Engine, path: str, timeout: float):
        super().__init__(name=f"memx-serve-probe-{engine.spec.key}", daemon=True)
        self.engine, self.proc, self.path, self.timeout = engine, engine.proc, path, timeout
        self.outcome: tuple | None = None

    def run(self) -> None:
        pgid = self.proc.pid if self.proc is not None else None
        cpu0, t0 = (group_cpu_s(pgid) if pgid else 0.0), time.monotonic()
        error = self.engine.probe(self.path, self.timeout)
        busy = 0.0
        if error is not None and pgid:
            busy = (group_cpu_s(pgid) - cpu0) / max(time.monotonic() - t0, 1e-3)
        self.outcome = (self.proc, error, busy)


class Engine:
    """One engine process (``launch_server`` in its own process group)."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.port = spec.port
        self.proc: subprocess.Popen | None = None
        self.on_started = None  # (pgid) -> None after every start: the launcher's sentinel tracks it
        self.startup_s: float | None = None
        self._log = None
        self.state = STARTING
        self.restarts = 0  # successful restarts
        self.restart_failures = 0  # attempts that exited or never became healthy
        self.restart_seconds_total = 0.0  # death noticed -> healthy again, summed over restarts
        self.last_restart_s: float | None = None
        self.last_exit: str | None = None  # how the engine last died
        self.budget: RestartBudget | None = None
        self._down_since: float | None = None
        self._try_at: float | None = None
        self._ready_by: float | None = None
        self.sleep: dict | None = None  # the engine's weights.sleep status (--memx-sleep-after-s), polled
        self._sleep_polled = 0.0
        self.hangs = 0  # times it was found hung and killed
        self.probe_failures = 0  # health probes in a row without a 200 while the group used no CPU (this process)
        self.busy_probes = 0  # probes without a 200 while the group computed (not counted as failures)
        self.last_probe_error: str | None = None
        self._probe_at: float | None = None  # when the next probe may start
        self._answered_at: float | None = None  # the last 200 (or the time it became awake)
        self._probe_thread: _Probe | None = None  # the probe in flight; its ``outcome`` when done

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        argv = list(self.spec.argv)
        argv[argv.index("--port") + 1] = str(self.port)
        return argv

    def start(self, append: bool = False) -> None:
        Path(self.spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.spec.log_path, "a" if append else "w")
        if append:  # a restart: keep the crash above
            self._log.write(f"\n===== sglang-memx serve: restart of {self.spec.key} at {time.ctime()} =====\n")
            self._log.flush()
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self._argv(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **self.spec.env}, start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        if self.on_started is not None:  # its own session: its pid is its process group
            self.on_started(self.proc.pid)

    def alive(self) -> bool:
        proc = self.proc  # read once: the supervisor thread may replace it meanwhile
        return proc is not None and proc.poll() is None

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None else None

    def expected_ready_s(self) -> float:
        """How long a (re)start is expected to take: the last restart's, else the first start's."""
        return self.last_restart_s or self.startup_s or 30.0

    def info(self) -> dict:
        return {
            "model": self.spec.model,
            "replica": self.spec.replica,
            "device": self.spec.device,
            "pid": self.pid,
            "port": self.port,
            "url": self.url,
            "state": self.state,
            "alive": self.alive(),
            "startup_s": self.startup_s,
            "restarts": self.restarts,
            "restart_failures": self.restart_failures,
            "restart_seconds_total": self.restart_seconds_total,
            "last_restart_s": self.last_restart_s,
            "last_exit": self.last_exit,
            "expected_ready_s": self.expected_ready_s(),
            "sleep": self.sleep,
            "hangs": self.hangs,
            "probe_failures": self.probe_failures,
            "busy_probes": self.busy_probes,
        }

    def poll_sleep(self, timeout: float = 2.0) -> None:
        """Read the engine's sleep state from its /memx/status (only engines started with
        ``--memx-sleep-after-s``); None when the engine does not reply (never a stale state)."""
        if "--memx-sleep-after-s" not in self.spec.argv:
            return
        req = self._auth(urllib.request.Request(self.url + "/memx/status"))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                doc = json.load(r)
            self.sleep = doc["schedulers"][0]["elastic_kv"]["weights"]["sleep"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
            self.sleep = None

    def _auth(self, req: urllib.request.Request) -> urllib.request.Request:
        if "--api-key" in self.spec.argv:
            req.add_header("Authorization", "Bearer " + self.spec.argv[self.spec.argv.index("--api-key") + 1])
        return req

    def probe(self, path: str, timeout: float) -> str | None:
        """One health probe: None when ``path`` answers 200 within ``timeout``, else why not."""
        try:
            with urllib.request.urlopen(self._auth(urllib.request.Request(self.url + path)), timeout=timeout) as r:
                r.read()
                return None if r.status == 200 else f"HTTP {r.status}"
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except TimeoutError:
            return f"no answer in {timeout:g} s"
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                return f"no answer in {timeout:g} s"
            return str(exc.reason)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    def start_probe(self, path: str, timeout: float) -> None:
        """Probe in a daemon thread; when it ends, the thread's ``outcome`` is (the probed Popen,
        error or None, busy fraction). A thread dropped by ``reset_probes`` is never read."""
        self._probe_thread = _Probe(self, path, timeout)
        self._probe_thread.start()

    def probe_outcome(self) -> tuple | None:
        """The finished probe's (probed Popen, error or None, busy fraction), taken once; None while
        none finished."""
        t = self._probe_thread
        if t is None or t.is_alive():
            return None
        self._probe_thread = None
        return t.outcome

    def reset_probes(self, now: float, interval_s: float) -> None:
        """A (re)started process: no failures counted, first probe one interval on."""
        self.probe_failures = 0
        self.last_probe_error = None
        self._answered_at = now
        self._probe_at = now + interval_s
        self._probe_thread = None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a hung engine: SIGTERM would wait on it)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.stop(grace_s=0)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.spec.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def port_taken(self) -> bool:
        try:
            return "address already in use" in Path(self.spec.log_path).read_text(errors="replace").lower()
        except OSError:
            return False

    def restart_on_new_port(self) -> None:
        self.stop()
        self.port = free_port()
        self.start()

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # scheduler / detokenizer leftovers
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not None:
            self._log.close()
        self.proc = None
