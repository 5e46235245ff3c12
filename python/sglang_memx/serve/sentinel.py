"""A small process that outlives a killed ``sglang-memx serve`` just long enough to stop what it
started.

Each engine runs in its own process group and gets SIGTERM when ``serve`` dies
(``PR_SET_PDEATHSIG``), but only the ``launch_server`` process does: its scheduler and
detokenizer are upstream's children, and an engine killed before its own signal handler is up
(e.g. one being restarted, still importing) leaves them running, holding the pool's chunks.
The sentinel closes that gap.

Invariants:

* ``serve`` starts one sentinel (``Sentinel.spawn``) in its own session, before any engine, and
  appends every engine's process-group id to the sentinel's *groups file* when it starts it
  (``Sentinel.track``; a restart appends the new group).
* When ``serve``'s pid exits for any reason the sentinel SIGTERMs every listed group that still
  has members, waits up to ``--grace-s`` for them to go, SIGKILLs what is left, and exits.
  A group with no members is skipped (``killpg(pgid, 0)`` fails), so after a clean shutdown it
  does nothing.
* ``serve``'s own clean shutdown stops the sentinel with SIGTERM after every engine is gone
  (``Sentinel.stop``): a SIGTERMed sentinel exits without touching anything.

    python -m sglang_memx.serve.sentinel --owner PID --groups FILE [--grace-s 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from memory_ext.proc import wait_for_exit


def read_groups(path: Path) -> list[int]:
    """The process-group ids in the groups file (one per line; junk lines are skipped)."""
    try:
        lines = path.read_text().split()
    except OSError:
        return []
    return sorted({int(x) for x in lines if x.isdigit() and int(x) > 1})


def _has_members(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # not ours
    return True


def stop_groups(groups: list[int], grace_s: float, log=print) -> list[int]:
    """SIGTERM every group with members, SIGKILL what is left after ``grace_s``; the groups killed."""
    live = [g for g in groups if _has_members(g)]
    for g in live:
        try:
            os.killpg(g, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_has_members(g) for g in live):
        time.sleep(0.2)
    stubborn = [g for g in live if _has_members(g)]
    for g in stubborn:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if live:
        log(f"sglang-memx sentinel: stopped process group(s) {live}" + (f", SIGKILLed {stubborn}" if stubborn else ""))
    return live


class Sentinel:
    """``serve``'s handle on its sentinel process."""

    def __init__(self, proc: subprocess.Popen, groups_file: Path):
        self.proc, self.groups_file = proc, groups_file

    @classmethod
    def spawn(cls, groups_file: Path, grace_s: float = 10.0) -> Sentinel:
        groups_file.parent.mkdir(parents=True, exist_ok=True)
        groups_file.write_text("")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_memx.serve.sentinel", "--owner", str(os.getpid()), "--groups",
             str(groups_file), "--grace-s", str(grace_s)],
            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )  # fmt: skip
        return cls(proc, groups_file)

    def track(self, pgid: int) -> None:
        with open(self.groups_file, "a") as f:
            f.write(f"{pgid}\n")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            self.groups_file.unlink()
        except OSError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_memx.serve.sentinel", description=__doc__.split("\n")[0])
    ap.add_argument("--owner", type=int, required=True, help="the sglang-memx serve process")
    ap.add_argument("--groups", required=True, help="file of engine process-group ids, one per line")
    ap.add_argument("--grace-s", type=float, default=10.0)
    args = ap.parse_args(argv)
    if args.owner <= 0:
        ap.error(f"--owner: must be a positive pid, got {args.owner}")
    if not args.grace_s >= 0:
        ap.error(f"--grace-s: must be >= 0, got {args.grace_s}")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # serve's clean shutdown: nothing to do
    wait_for_exit(args.owner)
    stop_groups(read_groups(Path(args.groups)), args.grace_s, log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
