"""Fault suite: SIGKILL each kind of process of ``sglang-memx serve`` at random points under load
and check what survives (issue 18, item 2). Same setup and traffic as ``soak.py``.

Kinds (``--kinds``, rotated in a seeded order; ``--seed`` is printed so a run replays):

* ``engine``: one model's ``launch_server`` process (a random replica of a random model). The
  supervisor restarts it on its port; in-flight requests end with a clear error or are retried;
  the other models keep serving.
* ``arbiter``: the device pool's arbiter (its pid file). Engines fall back to private budgets
  (the chunks they hold), say so in ``/memx/status`` (``shared_pool.arbiter.connected``), and
  keep serving; when a restarted engine starts a new arbiter, the survivors rejoin it and their
  chunks are booked again (``docs/memory-pool.md``, "Arbiter death").
* ``peer_donor`` (needs the peer tier: ``--peer-kv auto`` and a build that runs it): the first
  model runs as two replicas of one layout (``soak.py``) that lend to / borrow from each other.
  Once one of them is donating (its ``peer_kv.donor.donated_bytes > 0``) while its sibling
  borrows, the donating engine (``launch_server`` and its scheduler / detokenizer) is SIGKILLed.
  Checked: the sibling answers its greedy probe (asked on its own port) unchanged, its
  ``peer_kv.borrower.donors_lost`` grows, the arbiter's books balance, the supervisor restarts
  the killed replica, and the tier re-links: a replica borrows again (``borrowed_bytes > 0``
  from a donor it did not know before the kill) within ``--relink-timeout-s``.
* ``router``: ``sglang-memx serve`` itself. Its engines die with it (``PR_SET_PDEATHSIG``) and
  its pool's arbiter too (``--owner-pid``); the script checks that nothing is left, then starts
  ``serve`` again with the same config, as an operator's process manager would.
* ``scheduler``, ``detokenizer``, ``arbiter_reclaim``, ``join_full_pool`` (only when named in
  ``--kinds``): one engine's scheduler or detokenizer alone; the arbiter while a reclaim is in
  flight; an engine while the others hold the whole pool, its restart through the join wait.
  They live in ``fault_kinds.py`` (its docstring says what each checks); each records its
  ``recovery_s``, its own ``checks``, or ``skipped`` with the ``reason`` (a skip fails the run).

After every kill: the router's ``/health`` answers ok again within ``--recover-timeout-s``;
every model's greedy probe answers what it answered before any fault; held + free + not yet
created == budget at every arbiter that answers. Over the whole run (``accounting.faults_verdict``):

* every scheduled request accounted for (``accounting.judge``, every outcome in the JSON):
  sent == scheduled; each answered finish_reason ``stop`` / ``length`` with its tokens, or is our
  abort, or was in flight within a kill's window (``--kill-window-s`` past recovery) on the
  killed process's requests -- its model for an engine / peer_donor / scheduler / detokenizer /
  join_full_pool kill, every model for a router kill, none for an arbiter (or arbiter_reclaim)
  kill -- and ended with a named error (a router code; for a router kill also a refused / reset /
  cut connection). Anything else fails: a reset or a named error no kill explains, a 429 beyond
  ``--shed-budget`` (0), a hang;
* no engine died on its own: per router incarnation, the supervisor's restarts + failed restarts
  + hang kills of an engine equal the run's own kills of it (a scheduler or detokenizer kill may
  also explain one hang: ``accounting.self_deaths``);
* no KV group leaked: the pool-unit ``accounting.leak_check`` between a quiet point before the
  load and one after it (caches flushed);
* at the end no engine, scheduler or arbiter is left.

Exit 0 when every check held. JSON + PNG under ``benchmark/results/faults/``; the figures are in
``docs/reliability.md``, "Faults".

    python benchmark/faults.py [--kills 8] [--kinds engine,arbiter,peer_donor,router] [--seed S]
    python benchmark/faults.py --kills 4 --kinds scheduler,detokenizer,arbiter_reclaim,join_full_pool
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import time
import urllib.error
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.accounting import faults_verdict  # noqa: E402
from benchmark.e2e.consolidation import model_specs  # noqa: E402
from benchmark.e2e.router_proc import Serve, http_json, process_tree  # noqa: E402
from benchmark.fault_kinds import (  # noqa: E402
    FAULTS,
    NEW_KINDS,
    add_arguments,
    arbiter_states,
    engines,
    kill_arbiter,
    kind_checks,
    wait_for,
)
from benchmark.load_driver import LoadDriver, add_load_arguments  # noqa: E402
from benchmark.quiet_point import engine_health, quiet  # noqa: E402
from benchmark.soak import Checker, peer_tier_status, probe, serve_config, traffic  # noqa: E402
from benchmark.soak_client import Client  # noqa: E402
from benchmark.stock_reference import held_to, reference_answers  # noqa: E402
from memory_ext.proc import pid_alive  # noqa: E402
from support.server import free_port  # noqa: E402

DEFAULT_KINDS = ("engine", "arbiter", "peer_donor", "router")
KINDS = DEFAULT_KINDS + NEW_KINDS  # --kinds' choices; the new ones (fault_kinds.py) only when asked for
SUMMARY_FIELDS = ("kind", "target", "recovered_s", "recovery_s", "skipped", "reason")


def wait_healthy(serve: Serve, timeout: float) -> float:
    """Seconds until the router's /health says every model is up; raises TimeoutError."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if http_json(serve.url + "/health", timeout=5).get("status") == "ok":
                return time.monotonic() - t0
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not healthy {timeout:.0f} s after the fault")


def peer_views(serve: Serve, model: str) -> dict[str, dict]:
    """``peer_kv`` of every replica of ``model``: engine key -> {pid, url, donated_bytes, leases,
    borrowed_bytes, donors (donor names with bytes borrowed from each), donors_lost}."""
    out = {}
    for key, e in engines(serve).items():
        if e.get("model") != model or not e.get("alive", True):
            continue
        try:
            pk = http_json(e["url"] + "/memx/status", timeout=10)["schedulers"][0]["peer_kv"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue
        donor, borrower = pk.get("donor") or {}, pk.get("borrower") or {}
        out[key] = {"pid": e["pid"], "url": e["url"], "donated_bytes": donor.get("donated_bytes", 0),
                    "leases": len(donor.get("leases", [])), "borrowed_bytes": borrower.get("borrowed_bytes", 0),
                    "donors": {p["donor"]: p["borrowed_bytes"] for p in borrower.get("peers", [])},
                    "donors_lost": borrower.get("donors_lost", 0),
                    "pages_hit": borrower.get("pages_hit", 0)}  # fmt: skip
    return out


def lending_pair(serve: Serve, model: str) -> tuple[str, str, dict] | None:
    """``(donor key, borrower key, views)`` when one replica lends (donated bytes or a lease) and
    another borrows (borrowed bytes > 0), else None."""
    views = peer_views(serve, model)
    for d, dv in views.items():
        if dv["donated_bytes"] > 0 or dv["leases"]:
            for b, bv in views.items():
                if b != d and bv["borrowed_bytes"] > 0:
                    return d, b, views
    return None


def kill_peer_donor(serve: Serve, checker: Checker, model: str, baseline: str, args, record: dict) -> list[str]:
    """The ``peer_donor`` fault (module docstring); fills ``record``, returns violations."""
    bad: list[str] = []
    pair = None
    t0 = time.monotonic()
    while pair is None and time.monotonic() - t0 < args.lend_timeout_s:
        pair = lending_pair(serve, model)
        if pair is None:
            time.sleep(1.0)
    record["waited_for_lending_s"] = round(time.monotonic() - t0, 1)
    if pair is None:
        record["skipped"] = f"no replica of {model} lent to a borrowing sibling within {args.lend_timeout_s:.0f} s"
        return [f"peer_donor: {record['skipped']}"]
    donor, sibling, views = pair
    known = set(views[sibling]["donors"])
    lost_before = views[sibling]["donors_lost"]
    sib_url = views[sibling]["url"]
    tree = process_tree(views[donor]["pid"])
    record.update(target=donor, pid=views[donor]["pid"], sibling=sibling, before=views)
    for p in tree:  # the whole engine at once: launch_server, its scheduler (the donor) and detokenizer
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t_kill = time.monotonic()
    try:
        got = probe(sib_url, model, args.request_timeout_s)
        record["sibling_probe_unchanged"] = got == baseline
        if got != baseline:
            bad.append(f"peer_donor: probe of the sibling {sibling} changed: {got!r}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        record["sibling_probe_unchanged"] = False
        bad.append(f"peer_donor: probe of the sibling {sibling} failed: {exc!r}")

    def lost_grew():
        return peer_views(serve, model)[sibling]["donors_lost"] > lost_before

    try:
        wait_for(lost_grew, 60, "the sibling's donors_lost grew")
        record["donor_lost_seen_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as exc:
        bad.append(f"peer_donor: {exc}")
    pools = checker.conservation()
    record["pools_after_kill"] = pools
    if not all(p["conserved"] and not p["dead_clients"] for p in pools):
        bad.append(f"peer_donor: pool not conserved right after the kill: {pools}")
    try:
        wait_for(lambda: engines(serve)[donor]["pid"] != record["pid"] and engines(serve)[donor]["state"] == "awake",
                 args.recover_timeout_s, f"{donor} restarted")  # fmt: skip
        record["restarted_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as exc:
        bad.append(f"peer_donor: {exc}")
        return bad

    def relinked():
        views = peer_views(serve, model)
        new_donor = any(n not in known and b > 0 for n, b in views.get(sibling, {}).get("donors", {}).items())
        return new_donor or views.get(donor, {}).get("borrowed_bytes", 0) > 0

    try:
        wait_for(relinked, args.relink_timeout_s, "the peer tier re-linked (a replica borrowing again)")
        record["relinked_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as exc:
        record["relinked_s"] = None
        bad.append(f"peer_donor: {exc}")
    record["after"] = peer_views(serve, model)
    return bad


def plot(doc: dict, path: Path) -> None:
    """Recovery time per fault (bars, by kind) and the run's request outcomes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"engine": "#48c", "arbiter": "#c84", "peer_donor": "#4a6", "router": "#a4a", "scheduler": "#8ac",
              "detokenizer": "#6bd", "arbiter_reclaim": "#e96", "join_full_pool": "#269"}  # fmt: skip
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    for f in doc["faults"]:
        a.bar(f["n"], f.get("recovery_s") or f.get("recovered_s") or 0, color=colors[f["kind"]], label=f["kind"])
    handles = {h.get_label(): h for h in a.patches}
    a.legend(handles.values(), handles.keys(), fontsize=7)
    a.set_xlabel("fault #")
    a.set_ylabel("recovery_s, else s until /health ok")
    outcomes: dict[str, int] = {}
    for per_kind in doc["requests"].values():
        for k, v in per_kind.items():
            outcomes[k] = outcomes.get(k, 0) + v
    b.bar(list(outcomes), list(outcomes.values()), color="#777")
    b.set_ylabel("requests")
    fig.suptitle(f"faults, seed {doc['params']['seed']}: {'PASS' if doc['passed'] else 'FAIL'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Run:
    """A fault run's moving parts: the serve it talks to (replaced after a router kill), the
    checker, the violations so far, and the engines' health per router incarnation
    (``health[i]``: the last ``/memx/serve`` reading of incarnation ``i``)."""

    def __init__(self, args, config: Path, port: int, names: list[str]):
        self.args, self.config, self.port, self.names = args, config, port, names
        self.serve = Serve(config, port, "faults-serve")
        self.checker: Checker | None = None
        self.baseline: dict[str, list[str]] = {}
        self.reference: dict[str, list[str]] | None = None  # stock's answers (--stock-reference on)
        self.violations: list[str] = []
        self.health: list[dict] = [{}]
        self.t_begin = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t_begin, 1)

    def read_health(self) -> None:
        try:
            self.health[-1] = engine_health(self.serve.url)
        except (OSError, ValueError, KeyError) as exc:
            self.violations.append(f"{self.now():.0f} s: engine health unreadable: {exc!r}")


def fault_engine(run: Run, rng: random.Random, i: int, record: dict) -> None:
    """SIGKILL a random live replica's ``launch_server``; wait until the supervisor restarted it."""
    live = {k: e for k, e in engines(run.serve).items() if e.get("pid") and e.get("alive", True)}
    key = rng.choice(sorted(live))
    record.update(target=key, pid=live[key]["pid"])
    os.kill(live[key]["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    try:
        wait_for(lambda s=run.serve, k=key, old=record["pid"]: engines(s)[k]["pid"] != old
                 and engines(s)[k]["state"] == "awake", run.args.recover_timeout_s, f"{key} restarted")  # fmt: skip
        record["restarted_s"] = round(time.monotonic() - t_kill, 1)
    except TimeoutError as exc:
        run.violations.append(f"fault {i} (engine): {exc}")


def fault_arbiter(run: Run, i: int, record: dict) -> None:
    """SIGKILL the pool's arbiter; wait until every engine is on a new one."""
    pids = run.checker.arbiter_pids()
    if not pids:
        record["skipped"] = "no arbiter running (lost earlier, no engine restarted since)"
        return
    record.update(target="arbiter", pid=pids[0])
    kill_arbiter(run, pids[0], i, record)


def fault_router(run: Run, i: int, record: dict) -> None:
    """SIGKILL ``serve``; check nothing is left; start it again (a new router incarnation)."""
    run.read_health()  # the last word of this incarnation's supervisor
    tree = process_tree(run.serve.proc.pid) + run.checker.arbiter_pids()
    record.update(target="router", pid=run.serve.proc.pid)
    os.kill(run.serve.proc.pid, signal.SIGKILL)
    run.serve.proc.wait()
    t0 = time.monotonic()
    while any(pid_alive(p) for p in tree) and time.monotonic() - t0 < run.args.leftover_timeout_s:
        time.sleep(0.5)
    left = [p for p in tree if pid_alive(p)]
    record["left_after_s"] = round(time.monotonic() - t0, 1)
    if left:
        run.violations.append(f"fault {i} (router): processes left {run.args.leftover_timeout_s:.0f} s on: {left}")
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    run.serve = Serve(run.config, run.port, f"faults-serve-{i}")
    run.checker.serve = run.serve
    run.health.append({})


def one_fault(run: Run, rng: random.Random, i: int, kind: str) -> dict:
    """Kill, wait for recovery, probe every model, check the books; the fault's record."""
    record = {"n": i, "kind": kind, "t": run.now(), "incarnation": len(run.health) - 1}
    if kind == "engine":
        fault_engine(run, rng, i, record)
    elif kind == "peer_donor":
        name = run.names[0]
        run.violations.extend(kill_peer_donor(run.serve, run.checker, name, run.baseline[name], run.args, record))
    elif kind == "arbiter":
        fault_arbiter(run, i, record)
    elif kind in FAULTS:
        FAULTS[kind](run, rng, i, record)
    else:
        fault_router(run, i, record)
    try:
        record["recovered_s"] = round(wait_healthy(run.serve, run.args.recover_timeout_s), 1)
        record["t_recovered"] = run.now()
    except TimeoutError as exc:
        run.violations.append(f"fault {i} ({kind}): {exc}")
        record["recovered_s"] = record["t_recovered"] = None
    for name in run.names:
        try:
            got = probe(run.serve.url, name, run.args.request_timeout_s)
            if got != run.baseline[name]:
                run.violations.append(f"fault {i} ({kind}): probe of {name} changed: {got!r}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            run.violations.append(f"fault {i} ({kind}): probe of {name} failed: {exc!r}")
    sample = run.checker.check(f"after fault {i} ({kind})", with_probe=False)
    record["pools"] = sample["pools"]
    record["engines_see_arbiter_after"] = arbiter_states(run.serve)
    run.read_health()
    return record


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"from {', '.join(KINDS)}")
    ap.add_argument("--gap-s", type=float, default=20.0, help="mean load time between recoveries and kills")
    add_load_arguments(ap, "faults", rate=1.0)
    ap.add_argument("--recover-timeout-s", type=float, default=600.0)
    ap.add_argument("--leftover-timeout-s", type=float, default=30.0)
    ap.add_argument("--kill-window-s", type=float, default=10.0, help="a kill's window: until recovery + this")
    ap.add_argument("--settle-s", type=float, default=12.0, help="quiet points wait this long after the drain")
    ap.add_argument("--peer-kv", choices=("auto", "off"), default="auto")
    ap.add_argument(
        "--stock-reference",
        choices=("on", "off"),
        default="on",
        help="hold the probes to stock SGLang's answers (one stock server per model, before serve)",
    )
    ap.add_argument("--lend-timeout-s", type=float, default=240.0, help="peer_donor: wait for a lending pair")
    ap.add_argument("--relink-timeout-s", type=float, default=300.0, help="peer_donor: wait for borrowing again")
    add_arguments(ap)
    args = ap.parse_args(argv)
    args.kind_list = [k for k in args.kinds.split(",") if k]
    if not args.kind_list or set(args.kind_list) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}, got {args.kinds!r}")
    if args.kills < 1:
        ap.error("--kills: must be >= 1")
    args.peer, args.peer_why = (False, "off (--peer-kv off)") if args.peer_kv == "off" else peer_tier_status()
    if args.fill_streams < 1:
        ap.error("--fill-streams: must be >= 1")
    if "peer_donor" in args.kind_list and not args.peer:
        ap.error(f"--kinds: peer_donor needs the peer KV tier, which is {args.peer_why}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    return args


def drive_faults(run: Run, rng: random.Random, order: list[str], load: LoadDriver, faults: list[dict]) -> dict:
    """Baseline, quiet point, load with the kills in ``order``, quiet point; the two snapshots."""
    args, names = run.args, run.names
    run.serve.wait_ready()
    started = {n: probe(run.serve.url, n, args.request_timeout_s) for n in names}
    run.baseline = run.reference or started
    run.checker = Checker(run.serve, run.config.parent / "pools", names, run.baseline, args.request_timeout_s)
    held_to(run.checker, started, run.reference, "start (quiet)")
    quiet(run.serve, args.settle_s)
    first = run.checker.check("before the load (quiet)", with_probe=False, per_process=True)
    horizon = args.kills * (args.gap_s * 1.5 + args.recover_timeout_s)
    events = traffic(args, names, rng, horizon, reuse_model=names[0] if args.peer else None)
    run.load_offset_s = run.now()
    load.start(Client(run.serve.url, args.request_timeout_s), events, "faults")
    for i, kind in enumerate(order):
        time.sleep(rng.uniform(0.5, 1.5) * args.gap_s)
        faults.append(one_fault(run, rng, i, kind))
        print(json.dumps(faults[-1]), flush=True)
    load.stop()
    load.join(args.request_timeout_s + 30)
    quiet(run.serve, args.settle_s)
    last = run.checker.check("end (quiet)", with_probe=False, per_process=True)
    ended = {n: probe(run.serve.url, n, args.request_timeout_s) for n in names}
    held_to(run.checker, ended, run.reference, "end (quiet)")
    run.read_health()
    run.violations += run.checker.violations
    return {"before": first.get("quiet", {}), "after": last.get("quiet", {}), "final": last}


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmark/faults.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}\n# seed {args.seed} (replay: --seed {args.seed})", flush=True)
    rng = random.Random(args.seed)
    order = [args.kind_list[i % len(args.kind_list)] for i in range(args.kills)]
    rng.shuffle(order)

    from sglang_memx.models.tiny import tiny_model

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-faults-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    models = {n: tiny_model(s, Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models")
              for n, s in model_specs().items()}  # fmt: skip
    port = free_port()
    print(f"peer KV tier: {args.peer_why}", flush=True)
    reference = reference_answers(args, models)
    run = Run(args, serve_config(args, models, port, tmp, peer=args.peer), port, list(models))
    run.reference = reference
    run.load_offset_s = None
    load = LoadDriver(args.workers, origin=run.t_begin, fault=args.inject_fault)
    faults: list[dict] = []
    quiet_points: dict = {}
    try:
        quiet_points = drive_faults(run, rng, order, load, faults)
    finally:
        load.stop()
        stopped = run.serve.stop()
    leftovers = [p for p in process_tree(os.getpid()) if p != os.getpid() and pid_alive(p)]
    leftovers += [p for p in (run.checker.arbiter_pids() if run.checker is not None else []) if pid_alive(p)]
    checks, details = faults_verdict(load.outcomes, faults, run.health, quiet_points.get("before", {}),
                                  quiet_points.get("after", {}), args.kill_window_s, args.shed_budget)  # fmt: skip
    violations = run.violations
    doc = {"command": command, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "params": {k: v for k, v in vars(args).items() if k not in ("peer", "kind_list")}, "peer_kv": args.peer_why,
           "order": order, "faults": faults, "requests": load.counts, "scheduled": len(load.outcomes),
           "sent": details["judgement"]["sent"], "failure_reasons": details["judgement"]["failure_reasons"],
           "excused_by_kills": details["judgement"]["excused_by_kills"], "kill_windows": details["kill_windows"],
           "engine_health": run.health, "self_deaths": details["self_deaths"], "leak": details["leak"],
           "failed": [o.to_json() for o in load.outcomes if o.verdict.startswith("fail")],
           "violations": violations, "final": quiet_points.get("final"), "serve_exit": stopped,
           "leftovers": leftovers, "load_offset_s": run.load_offset_s,
           "stock_reference": run.reference, "outcomes": [o.to_json() for o in load.outcomes]}  # fmt: skip
    doc["checks"] = {
        **checks,
        "every fault recovered": all(f.get("recovered_s") is not None for f in faults),
        (
            "probes equal stock's at the start, after every fault and at the end"
            if run.reference
            else "probes unchanged after every fault"
        ): not any("probe" in v for v in violations),
        "chunks conserved wherever an arbiter answered": not any("pool" in v for v in violations),
        "nothing left after a router kill or at the end": not leftovers and not any("left" in v for v in violations),
        "nothing else went wrong": not [v for v in violations if not any(w in v for w in ("probe", "pool", "left"))],
    }
    donor_kills = [f for f in faults if f["kind"] == "peer_donor"]
    if donor_kills:
        doc["checks"]["peer_donor: a lending pair found, the sibling served, donors_lost grew, re-linked"] = all(
            not f.get("skipped") and f.get("sibling_probe_unchanged") and f.get("donor_lost_seen_s") is not None
            and f.get("relinked_s") is not None for f in donor_kills)  # fmt: skip
    doc["checks"].update(kind_checks(faults))
    doc["passed"] = all(doc["checks"].values())
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, results / f"{args.out}.png")
    print(json.dumps({"checks": doc["checks"], "requests": load.counts, "failure_reasons": doc["failure_reasons"],
                      "self_deaths": doc["self_deaths"], "violations": violations[:10],
                      "faults": [{k: f.get(k) for k in SUMMARY_FIELDS} for f in faults]}, indent=1))  # fmt: skip
    print(f"{'PASS' if doc['passed'] else 'FAIL'}; wrote {results / args.out}.json", flush=True)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
