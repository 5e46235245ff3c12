"""memx's per-token floor on the engine side (issue 26): solo requests to a memx engine under
``sglang-memx serve``, called directly and through the router, against a stock server with the
same model pinned to one core (the matrix's ``equal`` split), in the same run.

Setups, one run each per round, the order rotating (``benchmark/pairs.py``):

* ``stock``: the ``bursty2`` workload's two stock servers (started once, one core each);
* ``memx-lend``: a fresh ``serve`` of the same two models (``--memx-host-buffer-gb 1``, every
  model's SLOs at 10x stock's solo latency, as the matrix writes them), idle-core lending on
  (the default; ``memory_ext/policy/lending_trial.py`` decides);
* ``memx-own``: the same with ``lend_idle_cores: false`` (each engine on its own core, as stock).

Each run sends ``--requests`` solo requests (one at a time, ``--new-tokens`` greedy tokens) to each
model and records the median TTFT and TPOT; a memx run does it on the engine's own port and then
through the router. Pair ratios memx / stock per model: median [min, max] over the rounds.
Lending's trial state after each memx-lend run is recorded (phase, trials, paid, reason).

    python benchmark/e2e/engine_floor.py [--rounds 5] [--requests 8] [--new-tokens 64]

Writes ``benchmark/results/e2e/engine_floor.json``. Solo requests only: the floor, not the
batching (the matrix measures that). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.e2e.load import flush_and_warm, solo_runs  # noqa: E402
from benchmark.e2e.matrix import model_sizes, serve_config, stock_servers  # noqa: E402
from benchmark.e2e.router_proc import Serve  # noqa: E402
from benchmark.matrix_workloads import WORKLOADS, candidate_splits, memory_plan, prompt, schedule  # noqa: E402
from benchmark.pairs import ratio_stats, run_rounds  # noqa: E402
from support.server import free_port  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
WORKLOAD = WORKLOADS["bursty2"]
SLO_SCALE = 10.0
SETUPS = ("stock", "memx-lend", "memx-own")


def solo(urls: dict[str, str], requests: int, new_tokens: int) -> dict:
    """Median TTFT / TPOT (ms) of ``requests`` solo streamed requests per model, after one warm-up,
    from an empty prefix cache (``/flush_cache`` first: the prompts repeat across runs, and a
    server that had seen them would skip their prefill; before 2026-12-05 only the stock servers,
    which live across the rounds, and memx's second pass through the router had)."""
    out = {}
    for name, url in urls.items():
        flush_and_warm(url)
        runs = solo_runs(url, [prompt(99, i, WORKLOAD.prompt_words) for i in range(requests)], new_tokens, name)
        out[f"{name}_ttft_ms"] = statistics.median(r["ttft"] for r in runs) * 1e3
        out[f"{name}_tpot_ms"] = statistics.median(r["tpot"] for r in runs) * 1e3
    return out


def _status(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.load(r)


class MemxRun:
    """One memx run: a fresh ``serve`` with lending on or off, measured direct then through the router."""

    def __init__(self, paths, plan, slo, args, tmp: Path):
        self.paths, self.plan, self.slo, self.args, self.tmp = paths, plan, slo, args, tmp

    def __call__(self, lend: bool) -> dict:
        port = free_port()
        cfg = serve_config(WORKLOAD, self.paths, self.plan, self.slo, SLO_SCALE, ["--memx-host-buffer-gb", "1"],
                           port, self.tmp)  # fmt: skip
        doc = json.loads(cfg.read_text())
        doc["devices"][0]["lend_idle_cores"] = lend
        cfg.write_text(json.dumps(doc, indent=1))
        serve = Serve(cfg, port, f"bench-engine-floor-{'lend' if lend else 'own'}")
        try:
            serve.wait_ready()
            engines = {n: m["url"] for n, m in _status(serve.url, "/memx/serve")["models"].items()}
            out = solo(engines, self.args.requests, self.args.new_tokens)
            routed = solo({n: f"{serve.url}/models/{n}" for n in engines}, self.args.requests, self.args.new_tokens)
            out.update({f"router_{k}": v for k, v in routed.items()})
            out["lending"] = {
                n: _status(u, "/memx/status")["schedulers"][0]["compute_share"] for n, u in engines.items()
            }
            return out
        finally:
            serve.stop()


def summarize(rounds: list[dict]) -> dict:
    """Pair ratios memx / stock per model and metric (direct and through the router)."""
    out = {}
    for setup in SETUPS[1:]:
        for name in WORKLOAD.models:
            for metric in ("ttft_ms", "tpot_ms"):
                key = f"{name}_{metric}"
                out[f"{setup}/stock {key}"] = ratio_stats(rounds, key, setup, "stock")
                routed = [{"m": {key: r[setup][f"router_{key}"]}, "s": r["stock"]} for r in rounds]
                out[f"{setup}/stock router {key}"] = ratio_stats(routed, key, "m", "s")
    return out


def main(argv=None) -> int:
    from benchmark.e2e.consolidation import model_specs
    from sglang_memx.models.tiny import tiny_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="engine_floor")
    args = ap.parse_args(argv)
    for field in ("rounds", "requests", "new_tokens"):
        if getattr(args, field) < 1:
            ap.error(f"--{field.replace('_', '-')}: must be >= 1")
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    specs = model_specs()
    paths = {n: tiny_model(specs[n], root) for n in WORKLOAD.models}
    plan = memory_plan(WORKLOAD, model_sizes(WORKLOAD, paths, schedule(WORKLOAD)))
    split = next(s for s in candidate_splits(WORKLOAD, plan) if s.name == "equal")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-bench-floor-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    stock = stock_servers(WORKLOAD, split, paths, plan)
    try:
        for s in stock.values():
            s.start()
        for s in stock.values():
            s.wait_ready(900)
        urls = {n: s.url for n, s in stock.items()}
        first = solo(urls, args.requests, args.new_tokens)
        slo = {n: {"ttft_s": first[f"{n}_ttft_ms"] / 1e3, "tpot_s": first[f"{n}_tpot_ms"] / 1e3} for n in urls}
        memx = MemxRun(paths, plan, slo, args, tmp)

        def run(setup: str, r: int) -> dict:
            if setup == "stock":
                return solo(urls, args.requests, args.new_tokens)
            return memx(setup == "memx-lend")

        t0 = time.time()
        rounds = run_rounds(args.rounds, SETUPS, run)
    finally:
        for s in stock.values():
            s.stop()
    doc = {"command": "python benchmark/e2e/engine_floor.py " + " ".join(argv or sys.argv[1:]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "cpus": os.cpu_count(),
           "machine": platform.machine(), "params": vars(args), "workload": WORKLOAD.name, "slo_scale": SLO_SCALE,
           "rounds": rounds, "ratios": summarize(rounds)}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(doc, indent=1))
    for k, v in doc["ratios"].items():
        print(f"{k}: {v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
