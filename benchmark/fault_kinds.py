"""The fault kinds of ``benchmark/faults.py`` that aim at one part of an engine or one moment of
the pool (issue 27 item 4), and the helpers every kind shares. ``faults.py`` stays the driver.

Each ``fault_<kind>(run, rng, i, record) -> record`` kills, waits for its own recovery and fills
``record`` (``faults.one_fault`` made it with ``n``, ``kind``, ``t``, ``incarnation``, and adds
``recovered_s`` / ``t_recovered`` when the router's ``/health`` is ok again): ``target``,
``recovery_s`` (kill -> the kind's recovery), ``checks`` (name -> bool), or ``skipped: True``
with its ``reason`` when there was nothing to kill or the moment never came. A skip is never a
pass: ``kind_checks`` fails the kind. Violations go to ``run.violations``.

* ``scheduler`` / ``detokenizer``: SIGKILL only that subprocess of one engine (upstream titles
  them ``sglang::scheduler...`` / ``sglang::detokenizer``; ``router_proc.role_processes``).
  Upstream's ``SubprocessWatchdog`` (``launch_server``'s thread, 1 s polls) sees the child's exit
  code and SIGQUITs ``launch_server``, which kills its process tree and itself; the supervisor
  restarts it (or, if it hangs instead, finds it hung and kills it). Checked: the engine went
  down, came back (new pid, awake), nothing of the old process tree is left.
* ``arbiter_reclaim``: SIGKILL the arbiter while a reclaim is in flight (its STATUS shows a
  borrow waiting, ``pending``, or chunks asked back, a client's ``asked``), or else while the
  pool is full and its reclaim counters (``reclaim_by_tier``) rose since the last poll; the
  same checks as ``arbiter``. Not seen within ``--reclaim-wait-s``: skipped, nothing killed.
* ``join_full_pool``: with filler load on the other engines' models, wait until the pool is
  full (free == 0, created == budget), SIGKILL one engine's ``launch_server``, and follow its
  restart through memx's join wait (``elastic/build.borrow_first_group``: retries while the
  pool cannot lend a group): the new process's arbiter client is seen, then holds its first KV
  group within ``--join-bound-s``, then the engine answers its greedy probe on its own port.

Not a kind here: a peer donor killed while its borrower copies one of its blocks (donor
mid-read). A load of the tiny models' blocks is a memcpy of microseconds and the borrower counts
it only once done (``peer_kv.borrower.pages_hit`` / ``bytes_loaded``), so no reading of
``/memx/status`` can catch one in progress, and pausing a server's copy would need a switch in
its hot path. It is tested in ``test/unit/test_peer_donor_mid_read.py`` instead, with real
processes: the borrower's copy of one block is paused through ``PeerLink``'s ``copier``
argument, the donor is SIGKILLed and reaped, the arbiter grants its chunks to a third client
that overwrites them, then the copy finishes. The load keeps only the pages read before the
kill (byte-equal), no foreign byte reaches the KV, ``donors_lost`` grows, nothing of the donor
stays mapped or open, and the borrower carries on with a new donor (docs/reliability.md,
"Faults").
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.error
from pathlib import Path

from benchmark.e2e.router_proc import http_json, process_tree, role_processes
from memory_ext.proc import pid_alive

NEW_KINDS = ("scheduler", "detokenizer", "arbiter_reclaim", "join_full_pool")
# A reclaim lasts at most the arbiter's reclaim_timeout (2 s). Each poll is one short STATUS
# connection, listed as a client while it lasts (as ``soak.Checker``'s are).
POLL_RECLAIM_S = 0.05
FILL_KIND = "long"  # soak_client's long completion: a fresh 150-word prompt each time


def wait_for(pred, timeout: float, what: str, poll_s: float = 0.25) -> float:
    """Seconds until ``pred()`` is true (exceptions count as false); raises TimeoutError."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pred():
                return time.monotonic() - t0
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def engines(serve) -> dict[str, dict]:
    return http_json(serve.url + "/memx/serve")["engines"]


def awake_engines(serve) -> dict[str, dict]:
    """Engines that are up now: a pid, alive, ``awake``."""
    return {k: e for k, e in engines(serve).items()
            if e.get("pid") and e.get("alive", True) and e.get("state") == "awake"}  # fmt: skip


def arbiter_states(serve) -> dict[str, object]:
    """Each engine's view of its pool's arbiter (``connected`` or the error reading it)."""
    out = {}
    for name, e in engines(serve).items():
        try:
            st = http_json(e["url"] + "/memx/status", timeout=10)
            out[name] = st["schedulers"][0]["elastic_kv"]["shared_pool"]["arbiter"]["connected"]
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            out[name] = f"unknown: {exc!r}"[:120]
    return out


def pool_status(pool_dir: Path) -> dict:
    """STATUS of the device pool's arbiter (the run has one device; peer donors' sockets apart);
    OSError when none answers."""
    from memory_ext.pool.arbiter_client import ArbiterError, query_arbiter_status

    socks = sorted(p for p in Path(pool_dir).glob("*.sock") if ".peer." not in p.name)
    if not socks:
        raise OSError(f"no arbiter socket in {pool_dir}")
    try:
        return query_arbiter_status(socks[0], name="faults-watch")
    except ArbiterError as exc:
        raise OSError(str(exc)) from None


def kill(pid: int) -> bool:
    """SIGKILL ``pid``; False when it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def kill_arbiter(run, pid: int, i: int, record: dict) -> float | None:
    """SIGKILL the arbiter ``pid``; seconds until every engine is on a new one (a survivor starts
    it), else None and a violation. Fills ``engines_see_arbiter`` (0.5 s after) and ``rejoined_s``."""
    kill(pid)
    t_kill = time.monotonic()
    time.sleep(0.5)
    record["engines_see_arbiter"] = arbiter_states(run.serve)
    checker = run.checker
    try:
        wait_for(lambda: all(v is True for v in arbiter_states(run.serve).values())
                 and checker.arbiter_pids() and checker.arbiter_pids()[0] != pid,
                 run.args.recover_timeout_s, "every engine back on a new arbiter")  # fmt: skip
        record["rejoined_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as exc:
        run.violations.append(f"fault {i} ({record['kind']}): {exc}")
        record["rejoined_s"] = None
    return record["rejoined_s"]


def wait_restarted(run, key: str, old_pid: int, i: int, kind: str) -> float | None:
    """Seconds until engine ``key`` runs a new process and is awake; None and a violation when not
    within ``--recover-timeout-s``."""

    def back() -> bool:
        e = engines(run.serve)[key]
        return e["pid"] not in (None, old_pid) and e["state"] == "awake"

    t0 = time.monotonic()
    try:
        wait_for(back, run.args.recover_timeout_s, f"{key} restarted")
        return round(time.monotonic() - t0, 1)
    except TimeoutError as exc:
        run.violations.append(f"fault {i} ({kind}): {exc}")
        return None


def skip(run, i: int, record: dict, reason: str) -> dict:
    record.update(skipped=True, reason=reason, recovery_s=None, checks={})
    run.violations.append(f"fault {i} ({record['kind']}) skipped: {reason}")
    return record


def fault_child(run, rng: random.Random, i: int, record: dict, role: str) -> dict:
    """SIGKILL the ``role`` subprocess (``scheduler`` / ``detokenizer``) of a random awake engine
    and nothing else; the engine must go down, be restarted and leave no old process behind."""
    live = awake_engines(run.serve)
    if not live:
        return skip(run, i, record, "no engine awake")
    key = rng.choice(sorted(live))
    pid = live[key]["pid"]
    tree = process_tree(pid)
    found = role_processes(pid, role)
    before = {f: live[key].get(f) or 0 for f in ("restarts", "hangs", "restart_failures")}
    record.update(target=key, pid=pid, role=role, found=found, health_before=before)
    if not found:
        return skip(run, i, record, f"no sglang::{role} process under {key}'s launch_server (pid {pid})")
    record.update(victim_pid=found[0], t=run.now())
    kill(found[0])
    t_kill = time.monotonic()
    try:  # upstream's watchdog SIGQUITs launch_server within ~1 s; the supervisor sees it exit or hang
        wait_for(lambda: engines(run.serve)[key]["pid"] != pid or engines(run.serve)[key]["state"] != "awake",
                 run.args.recover_timeout_s, f"{key} went down after its {role} died")  # fmt: skip
        record["engine_down_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as exc:
        record["engine_down_s"] = None
        run.violations.append(f"fault {i} ({role}): {exc}")
    restarted = wait_restarted(run, key, pid, i, role) if record["engine_down_s"] is not None else None
    record["recovery_s"] = None if restarted is None else round(time.monotonic() - t_kill, 1)
    after = engines(run.serve).get(key, {})
    record["health_after"] = {f: after.get(f) or 0 for f in ("restarts", "hangs", "restart_failures")}
    record["how"] = "found hung" if record["health_after"]["hangs"] > before["hangs"] else "exited"
    record["last_exit"] = after.get("last_exit")
    # The pool's arbiter may be a child of this engine's scheduler (the first server of a pool, or a
    # survivor of an arbiter kill, starts it in its own session): it serves the pool and must live on.
    arbiters = set(run.checker.arbiter_pids())
    left = [p for p in tree if pid_alive(p) and p not in arbiters]
    record["old_processes_left"] = left
    record["checks"] = {f"{key} went down after its {role} died": record["engine_down_s"] is not None,
                        f"{key} restarted (new pid, awake)": record["recovery_s"] is not None,
                        "nothing of the old engine left": not left}  # fmt: skip
    if left:
        run.violations.append(f"fault {i} ({role}): processes of the old {key} left: {left}")
    return record


def fault_scheduler(run, rng: random.Random, i: int, record: dict) -> dict:
    return fault_child(run, rng, i, record, "scheduler")


def fault_detokenizer(run, rng: random.Random, i: int, record: dict) -> dict:
    return fault_child(run, rng, i, record, "detokenizer")


def reclaim_moment(prev: dict | None, cur: dict) -> str | None:
    """Why ``cur`` (an arbiter STATUS) is a reclaim in flight, else None: ``pending`` (a borrow
    waits on a reclaim), ``asked`` (chunks asked back, not yet returned), or ``reclaim counters
    rose`` (the pool full -- free 0, created == budget -- and ``reclaim_by_tier`` grew since
    ``prev``: one just ran)."""
    if cur.get("pending", 0) > 0:
        return "pending"
    if any(c.get("asked", 0) > 0 for c in cur.get("clients", [])):
        return "asked"
    full = cur.get("free") == 0 and cur.get("created") == cur.get("budget")
    if prev is not None and full:
        if sum(cur.get("reclaim_by_tier", {}).values()) > sum(prev.get("reclaim_by_tier", {}).values()):
            return "reclaim counters rose"
    return None


def wait_reclaim(status, timeout: float, poll_s: float = POLL_RECLAIM_S, clock=time.monotonic,
                 sleep=time.sleep) -> tuple[str | None, dict | None, float]:  # fmt: skip
    """Poll ``status()`` until ``reclaim_moment`` says so: (moment or None, that reading or the
    last one, seconds waited). An unreadable status counts as no moment."""
    t0 = clock()
    prev = cur = None
    while clock() - t0 < timeout:
        try:
            cur = status()
        except (OSError, ValueError, KeyError) as exc:
            cur = {"error": f"{exc!r}"[:160]}
        moment = None if "error" in cur else reclaim_moment(prev, cur)
        if moment is not None:
            return moment, cur, clock() - t0
        prev = cur if "error" not in cur else prev
        sleep(poll_s)
    return None, cur, clock() - t0


def fault_arbiter_reclaim(run, rng: random.Random, i: int, record: dict, status=None) -> dict:
    """SIGKILL the arbiter while a reclaim is in flight (``reclaim_moment``); skipped, nothing
    killed, when none is seen within ``--reclaim-wait-s``. ``status`` reads the arbiter's STATUS
    (default: the pool's socket)."""
    status = status or (lambda: pool_status(run.checker.pool_dir))
    if not run.checker.arbiter_pids():
        return skip(run, i, record, "no arbiter running (lost earlier, no engine restarted since)")
    moment, reading, waited = wait_reclaim(status, run.args.reclaim_wait_s)
    record["waited_for_reclaim_s"] = round(waited, 2)
    if moment is None:
        return skip(run, i, record, f"no reclaim in flight within {run.args.reclaim_wait_s:.0f} s "
                                    f"(last status: {reading!r})"[:300])  # fmt: skip
    pids = run.checker.arbiter_pids()  # read again: an engine restart may have started a new one
    if not pids:
        return skip(run, i, record, "the arbiter went away while a reclaim was in flight")
    at_kill = {k: reading.get(k) for k in ("budget", "created", "free", "pending", "reclaim_by_tier")}
    asked = {str(c.get("pid")): c["asked"] for c in reading.get("clients", []) if c.get("asked")}
    record.update(target="arbiter", pid=pids[0], moment=moment, in_flight=moment in ("pending", "asked"),
                  status_at_kill=at_kill, asked_at_kill=asked, t_wait_began=record["t"], t=run.now())  # fmt: skip
    rejoined = kill_arbiter(run, pids[0], i, record)
    record["recovery_s"] = rejoined
    pools = run.checker.conservation() if rejoined is not None else []
    record["pools_after_rejoin"] = pools
    record["checks"] = {"every engine back on a new arbiter": rejoined is not None,
                        "chunks conserved after the rejoin": bool(pools) and all(
                            p["conserved"] and not p["dead_clients"] for p in pools)}  # fmt: skip
    return record


class Filler:
    """Filler load: ``streams`` threads per model, each sending ``soak_client``'s long completion
    (a fresh prompt every time) until ``stop``; their answers are counted, never judged (they are
    not the run's scheduled requests)."""

    def __init__(self, url: str, models: list[str], streams: int, timeout: float):
        from benchmark.soak_client import Client

        self.client, self.stop_evt = Client(url, timeout), threading.Event()
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._n = 10**7  # request numbers apart from the scheduled traffic's
        self.threads = [threading.Thread(target=self._loop, args=(m,), daemon=True)
                        for m in models for _ in range(streams)]  # fmt: skip
        for t in self.threads:
            t.start()

    def _loop(self, model: str) -> None:
        while not self.stop_evt.is_set():
            with self._lock:
                self._n += 1
                n = self._n
            result = self.client.run(model, FILL_KIND, n).get("result", "none")
            with self._lock:
                self.counts[result] = self.counts.get(result, 0) + 1
            if result != "ok":
                self.stop_evt.wait(1.0)

    def stop(self, timeout: float) -> dict[str, int]:
        """Stop sending; wait up to ``timeout`` in all for the requests in flight; the counts."""
        self.stop_evt.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return dict(self.counts)


def pool_full(st: dict) -> bool:
    return st.get("free") == 0 and st.get("created") == st.get("budget")


def follow_join(run, key: str, old_pid: int, status, t_kill: float, record: dict) -> None:
    """Until the restarted ``key`` holds chunks at the arbiter (``--recover-timeout-s``): when its
    new process's client was first listed (``client_seen_s``, with the pool's ``free`` then) and
    when it held its first KV group (``first_group_s``); ``join_wait_s`` is the time between."""
    deadline = t_kill + run.args.recover_timeout_s
    seen = None
    while time.monotonic() < deadline:
        try:
            pid = engines(run.serve)[key]["pid"]
            st = status()
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)
            continue
        if pid and pid != old_pid:
            tree = set(process_tree(pid))
            mine = [c for c in st.get("clients", []) if c.get("pid") in tree or c.get("peer_pid") in tree]
            if mine and seen is None:
                seen = time.monotonic()
                record.update(client_seen_s=round(seen - t_kill, 1), free_when_seen=st.get("free"),
                              full_when_seen=pool_full(st))  # fmt: skip
            if any(c.get("held", 0) > 0 for c in mine):
                now = time.monotonic()
                record.update(first_group_s=round(now - t_kill, 1), join_wait_s=round(now - seen, 1),
                              held_first=sum(c["held"] for c in mine))  # fmt: skip
                return
        time.sleep(0.5)


def fault_join_full_pool(run, rng: random.Random, i: int, record: dict, status=None) -> dict:
    """SIGKILL a random engine while the others hold the whole pool (filler load on their models);
    its restart must get its first KV group within ``--join-bound-s`` of joining the pool and
    answer its greedy probe on its own port. Skipped when the pool is not full within
    ``--full-wait-s``."""
    from benchmark.soak import probe

    status = status or (lambda: pool_status(run.checker.pool_dir))
    live = awake_engines(run.serve)
    if len(live) < 2:
        return skip(run, i, record, "fewer than two engines awake: no siblings to fill the pool")
    key = rng.choice(sorted(live))
    model, pid = live[key]["model"], live[key]["pid"]
    others = sorted({e["model"] for k, e in live.items() if k != key})
    record.update(target=key, pid=pid, fill_models=others)
    filler = Filler(run.serve.url, others, run.args.fill_streams, run.args.request_timeout_s)
    try:
        last: dict = {}

        def full() -> bool:
            last.clear()
            last.update(status())
            return pool_full(last)

        try:
            record["waited_for_full_s"] = round(wait_for(full, run.args.full_wait_s, "the pool full", 0.1), 1)
        except TimeoutError as exc:
            return skip(run, i, record, f"{exc} (filler {run.args.fill_streams} streams on {others})")
        record["pool_at_kill"] = {k: last.get(k) for k in ("budget", "created", "free", "pending")}
        record.update(t_wait_began=record["t"], t=run.now())  # the kill's window opens here
        kill(pid)
        t_kill = time.monotonic()
        follow_join(run, key, pid, status, t_kill, record)
    finally:
        record["filler"] = filler.stop(run.args.request_timeout_s + 5)
    restarted = wait_restarted(run, key, pid, i, "join_full_pool")
    record["restarted_s"] = None if restarted is None else round(time.monotonic() - t_kill, 1)
    got = None
    if restarted is not None:
        try:
            got = probe(engines(run.serve)[key]["url"], model, run.args.request_timeout_s)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            got = f"failed: {exc!r}"
    record["probe_unchanged"] = got == run.baseline.get(model)
    record["recovery_s"] = round(time.monotonic() - t_kill, 1) if record["probe_unchanged"] else None
    wait = record.get("join_wait_s")
    record["checks"] = {
        "the restart's client joined the pool": record.get("client_seen_s") is not None,
        f"first KV group within {run.args.join_bound_s:.0f} s of joining": wait is not None
        and wait <= run.args.join_bound_s,
        f"{key} restarted and its probe on its own port unchanged": record["probe_unchanged"],
    }
    if not all(record["checks"].values()):
        run.violations.append(f"fault {i} (join_full_pool): {[k for k, v in record['checks'].items() if not v]}")
    return record


FAULTS = {"scheduler": fault_scheduler, "detokenizer": fault_detokenizer,
          "arbiter_reclaim": fault_arbiter_reclaim, "join_full_pool": fault_join_full_pool}  # fmt: skip


def kind_checks(faults: list[dict]) -> dict[str, bool]:
    """One run check per new kind that ran: every fault of it done (none skipped) with all its own
    checks held."""
    out = {}
    for kind in NEW_KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        if mine:
            ok = [f for f in mine if not f.get("skipped") and f.get("checks") and all(f["checks"].values())]
            out[f"{kind}: done, not skipped, its checks held ({len(ok)} of {len(mine)})"] = len(ok) == len(mine)
    return out


def add_arguments(ap) -> None:
    """The new kinds' flags (``faults.parse_args``)."""
    ap.add_argument("--reclaim-wait-s", type=float, default=300.0, help="arbiter_reclaim: wait for a reclaim")
    ap.add_argument("--full-wait-s", type=float, default=180.0, help="join_full_pool: wait for the pool full")
    ap.add_argument("--fill-streams", type=int, default=2, help="join_full_pool: filler streams per other model")
    ap.add_argument("--join-bound-s", type=float, default=300.0,
                    help="join_full_pool: first KV group this long after joining (memx's JOIN_WAIT_S)")  # fmt: skip
