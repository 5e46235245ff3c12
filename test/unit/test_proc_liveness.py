"""memory_ext.proc: a zombie is gone; waiting for an exit returns when (and only when) it happens."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from memory_ext.proc import pid_alive, wait_for_exit


def test_alive_then_zombie_then_reaped():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert pid_alive(p.pid)
    t0 = time.monotonic()
    while pid_alive(p.pid):  # exits, stays a zombie until reaped: already gone for us
        assert time.monotonic() - t0 < 30
        time.sleep(0.05)
    assert p.poll() is not None or os.waitpid(p.pid, os.WNOHANG)
    assert not pid_alive(p.pid) and not pid_alive(0) and not pid_alive(-1)


def test_wait_for_exit_returns_on_the_exit_not_before():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    done = threading.Event()
    threading.Thread(target=lambda: (wait_for_exit(p.pid), done.set()), daemon=True).start()
    assert not done.wait(0.5)
    p.kill()
    p.wait()
    assert done.wait(10)
    wait_for_exit(p.pid)  # already gone: returns at once


def test_wait_for_exit_works_when_fds_are_numbered_past_1024():
    """An arbiter holds an fd per memory chunk: its pidfd may be numbered beyond select's limit."""
    spare = []
    try:
        while not spare or spare[-1] < 1100:
            spare.append(os.open(os.devnull, os.O_RDONLY))
        test_wait_for_exit_returns_on_the_exit_not_before()
    finally:
        for fd in spare:
            os.close(fd)
