"""Start and stop real SGLang servers on CPU for integration tests.

``SGLangServer`` runs ``python -m sglang.launch_server`` in its own process
group with the CPU flags, logs to a file under test-logs/, waits for
/health, and on stop kills the whole group (scheduler and detokenizer too).
``stock=True`` filters the memx plugin out with SGLANG_PLUGINS, leaving every
other installed plugin loaded, which is exactly stock SGLang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

from sglang_memx.ports import free_port
from sglang_memx.serve.launcher import stop_pool

REPO = Path(__file__).resolve().parents[2]
LOG_DIR = REPO / "test-logs"
# upstream's CPU engine at --tp 2 (docs/models.md): a rank on each core, and an NCCL library that fails to
# load so that upstream's PyNccl stays off and gloo does the all-reduce
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}
# how often a starting server is asked for /health (a server is ready ~this / 2 sooner on average)
READY_POLL_S = 0.25

# Every test server, stock or memx, sleeps when idle (upstream's --sleep-on-idle: its scheduler
# waits on its sockets, at most 1 s, instead of spinning): an idle server of a module would
# otherwise take a core from the busy one on these 2-core machines.
CPU_ARGS = [
    "--sleep-on-idle",
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
]


def plugins_without_memx() -> str:
    names = sorted(ep.name for ep in entry_points(group="sglang.srt.plugins") if ep.name != "memx")
    # An empty SGLANG_PLUGINS means "no filter", so name a plugin that does not exist.
    return ",".join(names) or "no-such-plugin"


class SGLangServer:
    def __init__(
        self,
        model_path,
        *,
        name: str,
        stock: bool = False,
        max_total_tokens: int = 4096,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.model_path = str(model_path)
        self.name = name
        self.stock = stock
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *CPU_ARGS,
            "--max-total-tokens",
            str(max_total_tokens),
            "--random-seed",
            "0",
            *(extra_args or []),
        ]
        self.env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONUNBUFFERED="1")
        if stock:
            self.env["SGLANG_PLUGINS"] = plugins_without_memx()
        self.env.update(env or {})
        LOG_DIR.mkdir(exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        # Set by ``SharedServers``: the session owns this server, so a module's ``stop_all`` /
        # ``release_all`` leaves it running for the next module that asks for the same spec.
        self.shared = False

    def spec_key(self) -> tuple:
        """Everything that shapes this server's answers: its argv without the port, stock or memx,
        and the environment it adds (thread binding included)."""
        i = self.args.index("--port")
        argv = tuple(self.args[:i] + self.args[i + 2 :])
        added = tuple(sorted((k, v) for k, v in self.env.items() if os.environ.get(k) != v))
        return (argv, self.stock, added)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ----------------------------------------------------------------- process
    def start(self) -> SGLangServer:
        self._log = open(self.log_path, "w")
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        return self

    def _port_taken(self) -> bool:
        try:
            return "address already in use" in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def _restart_on_new_port(self) -> None:
        """The port picked at construction was taken meanwhile (another server's internal ports)."""
        self.stop()
        i = self.args.index("--port")
        self.port = free_port()
        self.args[i + 1] = str(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def wait_ready(self, timeout: float = 420.0) -> SGLangServer:
        deadline = time.monotonic() + timeout
        retried = False
        while time.monotonic() < deadline:
            if not retried and self._port_taken():
                retried = True
                self._restart_on_new_port()
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server {self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - self._t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(READY_POLL_S)
        self.stop()
        raise TimeoutError(f"server {self.name} not healthy after {timeout}s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        self.terminate()
        self.reap()

    def terminate(self) -> None:
        """SIGTERM the server's process group (no wait): ``stop_all`` signals every server first."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` for the signalled server, then SIGKILL its whole group."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # scheduler / detokenizer leftovers
        except ProcessLookupError:
            pass
        self._log.close()
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    # ---------------------------------------------------------------- requests
    def request(self, path: str, payload: dict | None = None, timeout: float = 300.0):
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def request_text(self, path: str, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Empty the prefix cache (upstream's ``/flush_cache``). Upstream answers 400 while a request
        is still pending, which a refused request can be for a moment after its own 400 (seen:
        ``#running-req: 1`` right after a too-long prompt's refusal); retry until it flushes, else
        raise naming the server."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.request_text("/flush_cache")
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 400 or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: /flush_cache failed: {exc}") from exc
                time.sleep(0.2)

    def generate(self, text, **sampling) -> dict:
        return self.request("/generate", {"text": text, "sampling_params": sampling})


def pin_to_cores(servers: list[SGLangServer]) -> None:
    """Give each server its own core(s) so their OpenMP threads never spin against
    each other (two unpinned CPU servers on 2 cores run ~15x slower). A server already
    running (a shared one) keeps its binding but counts when the cores are shared out."""
    cores = os.sched_getaffinity(0)
    ordered = sorted(cores)
    per = max(1, len(ordered) // len(servers))
    for i, server in enumerate(servers):
        if server.running:
            continue
        mine = ordered[(i * per) % len(ordered) :][:per] or ordered[:per]
        server.env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
        server.env.setdefault("OMP_NUM_THREADS", str(len(mine)))


def _own(servers) -> list[SGLangServer]:
    return [s for s in servers if not s.shared]


def stop_all(servers) -> None:
    """Stop servers together: every group gets its SIGTERM first, then each is waited for (their
    graceful shutdowns overlap instead of adding up), and ``stop`` (a subclass's too) finishes each.
    Shared servers (``SharedServers``) are left running: the session stops them."""
    servers = _own(servers)
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


_RELEASED: list[threading.Thread] = []


def release_all(servers) -> None:
    """Stop servers without waiting for their graceful shutdowns: every group gets its SIGTERM now
    and one background thread finishes each (``stop``: SIGKILL of what is left after ``reap``'s
    timeout), so the next module starts while they exit. ``join_released`` (the session's end)
    waits for every one. Use ``stop_all`` where the teardown needs them gone (a pool stop after)."""
    servers = _own(servers)
    for s in servers:
        s.terminate()
    for s in servers:
        t = threading.Thread(target=s.stop, name=f"release-{s.name}", daemon=True)
        t.start()
        _RELEASED.append(t)


def release_with_pool(servers, pool: str, pool_dir) -> None:
    """``release_all`` for servers on a shared pool, then that pool's arbiter: one background
    thread waits for every server to exit and only then runs ``sglang-memx pool stop`` (the
    arbiter outlives its clients by design); the next module starts meanwhile, and
    ``join_released`` waits for the thread."""
    servers = _own(servers)
    for s in servers:
        s.terminate()

    def finish() -> None:
        try:
            for s in servers:
                s.stop()
        finally:  # in this process: a python started from this thread once failed with EFAULT in CI,
            # and the arbiter outlived the session
            stop_pool(pool, str(pool_dir))  # SIGTERM, wait, SIGKILL after its timeout

    t = threading.Thread(target=finish, name=f"release-pool-{pool}", daemon=True)
    t.start()
    _RELEASED.append(t)


def join_released() -> None:
    while _RELEASED:
        _RELEASED.pop().join()


def start_all(servers: list[SGLangServer], timeout: float = 420.0) -> list[SGLangServer]:
    """Start servers concurrently (each pinned to its own cores) and wait for all; a shared server
    that is already running is only waited for. Stop the module's own servers if one fails."""
    new = [s for s in servers if not s.running]
    if len(servers) > 1:
        pin_to_cores(servers)
    for s in new:
        s.start()
    try:
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        stop_all(servers)
        raise
    return servers
