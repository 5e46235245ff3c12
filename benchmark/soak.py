"""Soak: ``sglang-memx serve`` with three co-located models and every memx feature that runs in
the server, under bursty mixed traffic for a configurable time, checked every few seconds
(issue 18, item 1).

Setup. Three tiny float32 Llamas of different KV cells (``e2e/consolidation.py``'s) on one
CPU device whose memory (``--memory-mb``) is far below what their bursts need, so KV flows
between them all the time. On: elastic KV and the shared pool (the router's default), the
CPU host buffer (``--memx-host-buffer-gb``), remappable weights with sleep / wake on two
models (``sleep_after_s``), and the peer KV tier when this build runs it (``--peer-kv auto``:
on when ``--memx-peer-kv both`` passes memx's own validation; the JSON says which).

Traffic (seeded; ``--seed`` is printed so a run replays): per model, ON periods (4-12 s,
Poisson ``--rate`` req/s) alternate with OFF periods (6-20 s, a trickle). Each request is one
of: OpenAI chat, streamed chat, a long completion prompt, a frontend-language program
(``fork`` + ``gen`` through ``RuntimeEndpoint(<router>/models/<name>)``), a native
``/generate``, or a stream the client aborts after its first events.

Checks, every ``--check-s`` seconds and at the end:

* chunk conservation at every device pool's arbiter: held + free + not yet created == budget,
  created <= budget, and every client is a live process;
* every request accounted for (``accounting.judge``; one outcome per scheduled request, all in
  the JSON's ``outcomes``): sent == scheduled (and scheduled >= ``min_scheduled``, a quarter of
  the schedule's mean); each answered HTTP 200 with finish_reason ``stop`` / ``length`` and its
  token count (``length``: exactly ``max_tokens``), or is one of our aborts; a 429 passes only
  within ``--shed-budget`` (0); every error fails (named, 5xx, reset, cut stream, hang);
* no engine died: the router's ``/memx/serve`` counts no restart, failed restart or hang kill;
* the greedy probes (``stock_reference.PROBES``, ``temperature 0``) answer what stock SGLang
  answered them before ``serve`` started (``--stock-reference``; at quiet points every model,
  batch 1; during the load one model a check); the traffic's chats sample at 0.8: only their
  finish_reason and token counts are checked;
* no leak (``accounting.leak_check``) between two quiet points (traffic drained, every engine's
  prefix cache flushed, keep-alive connections expired) -- after the warm-up and after the soak:
  per engine, mapped KV groups, mapped bytes and chunks held at the arbiter grow by less than one
  KV group (``--max-kv-group-growth`` 0), the engine's and the arbiter's chunk counts agree at
  each, open fds (memfds apart: they are the pool's chunks) by ``--max-fd-growth`` (8: the
  router's keep-alive connections), threads by ``--max-thread-growth`` (8: thread pools that grow on demand), RSS by
  ``--max-rss-growth-pools`` (4) times the device pool.

``--inject-fault drop|abort|reset|wrong`` (``load_driver``) spoils every 7th request: the run
must then FAIL, naming it.

Exit status 0 when every check held, 1 otherwise (the JSON says which). JSON + PNG under
``benchmark/results/soak/`` (``--results-dir``). The suite runs a short version
(``test/integration/test_soak.py``); the 30-minute run's figures are in
``docs/reliability.md``.

    python benchmark/soak.py [--duration-s 1800] [--seed S] [--rate 1.5] [--memory-mb 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import urllib.error
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.accounting import LeakLimits, soak_verdict  # noqa: E402
from benchmark.e2e.consolidation import model_specs  # noqa: E402
from benchmark.e2e.router_proc import Serve, http_json, process_tree, process_usage  # noqa: E402
from benchmark.load_driver import LoadDriver, add_load_arguments  # noqa: E402
from benchmark.quiet_point import engine_health, quiet, snapshot  # noqa: E402
from benchmark.soak_client import Client  # noqa: E402
from benchmark.stock_reference import held_to, probe_answers, reference_answers  # noqa: E402
from support.server import LOG_DIR, free_port  # noqa: E402

KINDS = {"chat": 3, "chat_stream": 3, "long": 1, "program": 1, "generate": 1, "abort": 1}
# With the peer tier on, the first model runs as two replicas (one layout: they lend to and borrow
# from each other) and also gets ``reuse``: long prompts whose prefix is one of soak_client.REUSE_CONVERSATIONS
# per conversation, more of them than its KV keeps, so prefixes are evicted (spilled to the
# sibling) and come back (peer hits).
PEER_REPLICAS = 2
REUSE_WEIGHT = 4
# What the JSON records of every engine's ``/memx/status`` ``peer_kv`` per check.
PEER_COUNTERS = ("spills", "pages_spilled", "hits", "pages_loaded", "tokens_loaded", "lookups_missed",
                 "loads_no_room", "recomputes_after_reclaim", "reclaims", "reclaimed_chunks", "donated_chunks",
                 "donors_connected")  # fmt: skip
PEER_BORROWER = ("borrowed_bytes", "pages_stored", "bytes_stored", "pages_hit", "bytes_loaded", "donors_lost",
                 "entries_dropped_reclaim", "entries_dropped_dead")  # fmt: skip


def peer_tier_status() -> tuple[bool, str]:
    """Does this build run the peer KV tier in a server? (memx's own flag validation decides.)"""
    from sglang_memx.config import MemxConfig, MemxConfigError

    try:
        MemxConfig.from_dict({"elastic_kv": True, "pool": "soak-probe", "peer_kv": "both"})
    except MemxConfigError as exc:
        return False, str(exc)
    return True, "on (--memx-peer-kv both)"


def serve_config(args, models: dict[str, Path], port: int, tmp: Path, peer: bool) -> Path:
    memx_args = ["--memx-host-buffer-gb", str(args.host_buffer_gb)]
    if peer:
        memx_args += ["--memx-peer-kv", "both"]
    doc = {
        "models": [
            {"name": name, "path": str(path), "dtype": "float32", "ttft_slo_ms": 5000, "max_total_tokens": 4096,
             "kv_reserve_tokens": 64, "max_inflight": 8, "max_queued": 32,
             "sleep_after_s": None if i == 0 else args.sleep_after_s,
             "server_args": ["--chunked-prefill-size", "64"],
             **({"min_replicas": PEER_REPLICAS} if peer and i == 0 else {})}
            for i, (name, path) in enumerate(models.items())
        ],
        "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": args.memory_mb / 1024}],
        "router": {"port": port, "max_queued": 64, "request_timeout_s": args.request_timeout_s},
        "launch": {"log_dir": str(LOG_DIR / "soak-serve"), "pool_dir": str(tmp / "pools"), "memx_args": memx_args},
    }  # fmt: skip
    path = tmp / "soak.yaml"
    path.write_text(json.dumps(doc, indent=1))
    return path


def traffic(args, names: list[str], rng: random.Random, until: float,
            reuse_model: str | None = None) -> list[tuple[float, str, str]]:  # fmt: skip
    """``(offset s, model, kind)``, sorted: per model ON/OFF periods with Poisson arrivals;
    ``reuse_model`` (the replicated model when the peer tier is on) also gets ``reuse``."""
    out = []
    for name in names:
        mix = {**KINDS, "reuse": REUSE_WEIGHT} if name == reuse_model else KINDS
        kinds, weights = list(mix), list(mix.values())
        t, on = rng.uniform(0, 6), rng.random() < 0.5
        while t < until:
            length = rng.uniform(4, 12) if on else rng.uniform(6, 20)
            rate = args.rate if on else args.rate / 20
            s = t + rng.expovariate(rate)
            while s < min(t + length, until):
                out.append((s, name, rng.choices(kinds, weights)[0]))
                s += rng.expovariate(rate)
            t, on = t + length, not on
    return sorted(out)


def probe(url: str, name: str, timeout: float) -> list[str]:
    """The model's greedy answers to ``stock_reference.PROBES`` through the router."""
    return probe_answers(url, name, timeout)


class Checker:
    """The periodic checks; every violation is appended to ``self.violations`` with its time."""

    def __init__(self, serve: Serve, pool_dir: Path, names: list[str], baseline: dict[str, str], timeout: float,
                 peer: bool = False):  # fmt: skip
        self.serve, self.pool_dir, self.names, self.baseline, self.timeout = serve, pool_dir, names, baseline, timeout
        self.peer = peer
        self.samples: list[dict] = []
        self.violations: list[str] = []
        self.t0 = time.monotonic()
        self._probe_turn = 0

    def arbiter_pids(self) -> list[int]:
        out = []
        for pid_file in self.pool_dir.glob("*.pid"):
            try:
                out.append(int(pid_file.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return out

    def processes(self) -> list[dict]:
        pids = process_tree(self.serve.proc.pid)
        for arb in self.arbiter_pids():
            pids += process_tree(arb)
        return [u for u in (process_usage(p) for p in sorted(set(pids))) if u is not None]

    def conservation(self) -> list[dict]:
        from memory_ext.pool.arbiter_client import query_arbiter_status

        out = []
        # The arbiters' sockets only: peer donors listen in the same directory (``<pool>.peer.<donor>.sock``).
        for sock in sorted(p for p in self.pool_dir.glob("*.sock") if ".peer." not in p.name):
            st = query_arbiter_status(sock, name="soak-check")
            held = sum(c["held"] for c in st["clients"])
            ok = held + st["free"] + (st["budget"] - st["created"]) == st["budget"] and st["created"] <= st["budget"]
            dead = [c["pid"] for c in st["clients"] if c.get("pid") and not Path(f"/proc/{c['pid']}").exists()]
            # Every chunk lent here is booked under exactly one owner (a peer donation is the donor's,
            # ``peer_donation``; a borrower imports it but never holds it at the arbiter); adopted
            # chunks (after an arbiter restart) carry no owner.
            by_owner: dict[str, int] = {}
            for c in st["clients"]:
                for owner, n in c.get("by_owner", {}).items():
                    by_owner[owner] = by_owner.get(owner, 0) + n
            unlabelled = [
                c["pid"]
                for c in st["clients"]
                if sum(c.get("by_owner", {}).values()) + c.get("adopted", 0) != c["held"]
            ]
            out.append({"pool": sock.stem, "chunk_bytes": st.get("granularity"),
                        "budget": st["budget"], "created": st["created"], "free": st["free"],
                        "held": held, "clients": len(st["clients"]), "by_owner": by_owner,
                        "conserved": ok and not unlabelled, "owner_mismatch": unlabelled,
                        "dead_clients": dead,
                        "held_by_pid": {str(c["pid"]): c["held"] for c in st["clients"] if c.get("pid")}})  # fmt: skip
        return out

    def peer_counters(self) -> dict[str, dict]:
        """Every engine's ``/memx/status`` ``peer_kv`` counters (scheduler 0), by engine key."""
        out = {}
        for key, e in http_json(self.serve.url + "/memx/serve")["engines"].items():
            try:
                pk = http_json(e["url"] + "/memx/status", timeout=10)["schedulers"][0].get("peer_kv") or {}
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                out[key] = {"error": f"{exc!r}"[:120]}
                continue
            row = {k: pk.get(k, 0) for k in PEER_COUNTERS}
            donor = pk.get("donor") or {}
            row["donated_bytes"] = donor.get("donated_bytes", 0)
            row["leases"] = len(donor.get("leases", []))
            row["refused"] = donor.get("refused", 0)
            borrower = pk.get("borrower") or {}
            row.update({k: borrower.get(k, 0) for k in PEER_BORROWER})
            row["donors"] = len(borrower.get("peers", []))
            row["refused_by"] = len(borrower.get("refused_by", []))
            row["pid"] = e.get("pid")
            out[key] = row
        return out

    def check(self, label: str, with_probe: bool = True, per_process: bool = False) -> dict:
        t = time.monotonic() - self.t0
        sample = {"t": t, "label": label}
        try:
            sample["pools"] = self.conservation()
        except Exception as exc:  # noqa: BLE001 - an arbiter that does not answer is a violation
            sample["pools"] = []
            self.violations.append(f"{t:.0f} s: arbiter status failed: {exc!r}")
        for p in sample["pools"]:
            if not p["conserved"] or p["dead_clients"]:
                self.violations.append(f"{t:.0f} s: pool {p['pool']} not conserved or dead clients: {p}")
        if self.peer:
            try:
                sample["peer"] = self.peer_counters()
            except Exception as exc:  # noqa: BLE001 - the router's status not answering is a violation
                self.violations.append(f"{t:.0f} s: peer counters unreadable: {exc!r}")
            # A donation is booked at the arbiter as the donor's (under the owner it was borrowed
            # as, ``kv``; ``peer_donation`` is the donor's own ledger), never also as the borrower's:
            # what the donors say they lend must fit in what the arbiter says is held.
            gran = sample["pools"][0].get("chunk_bytes") if len(sample["pools"]) == 1 else None
            if sample.get("peer") and gran:
                lent = sum(r.get("donated_bytes", 0) for r in sample["peer"].values() if "error" not in r)
                sample["peer_donated_chunks"] = lent // gran
                if sample["peer_donated_chunks"] > sample["pools"][0]["held"]:
                    self.violations.append(f"{t:.0f} s: pool donors lend {lent // gran} chunks, more than the "
                                           f"{sample['pools'][0]['held']} the arbiter books as held")  # fmt: skip
        procs = self.processes()
        sample["rss_bytes"] = sum(p["rss_bytes"] for p in procs)
        sample["fds"] = sum(p["fds"] for p in procs)
        sample["memfd_fds"] = sum(p["memfd_fds"] for p in procs)
        sample["processes"] = len(procs)
        if per_process:  # a quiet point: what the leak check compares
            sample["per_process"] = procs
            try:
                sample["quiet"] = snapshot(self.serve.url, sample["pools"], procs)
                sample["engine_health"] = engine_health(self.serve.url)
            except (OSError, ValueError, KeyError) as exc:
                self.violations.append(f"{t:.0f} s: quiet-point snapshot failed: {exc!r}")
        if with_probe:
            name = self.names[self._probe_turn % len(self.names)]
            self._probe_turn += 1
            try:
                got = probe(self.serve.url, name, self.timeout)
                sample["probe"] = {name: got == self.baseline[name]}
                if got != self.baseline[name]:
                    self.violations.append(f"{t:.0f} s: probe of {name} changed: {got!r} != {self.baseline[name]!r}")
            except urllib.error.HTTPError as exc:
                sample["probe"] = {name: f"HTTP {exc.code}"}
                if exc.code != 429:  # a shed probe says nothing about the answer
                    self.violations.append(f"{t:.0f} s: probe of {name} failed: HTTP {exc.code}")
            except Exception as exc:  # noqa: BLE001
                self.violations.append(f"{t:.0f} s: probe of {name} failed: {exc!r}")
        if self.serve.proc.poll() is not None:
            self.violations.append(f"{t:.0f} s: serve exited with {self.serve.proc.returncode}")
        self.samples.append(sample)
        return sample


def per_process_change(before: dict, after: dict) -> list[dict]:
    """RSS / fd / thread change of every process present at both quiet points (which one grew)."""
    old = {p["pid"]: p for p in before.get("per_process", [])}
    return [{"pid": p["pid"], "cmd": p["cmd"][:120], "fds": [old[p["pid"]]["fds"], p["fds"]],
             "memfd_fds": [old[p["pid"]]["memfd_fds"], p["memfd_fds"]],
             "threads": [old[p["pid"]].get("threads"), p.get("threads")],
             "rss_mib": [round(old[p["pid"]]["rss_bytes"] / 2**20, 1), round(p["rss_bytes"] / 2**20, 1)]}
            for p in after.get("per_process", []) if p["pid"] in old]  # fmt: skip


def peer_summary(samples: list[dict], model: str) -> dict:
    """The peer tier over the run. Counters start at 0 with each engine process, so the totals
    add, per engine process (key, pid), its last reading; ``final`` is the last check's."""
    rows = [x["peer"] for x in samples if x.get("peer")]
    last_of: dict[tuple[str, object], dict] = {}
    for x in rows:
        for key, r in x.items():
            if "error" not in r:
                last_of[(key, r.get("pid"))] = r
    keys = PEER_COUNTERS + PEER_BORROWER
    return {
        "model": model,
        "replicas": PEER_REPLICAS,
        "engine_processes": len(last_of),
        "final": rows[-1] if rows else {},
        "totals": {k: sum(r.get(k, 0) for r in last_of.values()) for k in keys},
        "max_borrowed_bytes": max((r.get("borrowed_bytes", 0) for x in rows for r in x.values()), default=0),
        "max_donated_bytes": max((r.get("donated_bytes", 0) for x in rows for r in x.values()), default=0),
        "checks_with_borrowing": sum(any(r.get("borrowed_bytes", 0) > 0 for r in x.values()) for x in rows),
        "checks": len(rows),
    }


def growth(before: dict, after: dict, key: str) -> float:
    return after[key] / before[key] - 1.0 if before[key] else float("inf")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["samples"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    t = [x["t"] for x in s]
    axes[0].plot(t, [x["rss_bytes"] / 2**20 for x in s])
    axes[0].set_ylabel("RSS, MiB (all)")
    axes[1].plot(t, [x["fds"] for x in s])
    axes[1].set_ylabel("open fds (all)")
    for name in sorted({p["pool"] for x in s for p in x.get("pools", [])}):
        held = [next((p["held"] for p in x.get("pools", []) if p["pool"] == name), None) for x in s]
        axes[2].plot(t, held, label=f"{name}: held chunks")
    axes[2].set_ylabel("chunks held")
    axes[2].legend(fontsize=7)
    axes[2].set_xlabel("seconds since the first check")
    fig.suptitle(f"soak {doc['params']['duration_s']:.0f} s, seed {doc['params']['seed']}: "
                 f"{'PASS' if doc['passed'] else 'FAIL'}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def min_scheduled(seconds: float, rate: float, models: int) -> int:
    """A quarter of what ``traffic`` schedules on average over ``seconds`` (ON 4-12 s at ``rate``,
    OFF 6-20 s at ``rate / 20``): fewer means the schedule, not the server, went wrong."""
    per_model = seconds * rate * (8 + 13 / 20) / 21
    return max(1, int(per_model * models / 4))


def leak_limits(args) -> LeakLimits:
    """The quiet points' limits: 0 KV groups, 0 fds, ``--max-thread-growth`` threads, RSS at most
    ``--max-rss-growth-pools`` times the device pool (``--memory-mb``)."""
    rss = int(args.max_rss_growth_pools * args.memory_mb * 2**20)
    return LeakLimits(kv_groups=args.max_kv_group_growth, fds=args.max_fd_growth, threads=args.max_thread_growth,
                      rss_bytes=rss)  # fmt: skip


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--check-s", type=float, default=5.0)
    add_load_arguments(ap, "soak", rate=1.5)
    ap.add_argument("--peer-kv", choices=("auto", "off"), default="auto")
    ap.add_argument("--max-kv-group-growth", type=int, default=0, help="KV groups per engine between quiet points")
    ap.add_argument(
        "--max-fd-growth",
        type=int,
        default=8,
        help="open fds (router keep-alive connections to engines may vary by a few)",
    )
    ap.add_argument(
        "--max-thread-growth", type=int, default=8, help="threads between quiet points (thread pools grow on demand)"
    )
    ap.add_argument("--max-rss-growth-pools", type=float, default=4.0, help="RSS growth limit, in device pools")
    ap.add_argument("--settle-s", type=float, default=12.0, help="quiet samples wait this long after the drain")
    ap.add_argument(
        "--stock-reference",
        choices=("on", "off"),
        default="on",
        help="hold the probes to stock SGLang's answers (one stock server per model, before serve)",
    )
    args = ap.parse_args(argv)
    for field in ("duration_s", "check_s", "rate", "memory_mb", "request_timeout_s", "workers"):
        if not getattr(args, field) > 0:
            ap.error(f"--{field.replace('_', '-')}: must be positive")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python benchmark/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}\n# seed {args.seed} (replay: --seed {args.seed})", flush=True)

    from sglang_memx.models.tiny import tiny_model

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-soak-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    models = {n: tiny_model(s, Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models")
              for n, s in model_specs().items()}  # fmt: skip
    names = list(models)
    peer, peer_why = (False, "off (--peer-kv off)") if args.peer_kv == "off" else peer_tier_status()
    print(f"peer KV tier: {peer_why}", flush=True)
    reference = reference_answers(args, models)
    port = free_port()
    serve = Serve(serve_config(args, models, port, tmp, peer), port, "soak-serve")
    rng = random.Random(args.seed)
    load = LoadDriver(args.workers, fault=args.inject_fault)
    checker, health, flushed = None, {}, {}
    t_begin = time.monotonic()
    try:
        serve.wait_ready()
        startup_s = time.monotonic() - t_begin
        baseline = {n: probe(serve.url, n, args.request_timeout_s) for n in names}
        checker = Checker(serve, tmp / "pools", names, reference or baseline, args.request_timeout_s, peer=peer)
        held_to(checker, baseline, reference, "start (quiet)")
        client = Client(serve.url, args.request_timeout_s)
        for phase, length in (("warmup", args.warmup_s), ("soak", args.duration_s)):
            load.start(client, traffic(args, names, rng, length, reuse_model=names[0] if peer else None), phase)
            while load.is_alive():
                load.join(args.check_s)
                if load.is_alive():
                    checker.check(phase)
            flushed[phase] = quiet(serve, args.settle_s)
            checker.check(f"{phase} end (quiet)", per_process=True)
            answers = {n: probe(serve.url, n, args.request_timeout_s) for n in names}
            held_to(checker, answers, reference, f"{phase} end (quiet)")
        end = checker.samples[-1]
        start = next(s for s in checker.samples if s["label"] == "warmup end (quiet)")
        health = engine_health(serve.url)
    finally:
        stopped = serve.stop()
    leftovers = [u for u in (process_usage(p) for p in (checker.arbiter_pids() if checker else [])) if u]
    limits = leak_limits(args)
    minimum = min_scheduled(args.duration_s + args.warmup_s, args.rate, len(names))
    checks, details = soak_verdict(load.outcomes, health, start.get("quiet", {}), end.get("quiet", {}), limits,
                                  args.shed_budget, minimum)  # fmt: skip
    counts = load.counts
    doc = {
        "command": command, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "params": vars(args), "peer_kv": peer_why, "startup_s": startup_s,
        "requests": counts, "scheduled": len(load.outcomes), "min_scheduled": minimum,
        "sent": details["judgement"]["sent"], "failure_reasons": details["judgement"]["failure_reasons"],
        "failures": details["judgement"]["first_failures"], "failures_total": details["judgement"]["failed"],
        "engine_health": health, "self_deaths": details["self_deaths"], "leak": details["leak"],
        "caches_flushed": flushed, "violations": checker.violations, "samples": checker.samples,
        "rss_growth": growth(start, end, "rss_bytes"), "fd_growth": growth(start, end, "fds"),
        "serve_exit": stopped, "leftover_arbiters": leftovers,
        "per_process_change": per_process_change(start, end),
        "peer": peer_summary(checker.samples, names[0]) if peer else None,
        "stock_reference": reference,
        "outcomes": [o.to_json() for o in load.outcomes],
    }  # fmt: skip
    doc["checks"] = {
        **checks,
        "chunks conserved at every check, no dead client": not any("pool" in v for v in checker.violations),
        ("greedy probes equal stock's" if reference else "greedy probe unchanged"): not any(
            "probe" in v for v in checker.violations
        ),
        "serve exited 0 on SIGTERM, no arbiter left": stopped == 0 and not leftovers,
        "nothing else went wrong": not [v for v in checker.violations if "pool" not in v and "probe" not in v],
    }
    if peer:  # the tier is only shown to work if bytes went to a donor and a sibling lent them
        doc["checks"]["peer tier moved KV (bytes spilled to a donor, borrowed bytes > 0)"] = (
            doc["peer"]["totals"].get("bytes_stored", 0) > 0 and doc["peer"]["max_borrowed_bytes"] > 0
        )
    doc["passed"] = all(doc["checks"].values())
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, results / f"{args.out}.png")
    print(json.dumps({"checks": doc["checks"], "requests": counts, "scheduled": doc["scheduled"], "sent": doc["sent"],
                      "failure_reasons": doc["failure_reasons"], "leak": doc["leak"]["violations"],
                      "self_deaths": doc["self_deaths"], "violations": checker.violations[:10],
                      "peer": doc["peer"] and {k: v for k, v in doc["peer"].items() if k != "final"},
                      "failures": doc["failures"][:5]}, indent=1))  # fmt: skip
    print(f"{'PASS' if doc['passed'] else 'FAIL'}; wrote {results / args.out}.json, .png", flush=True)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
