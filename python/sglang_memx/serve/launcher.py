"""One SGLang server per placed model replica, a shared memx pool per device, nothing left behind.

``engine_specs`` is pure (config + placement -> command lines and environments);
``Engine`` runs one ``python -m sglang.launch_server`` and ``Launcher`` runs them all.

Invariants:

* Replicas: every replica of a model (``placement.instance_name``) is one engine with its
  own port, log and cores, keyed by its instance name in ``Launcher.engines`` (replica 0:
  the model's name) and started, supervised and stopped like any other.
* Every engine of a device gets ``--memx-elastic-kv --memx-pool <device pool>
  --memx-pool-budget-gb <device budget>`` with the same pool name and budget, so the first
  server to start creates the device's arbiter and the others join it.
* CPU devices: their cores are split among the device's servers (each server's OpenMP
  threads on its own cores; two unpinned CPU servers on shared cores run many times
  slower); CUDA devices: ``CUDA_VISIBLE_DEVICES`` is the device's ordinal.
* Each engine runs in its own session (its scheduler and detokenizer in its process
  group) and gets SIGTERM if this process dies (``PR_SET_PDEATHSIG``); a sentinel process
  (``sentinel.py``) then stops every engine group whatever state it was in, and the pool's
  arbiter ends with this process too (``--owner-pid``). ``stop_all`` kills every group,
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

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from memory_ext.pool.compute_board import ComputeBoard

from .. import compute_share
from ..compute_share import ComputeShares
from ..config import POOL_OWNER_ENV
from .config import ServeConfig
from .placement import GIB, Placement, instance_name
from .sentinel import Sentinel

__all__ = ["EngineSpec", "engine_specs", "default_pool_dir", "Engine", "Launcher", "EngineStartError",
           "RestartPolicy", "RestartBudget", "ENGINE_STATES", "STARTING", "AWAKE", "RESTARTING", "DEAD",
           "SLEEPING", "WAKING", "describe_exit", "HealthProbe"]  # fmt: skip

# Engine states, as /memx/serve, `sglang-memx top` and the router's metrics show them.
STARTING, AWAKE, RESTARTING, DEAD = "starting", "awake", "restarting", "dead"
SLEEPING, WAKING = "sleeping", "waking"  # reported from the engine's own status (``Engine.sleep``), not set here
SLEEP_POLL_S = 1.0  # how often the supervisor reads a sleeping-capable engine's state
ENGINE_STATES = (STARTING, AWAKE, SLEEPING, WAKING, RESTARTING, DEAD)
# Readiness of a (re)started engine: upstream's /health runs a one-token generation and sleeps a
# whole second before it looks for the answer, so it never answers in under 1 s. A 1-second
# timeout passed only when asyncio's timer fired a hair early; on other machines a restarted
# engine never became awake (issue 27).
READY_PATH = "/health"
READY_TIMEOUT_S = 10.0

CPU_DEFAULTS = {
    "--attention-backend": "torch_native",
    "--cuda-graph-backend-decode": "disabled",
    "--cuda-graph-backend-prefill": "disabled",
}


class EngineStartError(RuntimeError):
    pass


def default_pool_dir() -> str:
    """memx's own default for --memx-pool-dir ($XDG_RUNTIME_DIR/sglang-memx, else /tmp/sglang-memx-$UID)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return str(Path(runtime) / "sglang-memx") if runtime else f"/tmp/sglang-memx-{os.getuid()}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class EngineSpec:
    model: str
    device: str
    pool: str
    pool_dir: str
    port: int
    argv: tuple[str, ...]
    env: dict = field(hash=False)  # only the variables set on top of os.environ
    log_path: str
    replica: int = 0  # which replica of ``model`` (0 .. min_replicas - 1)

    @property
    def key(self) -> str:
        """The engine's name: ``instance_name(model, replica)`` (the model's name for replica 0)."""
        return instance_name(self.model, self.replica)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine is brought back: the k-th attempt within ``window_s`` waits
    ``min(backoff_max_s, backoff_s * 2**k)`` first; after ``max_restarts`` attempts within
    the window the engine is left ``dead`` (``max_restarts=0``: never restart)."""

    max_restarts: int = 3
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self):
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for name in ("window_s", "backoff_s", "backoff_max_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class HealthProbe:
    """How live engines are probed: a GET of ``path`` every ``interval_s`` (counted from the end
    of the previous probe, so probes never overlap), each given ``timeout_s``; ``failures``
    probes in a row without a 200 while the process lives: hung. The engine is declared hung
    at the earliest ``failures * timeout_s + (failures - 1) * interval_s`` after it stopped
    answering (plus up to one interval)."""

    interval_s: float = 5.0
    timeout_s: float = 10.0
    failures: int = 3
    path: str = "/memx/status"

    def __post_init__(self):
        for name in ("interval_s", "timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if isinstance(self.failures, bool) or not isinstance(self.failures, int) or self.failures < 1:
            raise ValueError(f"failures must be an integer >= 1, got {self.failures!r}")
        if not isinstance(self.path, str) or not self.path.startswith("/"):
            raise ValueError(f"path must be an absolute URL path, got {self.path!r}")


class RestartBudget:
    """The attempts of one engine within the policy's window (pure: time is passed in)."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.attempts: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next attempt, or None when the budget is spent."""
        while self.attempts and now - self.attempts[0] > self.policy.window_s:
            self.attempts.popleft()
        k = len(self.attempts)
        if k >= self.policy.max_restarts:
            return None
        return min(self.policy.backoff_max_s, self.policy.backoff_s * (2**k))

    def record(self, now: float) -> None:
        self.attempts.append(now)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _has(args, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _split_cores(cores: list[int], n: int) -> list[list[int]]:
    """n near-equal contiguous shares of ``cores`` (shared round-robin when there are fewer cores)."""
    if len(cores) >= n:
        per, extra = divmod(len(cores), n)
        out, i = [], 0
        for k in range(n):
            take = per + (1 if k < extra else 0)
            out.append(cores[i : i + take])
            i += take
        return out
    return [[cores[k % len(cores)]] for k in range(n)]


def compute_board_path(pool: str, pool_dir: str) -> str:
    """The compute board of a CPU device's engines (``sglang_memx.compute_share``), beside its pool."""
    return str(Path(pool_dir) / f"{pool}.compute")


def engine_specs(
    config: ServeConfig,
    placement: Placement,
    run_id: str,
    *,
    ports: dict[str, int] | None = None,
    python: str = sys.executable,
    log_dir: str | None = None,
    api_key: str | None = None,
) -> list[EngineSpec]:
    """The command line and environment of every engine, in config order, a model's replicas
    together (``api_key``: upstream's ``--api-key``, so the engines answer only the router;
    ``ports``: by instance name)."""
    log_root = Path(log_dir or config.launch.log_dir or "sglang-memx-serve-logs")
    pool_dir = config.launch.pool_dir or default_pool_dir()
    cuda_seen = 0
    cuda_index, shares = {}, {}
    for d in config.devices:
        if d.kind == "cuda":
            cuda_index[d.name] = d.index if d.index is not None else cuda_seen
            cuda_seen += 1
        else:
            residents = placement.devices[d.name].models
            if residents:
                cores = list(d.cores) if d.cores is not None else sorted(os.sched_getaffinity(0))
                shares.update(zip(residents, _split_cores(cores, len(residents))))
    specs = []
    replicas = [
        (m, r, inst, dev) for m in config.models for r, (inst, dev) in enumerate(placement.models[m.name].replicas)
    ]
    for m, replica, inst, device in replicas:
        placed = placement.models[m.name]
        dev = config.device(device)
        plan = placement.devices[dev.name]
        pool = f"serve-{dev.name}-{run_id}"
        port = (ports or {}).get(inst) or free_port()
        args = [python, "-m", "sglang.launch_server", "--model-path", m.path, "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", m.name, "--device", dev.kind,
                "--max-total-tokens", str(placed.max_total_tokens)]  # fmt: skip
        if m.dtype != "auto":
            args += ["--dtype", m.dtype]
        if m.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", m.kv_cache_dtype]
        # the pool's arbiter (started by the first engine) ends when this process does
        env = {"PYTHONUNBUFFERED": "1", POOL_OWNER_ENV: str(os.getpid())}
        if dev.kind == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            for flag, value in CPU_DEFAULTS.items():
                if not _has(m.server_args, flag):
                    args += [flag, value]
            mine = shares[inst]
            env["SGLANG_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
            env["OMP_NUM_THREADS"] = str(len(mine))
            residents = plan.models
            if dev.lend_idle_cores and len(residents) > 1:  # a busy engine computes on idle siblings' cores
                env[compute_share.BOARD_ENV] = compute_board_path(pool, pool_dir)
                env[compute_share.SLOT_ENV] = str(residents.index(inst))
                env[compute_share.SHARES_ENV] = ComputeShares(tuple(tuple(shares[r]) for r in residents)).render()
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(cuda_index[dev.name])
        if not _has(m.server_args, "--sleep-on-idle"):  # co-located engines share the host's cores:
            args.append("--sleep-on-idle")  # an idle one waits on its sockets instead of spinning a core
        args += ["--memx-elastic-kv", "--memx-pool", pool, "--memx-pool-budget-gb",
                 repr(plan.pool_budget_bytes / GIB), "--memx-pool-dir", pool_dir]  # fmt: skip
        if api_key:
            args += ["--api-key", api_key]
        if m.sleep_after_s is not None:  # remappable weights in the pool: what a sleeping engine releases
            args += ["--memx-weights", "remap", "--memx-sleep-after-s", repr(float(m.sleep_after_s))]
        args += list(config.launch.memx_args) + list(m.server_args)
        log = log_root / f"{inst.replace('/', '_').replace('#', '.replica')}.log"
        specs.append(EngineSpec(m.name, dev.name, pool, pool_dir, port, tuple(args), env, str(log), replica))
    return specs


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


BUSY_CPU_FRACTION = 0.1  # a group using this much of one core while a probe waited is computing, not hung


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


class Launcher:
    """Start every engine concurrently, wait until all answer /health, stop them all."""

    def __init__(self, specs: list[EngineSpec], log=None):
        self.engines = {s.key: Engine(s) for s in specs}  # by instance name (replica 0: the model's name)
        self._pools = sorted({(s.pool, s.pool_dir) for s in specs})
        self._boards = {s.env[compute_share.BOARD_ENV]: len(ComputeShares.parse(
            s.env[compute_share.SHARES_ENV]).shares) for s in specs if compute_share.BOARD_ENV in s.env}  # fmt: skip
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
