"""Which memx feature costs the per-request floor (issue 26): solo requests to single servers of
one tiny model, one per feature set, all up at once and measured in interleaved rounds.

``engine_floor.py`` measured memx's engine under ``sglang-memx serve`` at 1.2-1.3x stock's solo
TTFT and 1.1x its TPOT on the matrix's ``tiny-a``; this script splits that by feature. Setups
(``--setups``, every one a plain ``launch_server`` with the same model, arguments and core):

* ``stock``: the memx plugin filtered out;
* ``plugin``: the plugin loaded, no feature flag (its wrappers, the status endpoint);
* ``ekv``: ``--memx-elastic-kv`` (own pool);
* ``ekv-pool``: elastic KV on a shared pool (``--memx-pool``: the arbiter, alone in it);
* ``ekv-hb``: elastic KV and ``--memx-host-buffer-gb 1`` (``scripts/serve.sh``'s features);
* ``ekv-gov``: elastic KV and a TPOT SLO (``--memx-tpot-slo-ms``: the governor).

Every run sends ``--requests`` solo requests (one at a time, ``--new-tokens`` greedy tokens, from an
empty prefix cache) and records the median TTFT and TPOT, the scheduler's CPU seconds per request and,
for the setups with elastic KV, the coordinator's time per step per request (its ``/memx/status``), in
all iterations and in those with work (the part that delays requests).
Ratios to stock per round: median [min, max]. A diagnostic of where the floor goes, not a claim.
``--base PATH`` measures a code change: a setup named ``SETUP@base`` (``ekv-pool@base``) runs the
same flags on the memx of the checkout at ``PATH`` (a ``git worktree`` of the earlier commit; its
server imports memx from there), and ``SETUP / SETUP@base`` ratios per round are added.
By default every setup's server lives across the rounds; a server instance keeps a speed of its
own (a few per cent on these tiny models, the same sign in every round), so effects that small
need ``--fresh-servers``: a new server of each setup for every round. ``--tp 2`` runs every setup at
tensor parallel size 2 (a rank on each core; stock at ``--tp 2`` is the baseline): what memx's ranks'
agreement adds on top of the floor (``coordinator.rank_agreement``, ``rank_pools``).

    python benchmark/e2e/feature_floor.py [--rounds 5] [--requests 20] [--setups stock,plugin,ekv]
        [--fresh-servers] [--base PATH --setups stock,ekv-pool,ekv-pool@base] [--tp 2]

Writes ``benchmark/results/e2e/feature_floor.json``. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.e2e.load import flush_and_warm, solo_runs  # noqa: E402
from benchmark.e2e.matrix_probe import usage  # noqa: E402
from benchmark.matrix_workloads import WORKLOADS, prompt  # noqa: E402
from benchmark.pairs import ratio_stats, rotation, run_rounds  # noqa: E402
from benchmark.provenance import code_version  # noqa: E402
from support.server import TP2_ENV, SGLangServer, start_all, stop_all  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
MODELS_ROOT = Path("/tmp/sglang-memx-bench-models")
COMMON = ["--dtype", "float32", "--chunked-prefill-size", "64"]
CORE = "1"  # every server computes on this one core, as the matrix's stock split pins each server
FEATURES = {
    "stock": [],
    "plugin": [],
    "ekv": ["--memx-elastic-kv"],
    "ekv-pool": ["--memx-elastic-kv", "--memx-pool", "floor", "--memx-pool-budget-gb", "0.25"],
    "ekv-hb": ["--memx-elastic-kv", "--memx-host-buffer-gb", "1"],
    "ekv-gov": ["--memx-elastic-kv", "--memx-tpot-slo-ms", "1000"],
}


BASE = "@base"  # a setup name's suffix: the same flags, run on the code of ``--base``'s checkout


def flags_of(setup: str) -> list[str]:
    """The memx flags of ``setup``; a ``@base`` setup's shared pool has a name of its own."""
    flags = list(FEATURES[setup.removesuffix(BASE)])
    if setup.endswith(BASE) and "--memx-pool" in flags:
        at = flags.index("--memx-pool") + 1
        flags[at] += "-base"
    return flags


def server(setup: str, model: Path, pool_dir: Path, base: Path | None = None, tp: int = 1) -> SGLangServer:
    """The server of ``setup``; a ``@base`` one imports memx from the checkout ``base``. At ``tp`` 2 every
    setup runs at ``--tp 2``, a rank on each core (upstream's CPU engine, docs/models.md)."""
    extra = flags_of(setup)
    if "--memx-pool" in extra:
        extra += ["--memx-pool-dir", str(pool_dir)]
    env = {"SGLANG_CPU_OMP_THREADS_BIND": CORE, "OMP_NUM_THREADS": "1"}
    if tp == 2:
        extra += ["--tp", "2"]
        env.update(TP2_ENV)
    if setup.endswith(BASE):
        env["PYTHONPATH"] = f"{base}/python:{base}"  # ahead of the editable install of this checkout
        env["PYTHONSAFEPATH"] = "1"  # and no working directory ahead of it (run from this checkout, the
        # server took memory_ext from here and sglang_memx from ``base``)
    return SGLangServer(model, name=f"floor-{setup}", stock=setup == "stock", extra_args=COMMON + extra, env=env)


def stop_pools(setups: list[str], pool_dir: Path) -> None:
    """Stop the arbiter of every shared pool the setups started (it outlives its servers by design)."""
    for s in setups:
        flags = flags_of(s)
        if "--memx-pool" in flags:
            name = flags[flags.index("--memx-pool") + 1]
            cmd = [sys.executable, "-m", "sglang_memx.cli", "pool", "stop", name, "--pool-dir", str(pool_dir)]
            subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, timeout=60)


def scheduler_cpu_s(root_pid: int) -> float:
    """CPU seconds of the server's scheduler process (``matrix_probe.usage``'s ``scheduler`` role)."""
    return sum(cpu for (_, role), (cpu, _) in usage([root_pid]).items() if role == "scheduler")


def coordinator_time(srv: SGLangServer) -> dict[str, tuple[float, float]]:
    """Seconds the coordinator spent per step / source since the server started, in all iterations
    and in busy ones (``/memx/status``'s ``coordinator.time``: ``total_s``, ``busy_s``); empty for a
    server without elastic KV (stock, the plugin alone)."""
    if srv.stock:
        return {}
    kv = srv.request("/memx/status")["schedulers"][0].get("elastic_kv") or {}
    times = ((kv.get("coordinator") or {}).get("time") or {}).items()
    return {name: (e["total_s"], e.get("busy_s", 0.0)) for name, e in times}


def per_request_us(before: dict, after: dict, which: int, requests: int) -> dict[str, float]:
    """µs per request of each step between two ``coordinator_time`` readings (``which``: 0 all
    iterations, 1 busy ones), largest first, steps that took no time left out."""
    got = {k: round((v[which] - before.get(k, (0.0, 0.0))[which]) / requests * 1e6, 1) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in got.items() if v > 0), key=lambda kv: -kv[1]))


def measure(srv: SGLangServer, requests: int, new_tokens: int, words: int) -> dict:
    """Median TTFT / TPOT of ``requests`` solo requests, the scheduler's CPU per request and the
    coordinator's time per step per request, in every iteration (``steps_us_per_request``) and in
    those with work (``busy_steps_us_per_request``: the part on the requests' path)."""
    flush_and_warm(srv.url)
    cpu0, steps0 = scheduler_cpu_s(srv.proc.pid), coordinator_time(srv)
    runs = solo_runs(srv.url, [prompt(98, i, words) for i in range(requests)], new_tokens, srv.name)
    cpu, steps = scheduler_cpu_s(srv.proc.pid) - cpu0, coordinator_time(srv)
    return {"ttft_ms": statistics.median(r["ttft"] for r in runs) * 1e3,
            "tpot_ms": statistics.median(r["tpot"] for r in runs) * 1e3,
            "sched_cpu_ms_per_request": cpu / requests * 1e3,
            "steps_us_per_request": per_request_us(steps0, steps, 0, requests),
            "busy_steps_us_per_request": per_request_us(steps0, steps, 1, requests)}  # fmt: skip


def parse_args(argv=None):
    from benchmark.e2e.consolidation import model_specs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", default="tiny-a", choices=sorted(model_specs()))
    ap.add_argument("--setups", type=lambda s: s.split(","), default=list(FEATURES))
    ap.add_argument(
        "--fresh-servers",
        action="store_true",
        help="start a new server of every setup for each round (a server instance keeps a speed "
        "of its own, a few per cent, across the rounds it serves: see docs/governor.md)",
    )
    ap.add_argument(
        "--base",
        type=Path,
        default=None,
        help="a checkout of earlier code (e.g. a git worktree): setups named SETUP@base run on it",
    )
    ap.add_argument(
        "--tp",
        type=int,
        choices=(1, 2),
        default=1,
        help="tensor parallel size of every setup (2: a rank on each of two cores)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "feature_floor.json")
    args = ap.parse_args(argv)
    bad = [s for s in args.setups if s.removesuffix(BASE) not in FEATURES or s == "stock" + BASE]
    if bad or "stock" not in args.setups:
        ap.error(f"--setups: {bad[0]!r} is not one of {', '.join(FEATURES)} (or one but stock with {BASE})"
                 if bad else "--setups: needs stock")  # fmt: skip
    if any(s.endswith(BASE) for s in args.setups) != (args.base is not None):
        ap.error(f"--base: give it with a setup named SETUP{BASE}, and only then")
    if args.base is not None and not (args.base / "python" / "sglang_memx").is_dir():
        ap.error(f"--base: {args.base} is not a checkout of sglang-memx (no python/sglang_memx)")
    if args.rounds < 1 or args.requests < 1 or args.new_tokens < 2:
        ap.error("--rounds and --requests must be >= 1, --new-tokens >= 2")
    return args


def serve_rounds(rounds: int, setups: list[str], model: Path, pool_dir: Path, args, words: int) -> list[dict]:
    """``rounds`` interleaved rounds (``run_rounds``) on one server per setup, all started first
    and stopped after, with their pools' arbiters."""
    servers = {s: server(s, model, pool_dir, args.base, args.tp) for s in setups}
    try:
        start_all(list(servers.values()))
        return run_rounds(rounds, setups,
                          lambda s, _r: measure(servers[s], args.requests, args.new_tokens, words))  # fmt: skip
    finally:
        stop_all(list(servers.values()))
        stop_pools(setups, pool_dir)


def main(argv=None) -> int:
    from benchmark.e2e.consolidation import model_specs
    from sglang_memx.models.tiny import tiny_model

    args = parse_args(argv)
    model = tiny_model(model_specs()[args.model], MODELS_ROOT)
    pool_dir = Path("/tmp/sglang-memx-feature-floor")
    pool_dir.mkdir(exist_ok=True)
    words = WORKLOADS["bursty2"].prompt_words
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.fresh_servers:  # a server of each setup per round, the order rotating as run_rounds rotates it
        rounds = []
        for r in range(args.rounds):
            rounds += serve_rounds(1, rotation(args.setups, r), model, pool_dir, args, words)
    else:
        rounds = serve_rounds(args.rounds, args.setups, model, pool_dir, args, words)
    keys = ("ttft_ms", "tpot_ms", "sched_cpu_ms_per_request")
    pairs = [(s, "stock") for s in args.setups if s != "stock"]
    pairs += [
        (s.removesuffix(BASE), s) for s in args.setups if s.endswith(BASE) and s.removesuffix(BASE) in args.setups
    ]
    ratios = {f"{a}/{b} {k}": ratio_stats(rounds, k, a, b) for a, b in pairs for k in keys}
    doc = {"benchmark": "feature_floor", "command": " ".join(sys.argv), "when": when, "model": args.model,
           "machine": {"cpus": psutil.cpu_count(), "platform": platform.platform()},
           "setups": {s: flags_of(s) for s in args.setups}, "rounds": rounds, "ratios": ratios,
           "code": code_version(), "fresh_servers": args.fresh_servers, "tp": args.tp}  # fmt: skip
    if args.base is not None:
        doc["base"] = code_version(args.base)
    args.out.write_text(json.dumps(doc, indent=1))
    for k, st in ratios.items():
        print(f"{k}: {st['median']:.3f} [{st['min']:.3f}, {st['max']:.3f}]")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
