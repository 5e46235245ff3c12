"""Pool-arbiter helpers shared by the arbiter tests: a short socket directory, "does it
answer", and a real arbiter process (``python -m memory_ext.pool.arbiter``) that is always
killed at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memory_ext.pool.arbiter_client import ArbiterError, query_arbiter_status
from support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def socket_dir(prefix: str) -> Iterator[Path]:
    """A new directory directly under /tmp (AF_UNIX paths are limited to 107 bytes), removed
    with the files in it on exit."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def arbiter_answers(sock_path) -> bool:
    """True when an arbiter listens on ``sock_path`` and answers a status query (a bound
    socket file alone is not enough: it exists before ``listen``)."""
    try:
        query_arbiter_status(sock_path)
        return True
    except (OSError, ArbiterError):
        return False


@contextmanager
def arbiter_process(sock_path, *flags: str, timeout: float = 10.0) -> Iterator[subprocess.Popen]:
    """``python -m memory_ext.pool.arbiter --socket sock_path *flags`` as its own process (this
    checkout first on PYTHONPATH, stderr discarded), yielded once it answers; killed on exit if
    it is still running, also when it never answered."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "memory_ext.pool.arbiter", "--socket", str(sock_path), *flags],
                            env=env, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until(lambda: arbiter_answers(sock_path), timeout, "the arbiter process to listen", interval=0.01)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
