"""Process liveness, the one place memx asks whether a process is still there.

``pid_alive``: a zombie (exited, not yet reaped) counts as gone. ``wait_for_exit``: returns
once the process has exited; a pidfd waits for exactly that process (no pid-reuse race),
kernels without ``pidfd_open`` are polled with signal 0. The pidfd is waited on with ``poll``,
not ``select``: an arbiter holds one fd per memory chunk, so its pidfd's number can exceed
``select``'s limit (1024).
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a pid of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc entry to read: signal 0 said it exists


def wait_for_exit(pid: int, poll_s: float = 0.5) -> None:
    """Return once process ``pid`` has exited (at once if it is gone already)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        while pid_alive(pid):
            time.sleep(poll_s)
        return
    try:
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)
        waiter.poll()  # no timeout: returns only once the pidfd is readable (the process exited)
    finally:
        os.close(fd)
