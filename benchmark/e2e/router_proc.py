"""``sglang-memx serve`` as a child process of a benchmark, and what the benchmark reads of it
(the router's JSON routes, the processes it started and their RSS / open fds).

Shared by ``e2e/consolidation.py`` and ``soak.py``. Linux only (``/proc``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support.server import LOG_DIR

PROC = Path("/proc")
# Upstream's process titles (``setproctitle`` in sglang/srt/managers/scheduler.py and
# detokenizer_manager.py): role -> (title prefix, titles with that prefix that are not the role).
ROLE_TITLES = {
    "scheduler": ("sglang::scheduler", ()),
    "detokenizer": ("sglang::detokenizer", ("sglang::detokenizer_router",)),
}


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0, headers: dict | None = None):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


class Serve:
    """``sglang-memx serve --config`` in its own session; ``stop`` (SIGTERM to the session, then
    SIGKILL after 90 s) leaves no engine behind. Its output goes to ``test-logs/<name>.log``;
    ``env``: variables added to this process's environment for it."""

    def __init__(self, config: Path, port: int, name: str, env: dict[str, str] | None = None):
        self.url = f"http://127.0.0.1:{port}"
        LOG_DIR.mkdir(exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_memx.cli", "serve", "--config", str(config)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})  # fmt: skip

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Until the router's ``/health`` says every engine is up; raises if serve exits first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if http_json(self.url + "/health", timeout=5).get("status") == "ok":
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"router not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> int | None:
        """Stop serve and everything it started; its exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
                self._log.close()
                return None
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


def _children(proc: Path = PROC) -> dict[int, list[int]]:
    """ppid -> pids of every process now visible in ``proc`` (/proc; a fake tree in tests)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            stat = (proc / entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(root: int, proc: Path = PROC) -> list[int]:
    """``root`` and all its descendants (a snapshot; processes may come and go)."""
    kids, out, todo = _children(proc), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def process_titles(pid: int, proc: Path = PROC) -> tuple[str, str]:
    """``(cmdline's first field, comm)`` of ``pid``; ``setproctitle`` sets both (comm cut to 15
    bytes); empty strings when it is gone."""
    try:
        cmd = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        return cmd, (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "", ""


def role_processes(root: int, role: str, proc: Path = PROC) -> list[int]:
    """The descendants of ``root`` (an engine's ``launch_server``) that upstream titled as ``role``
    (``ROLE_TITLES``), lowest pid first; ``root`` itself never counts. Matched on the cmdline
    when it holds a ``sglang::`` title, else on comm's first 15 bytes."""
    prefix, others = ROLE_TITLES[role]
    out = []
    for pid in process_tree(root, proc)[1:]:
        cmd, comm = process_titles(pid, proc)
        if cmd.startswith("sglang::"):
            if cmd.startswith(prefix) and not cmd.startswith(others):
                out.append(pid)
        elif comm and comm.startswith(prefix[:15]):
            out.append(pid)
    return sorted(out)


def process_usage(pid: int) -> dict | None:
    """``{"pid", "cmd", "rss_bytes", "fds", "memfd_fds", "threads"}`` of a live process, None when it is gone.
    ``fds`` excludes memfds: those are memory chunks (memx's pool chunks travel as memfds and are
    created lazily up to the pool's budget), counted apart in ``memfd_fds``."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        names = os.listdir(f"/proc/{pid}/fd")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    memfds = 0
    for name in names:
        try:
            memfds += os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:")
        except OSError:
            pass  # closed meanwhile
    rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    threads = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")), 0)
    return {
        "pid": pid,
        "cmd": cmd[:200],
        "rss_bytes": rss,
        "fds": len(names) - memfds,
        "memfd_fds": memfds,
        "threads": threads,
    }
