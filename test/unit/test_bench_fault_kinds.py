"""benchmark/fault_kinds.py without SGLang: the scheduler / detokenizer finder on a fake /proc
tree and on real processes titled as upstream titles them; a scheduler kill against a stand-in
``launch_server`` that dies when a child dies (upstream's watchdog); the arbiter_reclaim kill at
the moment and its skip when the moment never comes; join_full_pool's restart-wait bookkeeping
and its skip; the kill windows and self-death counts of every new kind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmark import fault_kinds
from benchmark.accounting import KillWindow, Outcome, faults_verdict, judge, kill_windows, run_kills, self_deaths
from benchmark.e2e.router_proc import role_processes
from benchmark.fault_kinds import kind_checks, reclaim_moment, wait_reclaim
from benchmark.faults import DEFAULT_KINDS, KINDS, parse_args
from memory_ext.proc import pid_alive

pytest.importorskip("setproctitle")

# A stand-in launch_server: children titled as upstream titles them, and upstream's
# SubprocessWatchdog: a child that exits non-zero takes the whole tree down.
FAKE_LAUNCH_SERVER = """
import os, signal, subprocess, sys, time
def titled(t):
    code = f"import setproctitle, time; setproctitle.setproctitle({t!r}); time.sleep(120)"
    return subprocess.Popen([sys.executable, "-c", code])
kids = [titled(t) for t in ("sglang::scheduler_TP0", "sglang::detokenizer", "sglang::detokenizer_router")]
kids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
print(" ".join(str(k.pid) for k in kids), flush=True)
while True:
    if any(k.poll() not in (None, 0) for k in kids):
        for k in kids:
            k.kill()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
"""


@pytest.fixture
def launch_server():
    proc = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCH_SERVER], stdout=subprocess.PIPE, text=True)
    kids = [int(p) for p in proc.stdout.readline().split()]
    t0 = time.monotonic()
    while not role_processes(proc.pid, "scheduler") and time.monotonic() - t0 < 20:
        time.sleep(0.05)  # until the children have set their titles
    try:
        yield proc, kids
    finally:
        for pid in [*kids, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)


def fake_proc(tmp_path: Path, rows: list[tuple[int, int, bytes, str]]) -> Path:
    """A /proc with ``(pid, ppid, cmdline, comm)`` rows."""
    for pid, ppid, cmdline, comm in rows:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
        (d / "cmdline").write_bytes(cmdline)
        (d / "comm").write_text(comm + "\n")
    (tmp_path / "self").mkdir()
    return tmp_path


def test_the_finder_on_a_fake_proc_tree(tmp_path):
    proc = fake_proc(tmp_path, [
        (100, 1, b"python\0-m\0sglang.launch_server\0", "python"),
        (101, 100, b"sglang::scheduler_TP0" + b"\0" * 20, "sglang::schedul"),
        (102, 100, b"", "sglang::detoken"),  # cmdline unreadable as a title: comm's 15 bytes decide
        (103, 100, b"sglang::detokenizer_router\0", "sglang::detoken"),
        (104, 101, b"sglang::scheduler\0", "sglang::schedul"),  # a descendant, not only a child
        (105, 100, b"python\0-c\0from multiprocessing.resource_tracker import main\0", "python"),
        (200, 1, b"sglang::scheduler\0", "sglang::schedul"),  # another engine's
    ])  # fmt: skip
    assert role_processes(100, "scheduler", proc) == [101, 104]
    assert role_processes(100, "detokenizer", proc) == [102]
    assert role_processes(101, "scheduler", proc) == [104]  # the root itself never counts
    assert role_processes(200, "detokenizer", proc) == []


def test_the_finder_on_real_titled_processes(launch_server):
    proc, (sched, detok, router, plain) = launch_server
    t0 = time.monotonic()
    while len(role_processes(proc.pid, "detokenizer")) < 1 and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    assert role_processes(proc.pid, "scheduler") == [sched]
    assert role_processes(proc.pid, "detokenizer") == [detok]
    assert role_processes(os.getpid(), "scheduler") == [sched]  # found from any ancestor


def run_state(**args) -> SimpleNamespace:
    defaults = dict(recover_timeout_s=20.0, reclaim_wait_s=0.3, full_wait_s=0.3, fill_streams=1, join_bound_s=5.0,
                    request_timeout_s=5.0)  # fmt: skip
    defaults.update(args)
    return SimpleNamespace(serve=SimpleNamespace(url="http://stub"), args=SimpleNamespace(**defaults),
                           violations=[], baseline={"tiny-a": "same"}, now=lambda: 7.0,
                           checker=SimpleNamespace(pool_dir=Path("/nonexistent"), arbiter_pids=list))  # fmt: skip


class Supervisor:
    """``/memx/serve``'s engines as the supervisor would report them: ``key`` runs ``pid`` until it
    dies, then ``new_pid`` (restarted, awake, one restart more; ``hung`` counts a hang too)."""

    def __init__(self, key: str, pid: int, new_pid: int, hung: bool = False):
        self.key, self.pid, self.new_pid, self.hung = key, pid, new_pid, hung

    def engines(self, serve) -> dict:
        dead = not pid_alive(self.pid)
        e = {"model": self.key.split("#")[0], "pid": self.new_pid if dead else self.pid, "alive": True,
             "state": "awake", "url": "http://engine", "restarts": int(dead), "hangs": int(dead and self.hung),
             "restart_failures": 0, "last_exit": "signal 9" if dead else None}  # fmt: skip
        return {self.key: e, "tiny-b": {"model": "tiny-b", "pid": os.getpid(), "alive": True, "state": "awake"}}


def test_a_scheduler_kill_takes_the_engine_down_and_its_restart_is_recorded(launch_server, monkeypatch):
    proc, (sched, detok, router, plain) = launch_server
    spare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sup = Supervisor("tiny-a", proc.pid, spare.pid)
        monkeypatch.setattr(fault_kinds, "engines", sup.engines)
        run = run_state()

        class PickTinyA:
            def choice(self, seq):
                return "tiny-a"

        record = fault_kinds.fault_scheduler(run, PickTinyA(), 0, {"n": 0, "kind": "scheduler", "t": 1.0})
        proc.wait(10)
    finally:
        spare.kill()
        spare.wait()
    assert (record["target"], record["victim_pid"], record["t"]) == ("tiny-a", sched, 7.0)
    assert record["engine_down_s"] is not None and record["recovery_s"] is not None
    assert all(record["checks"].values()) and not run.violations, record
    assert (record["how"], record["old_processes_left"]) == ("exited", [])
    assert not pid_alive(detok) and not pid_alive(plain)


def test_a_missing_child_is_a_skip_not_a_pass(monkeypatch):
    lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr(fault_kinds, "engines", Supervisor("tiny-a", lone.pid, lone.pid).engines)
        run = run_state()
        record = fault_kinds.fault_detokenizer(run, SimpleNamespace(choice=lambda s: s[0]), 2,
                                               {"n": 2, "kind": "detokenizer", "t": 1.0})  # fmt: skip
        assert pid_alive(lone.pid)
    finally:
        lone.kill()
        lone.wait()
    assert record["skipped"] and "no sglang::detokenizer process" in record["reason"]
    assert kind_checks([record]) == {"detokenizer: done, not skipped, its checks held (0 of 1)": False}


def full(reclaims=0, pending=0, asked=0, free=0) -> dict:
    clients = [{"pid": 11, "held": 60, "asked": asked}, {"pid": 12, "held": 60 - free, "asked": 0}]
    return {"budget": 120, "created": 120, "free": free, "pending": pending, "reclaim_by_tier": {"return": reclaims},
            "clients": clients}  # fmt: skip


def test_the_reclaim_moment():
    assert reclaim_moment(None, full()) is None
    assert reclaim_moment(None, full(pending=1)) == "pending"
    assert reclaim_moment(None, full(asked=3)) == "asked"
    assert reclaim_moment(full(), full(reclaims=2)) == "reclaim counters rose"
    assert reclaim_moment(full(), full(reclaims=2, free=4)) is None  # not under pressure
    readings = iter([OSError("no arbiter"), full(), full(), full(asked=2), full(pending=1)])

    def status():
        r = next(readings)
        if isinstance(r, Exception):
            raise r
        return r

    clock = iter(range(100))
    moment, reading, waited = wait_reclaim(status, 50, clock=lambda: next(clock), sleep=lambda s: None)
    assert (moment, reading["clients"][0]["asked"]) == ("asked", 2)


def test_arbiter_reclaim_is_skipped_when_no_reclaim_comes_and_nothing_is_killed():
    arbiter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run = run_state()
        run.checker = SimpleNamespace(arbiter_pids=lambda: [arbiter.pid], pool_dir=Path("/nonexistent"))
        record = {"n": 3, "kind": "arbiter_reclaim", "t": 1.0}
        fault_kinds.fault_arbiter_reclaim(run, None, 3, record, status=lambda: full(reclaims=5))
        assert pid_alive(arbiter.pid)
        unreadable = fault_kinds.fault_arbiter_reclaim(run, None, 4, {"n": 4, "kind": "arbiter_reclaim", "t": 2.0})
    finally:
        arbiter.kill()
        arbiter.wait()
    assert record["skipped"] is True and record["reason"].startswith("no reclaim in flight within 0 s")
    assert record["waited_for_reclaim_s"] >= 0.3 and "pid" not in record
    assert unreadable["skipped"] and "no arbiter socket" in unreadable["reason"]
    assert run.violations[0].startswith("fault 3 (arbiter_reclaim) skipped: no reclaim in flight")
    assert kind_checks([record]) == {"arbiter_reclaim: done, not skipped, its checks held (0 of 1)": False}
    assert kill_windows([record], 0.0, 10.0) == [] and run_kills([record]) == ({}, {})


def test_arbiter_reclaim_kills_at_the_moment_and_waits_for_the_rejoin(monkeypatch):
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    readings = iter([full(), full(), full(pending=1)])
    try:
        run = run_state()
        run.checker = SimpleNamespace(arbiter_pids=lambda: [old.pid] if pid_alive(old.pid) else [4242],
                                      conservation=lambda: [{"conserved": True, "dead_clients": []}])  # fmt: skip
        monkeypatch.setattr(fault_kinds, "arbiter_states", lambda serve: {"tiny-a": True, "tiny-b": True})
        record = {"n": 5, "kind": "arbiter_reclaim", "t": 1.0}
        fault_kinds.fault_arbiter_reclaim(run, None, 5, record, status=lambda: next(readings))
        old.wait(5)
    finally:
        old.kill()
        old.wait()
    assert (record["pid"], record["moment"], record["in_flight"], record["t"]) == (old.pid, "pending", True, 7.0)
    assert record["recovery_s"] is not None and all(record["checks"].values()) and not run.violations
    assert kind_checks([record]) == {"arbiter_reclaim: done, not skipped, its checks held (1 of 1)": True}


class NoFiller:
    def __init__(self, url, models, streams, timeout):
        self.models = models

    def stop(self, timeout):
        return {"ok": 3}


def test_join_full_pool_follows_the_restart_through_the_join_wait(monkeypatch):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    polls = []

    def status():  # the pool full; the restart's client listed empty-handed twice, then with its group
        if pid_alive(victim.pid):
            return full()
        polls.append(1)
        mine = {"pid": new.pid, "held": 0 if len(polls) < 3 else 4, "asked": 0}
        return {**full(), "clients": [*full()["clients"], mine]}

    try:
        monkeypatch.setattr(fault_kinds, "engines", Supervisor("tiny-a", victim.pid, new.pid).engines)
        monkeypatch.setattr(fault_kinds, "Filler", NoFiller)
        monkeypatch.setattr("benchmark.soak.probe", lambda url, model, timeout: "same")
        run = run_state()
        record = {"n": 6, "kind": "join_full_pool", "t": 1.0}
        fault_kinds.fault_join_full_pool(run, SimpleNamespace(choice=lambda s: "tiny-a"), 6, record, status=status)
    finally:
        for p in (victim, new):
            p.kill()
            p.wait()
    assert (record["target"], record["fill_models"], record["filler"]) == ("tiny-a", ["tiny-b"], {"ok": 3})
    assert record["pool_at_kill"] == {"budget": 120, "created": 120, "free": 0, "pending": 0}
    assert record["full_when_seen"] and record["held_first"] == 4 and record["join_wait_s"] >= 0.5
    assert record["probe_unchanged"] and record["recovery_s"] is not None and record["t"] == 7.0
    assert all(record["checks"].values()) and not run.violations, record


def test_join_full_pool_is_skipped_when_the_pool_never_fills(monkeypatch):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setattr(fault_kinds, "engines", Supervisor("tiny-a", victim.pid, victim.pid).engines)
        monkeypatch.setattr(fault_kinds, "Filler", NoFiller)
        run = run_state()
        record = {"n": 7, "kind": "join_full_pool", "t": 1.0}
        fault_kinds.fault_join_full_pool(run, SimpleNamespace(choice=lambda s: "tiny-a"), 7, record,
                                         status=lambda: full(free=4))  # fmt: skip
        assert pid_alive(victim.pid)
    finally:
        victim.kill()
        victim.wait()
    assert record["skipped"] and record["reason"].startswith("the pool full: not within 0 s")
    assert record["filler"] == {"ok": 3} and kill_windows([record], 0.0, 10.0) == []


def error(i, model, t, text='HTTP 503: {"code": "engine_restarting"}') -> Outcome:
    return Outcome(index=i, model=model, kind="chat", scheduled_at=t, sent=True, sent_at=t, ended_at=t + 0.5,
                   result="error", error=text)  # fmt: skip


@pytest.mark.parametrize("kind", ["scheduler", "detokenizer", "join_full_pool"])
def test_one_engine_kinds_have_the_engines_window(kind):
    faults = [{"n": 0, "kind": kind, "t": 100.0, "t_recovered": 150.0, "target": "tiny-a#1", "incarnation": 0}]
    windows = kill_windows(faults, 0.0, 10.0)
    assert windows == [KillWindow(0, kind, 99.5, 160.0, "tiny-a")]
    killed, other = error(0, "tiny-a", 120.0), error(1, "tiny-b", 120.0)
    reset = error(2, "tiny-a", 121.0, "connection: ConnectionResetError(104, 'reset')")
    verdict = judge([killed, other, reset], windows)
    assert (killed.kill, other.kill, reset.kill, verdict["failed"]) == (0, None, None, 2)


def test_arbiter_reclaim_excuses_nothing():
    faults = [{"n": 0, "kind": "arbiter_reclaim", "t": 100.0, "t_recovered": 101.0, "target": "arbiter",
               "incarnation": 0}]  # fmt: skip
    assert kill_windows(faults, 0.0, 10.0) == []
    assert judge([error(0, "tiny-a", 100.2)], kill_windows(faults, 0.0, 10.0))["failed"] == 1
    assert run_kills(faults) == ({}, {})


def test_self_deaths_count_child_kills_as_one_restart_and_perhaps_one_hang():
    sched = [{"n": 0, "kind": "scheduler", "target": "tiny-a", "incarnation": 0}]
    engine = [{"n": 0, "kind": "engine", "target": "tiny-a", "incarnation": 0}]
    exited = {"tiny-a": {"state": "awake", "alive": True, "restarts": 1}}
    hung = {"tiny-a": {"state": "awake", "alive": True, "restarts": 1, "hangs": 1}}
    twice = {"tiny-a": {"state": "awake", "alive": True, "restarts": 2, "hangs": 1}}
    assert self_deaths([exited], *run_kills(sched)) == []
    assert self_deaths([hung], *run_kills(sched)) == []
    assert self_deaths([hung], *run_kills(engine)) == ["engine tiny-a (router incarnation 0) died 1 time(s) on its "
                                                       "own; last exit: None"]  # fmt: skip
    assert len(self_deaths([twice], *run_kills(sched))) == 1
    skipped = [{**sched[0], "skipped": True}]
    assert len(self_deaths([exited], *run_kills(skipped))) == 1
    detok = [{"n": 1, "kind": "detokenizer", "target": "tiny-a", "incarnation": 0}]
    assert run_kills(sched + detok + engine) == ({(0, "tiny-a"): 3}, {(0, "tiny-a"): 2})
    checks, details = faults_verdict([], [{**sched[0], "t": 5.0, "t_recovered": 9.0}], [hung], {}, {}, 10.0, 0)
    assert checks["no engine died on its own (restarts == the run's kills)"], details


def test_the_new_kinds_are_choices_not_defaults():
    assert DEFAULT_KINDS == ("engine", "arbiter", "peer_donor", "router")
    assert KINDS == DEFAULT_KINDS + ("scheduler", "detokenizer", "arbiter_reclaim", "join_full_pool")
    args = parse_args(["--kinds", "scheduler,join_full_pool", "--peer-kv", "off", "--seed", "1"])
    assert (args.kind_list, args.reclaim_wait_s, args.join_bound_s) == (["scheduler", "join_full_pool"], 300.0, 300.0)
    with pytest.raises(SystemExit):
        parse_args(["--kinds", "scheduler,bogus", "--peer-kv", "off"])
