"""The serve sentinel: a SIGKILLed ``sglang-memx serve`` leaves no engine process group behind,
including children whose group leader is already gone (upstream's scheduler / detokenizer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from sglang_memx.serve.sentinel import Sentinel, read_groups, stop_groups

# A group like an engine's: a leader that starts a child and, on SIGTERM, exits at once (as a
# launch_server still importing does), leaving the child running in the group.
ENGINE = textwrap.dedent("""
    import signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(600)
""")


def _group(script: str = ENGINE) -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    child = int(leader.stdout.readline())
    return leader, child


def _members(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait_gone(pgid: int, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while _members(pgid):
        assert time.monotonic() - t0 < timeout, f"group {pgid} still has members"
        time.sleep(0.1)


def test_stop_groups_takes_the_orphaned_children_too():
    leader, child = _group()
    try:
        leader.send_signal(signal.SIGTERM)
        leader.wait(20)
        assert _members(leader.pid)  # the child outlived its leader, still in the group
        assert stop_groups([leader.pid], grace_s=5.0, log=lambda m: None) == [leader.pid]
        _wait_gone(leader.pid, 5)
    finally:
        for p in (leader.pid, child):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace():
    stubborn = textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(0, flush=True)
        time.sleep(600)
    """)
    leader, _ = _group(stubborn)
    logs = []
    t0 = time.monotonic()
    stop_groups([leader.pid], grace_s=1.0, log=logs.append)
    leader.wait(10)
    assert time.monotonic() - t0 >= 1.0 and "SIGKILLed" in logs[0]


def test_killing_serve_makes_its_sentinel_stop_every_tracked_group(tmp_path):
    """The owner plays serve: it spawns the sentinel, starts an engine-like group, tracks it, and
    is SIGKILLed; the sentinel then stops the group (leader and child) and exits."""
    owner_script = textwrap.dedent(f"""
        import subprocess, sys, time
        from pathlib import Path
        from sglang_memx.serve.sentinel import Sentinel
        s = Sentinel.spawn(Path({str(tmp_path / "g.groups")!r}), grace_s=5.0)
        leader = subprocess.Popen([sys.executable, "-c", {ENGINE!r}], stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
        child = int(leader.stdout.readline())
        s.track(leader.pid)
        print(s.proc.pid, leader.pid, child, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE, text=True)
    sentinel, leader, child = map(int, owner.stdout.readline().split())
    try:
        assert read_groups(tmp_path / "g.groups") == [leader]
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        _wait_gone(leader, 30)
        t0 = time.monotonic()
        while True:  # the sentinel exits after its work
            try:
                os.kill(sentinel, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() - t0 < 30
            time.sleep(0.1)
    finally:
        for p in (leader, child, sentinel):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_clean_stop_leaves_the_groups_alone(tmp_path):
    s = Sentinel.spawn(tmp_path / "g.groups", grace_s=1.0)
    leader, child = _group()
    try:
        s.track(leader.pid)
        s.stop()
        assert s.proc.returncode in (0, -signal.SIGTERM)  # SIGTERMed before or after its handler was up
        assert not (tmp_path / "g.groups").exists()
        time.sleep(0.5)
        assert leader.poll() is None  # untouched: stopping the engines is stop_all's job
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)


def test_the_groups_file_skips_junk(tmp_path):
    (tmp_path / "g").write_text("12\nx\n-3\n1\n0\n12\n40\n")
    assert read_groups(tmp_path / "g") == [12, 40]
    assert read_groups(tmp_path / "missing") == []


def test_bad_arguments_are_named():
    r = subprocess.run([sys.executable, "-m", "sglang_memx.serve.sentinel", "--owner", "0", "--groups", "x"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--owner" in r.stderr
