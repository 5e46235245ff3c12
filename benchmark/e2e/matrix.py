"""The no-harm matrix (issue 26 item 3): memx as ``sglang-memx serve`` runs it against stock SGLang
with the **best static split** a user could write, per workload and SLO scale.

* Workloads, memory accounting and the stock candidates: ``benchmark/matrix_workloads.py``;
  scoring, the best split and the verdicts: ``benchmark/matrix_score.py``.
* Stock: for every candidate split, one stock server per model (``--max-total-tokens`` from the
  split's share, cores pinned or shared), all started once; requests go straight to them.
* memx: ``sglang-memx serve`` (router, one shared pool, elastic KV, the flags of ``--memx-args``;
  idle-core lending and no shedding are its defaults) with every model's TTFT / TPOT SLO in
  ``models.yaml`` at the run's scale (so the governor and the router read it). A fresh ``serve``
  per run (its start-up is not measured); requests go through the router.
* SLOs: each model's solo TTFT / TPOT (median of 5 solo requests on the ``equal`` split's
  server) x the scale.
* Every round runs every setup once (stock candidates and memx at every scale), the order
  rotating (``benchmark.pairs.run_rounds``). Stock's runs are scored at every scale, memx's at
  its own.

Writes ``benchmark/results/e2e/<out>.json`` (cells, claims, the raw requests) and a heatmap PNG;
``python -m benchmark.matrix_table`` renders the docs table from the JSON. It runs for a long
time (a workload with 5 candidates, 5 scales and 5 rounds: about an hour on 2 cores); it is a
script, not part of the suite.

    python benchmark/e2e/matrix.py [--workloads bursty2,steady2] [--scales 2,10,50] [--rounds 5]
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

from benchmark.e2e.load import play, stream_one  # noqa: E402
from benchmark.e2e.router_proc import Serve  # noqa: E402
from benchmark.matrix_score import cell, claims, score_run  # noqa: E402
from benchmark.matrix_workloads import (  # noqa: E402
    CHUNKED_PREFILL,
    MISSING_WORKLOADS,
    WORKLOADS,
    ModelSize,
    Split,
    Workload,
    candidate_splits,
    memory_plan,
    prompt,
    schedule,
)
from benchmark.pairs import run_rounds  # noqa: E402
from support.server import LOG_DIR, SGLangServer, free_port  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
GIB = 1 << 30
COMMON = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNKED_PREFILL)]
SCALES = (2, 5, 10, 20, 50)


SERVER_RSS_BYTES = 1_300_000_000  # one tiny-model CPU server (tokenizer, scheduler, detokenizer): ~1.1 GB + start-up


def check_memory(servers: int, meminfo: Path = Path("/proc/meminfo")) -> None:
    """Refuse to start more servers than the host's available memory holds: on 2026-11-28 the OOM
    killer took two stock schedulers of a 12-server run, and their requests counted as misses."""
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    if servers * SERVER_RSS_BYTES > available:
        raise SystemExit(f"--splits: {servers} servers need about {servers * SERVER_RSS_BYTES / 2**30:.1f} GiB, "
                         f"{available / 2**30:.1f} GiB available: keep fewer candidate splits")  # fmt: skip


def model_sizes(w: Workload, paths: dict[str, Path], sched) -> dict[str, ModelSize]:
    from transformers import AutoTokenizer

    from benchmark.e2e.consolidation import activation_bytes, model_specs
    from sglang_memx.serve.placement import read_model_size

    specs = model_specs()
    out = {}
    for name in w.models:
        size = read_model_size(paths[name], "float32")
        tok = AutoTokenizer.from_pretrained(str(paths[name]))
        ptoks = max(len(tok(t)["input_ids"]) for _, n, t in sched if n == name)
        out[name] = ModelSize(size.weight_bytes, size.kv_bytes_per_token, ptoks, activation_bytes(specs[name]))
    return out


def stock_servers(w: Workload, split: Split, paths, plan) -> dict[str, SGLangServer]:
    tokens = split.max_total_tokens(plan)
    cores = sorted(os.sched_getaffinity(0))
    out = {}
    for i, name in enumerate(w.models):
        if split.cores == "pinned":
            env = {"SGLANG_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)]), "OMP_NUM_THREADS": "1"}
        else:
            env = {"SGLANG_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "OMP_NUM_THREADS": str(len(cores))}
        out[name] = SGLangServer(paths[name], name=f"bench-matrix-{w.name}-{split.name}-{name}", stock=True,
                                 max_total_tokens=tokens[name], extra_args=COMMON, env=env)  # fmt: skip
    return out


def serve_config(w: Workload, paths, plan, solo, scale: float, memx_args: list[str], port: int, tmp: Path) -> Path:
    models = []
    for name in w.models:
        m = {"name": name, "path": str(paths[name]), "dtype": "float32",
             "ttft_slo_ms": scale * solo[name]["ttft_s"] * 1000, "tpot_slo_ms": scale * solo[name]["tpot_s"] * 1000,
             "max_total_tokens": plan["models"][name]["need_tokens"], "kv_reserve_tokens": CHUNKED_PREFILL,
             "server_args": ["--chunked-prefill-size", str(CHUNKED_PREFILL)]}  # fmt: skip
        if w.sleep_after_s is not None:
            m["sleep_after_s"] = w.sleep_after_s
        models.append(m)
    doc = {"models": models,
           "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": plan["memx_device_bytes"] / GIB}],
           "router": {"port": port},
           "launch": {"log_dir": str(LOG_DIR / f"bench-matrix-{w.name}-serve"), "pool_dir": str(tmp / "pools"),
                      "memx_args": memx_args}}  # fmt: skip
    path = tmp / f"matrix-{w.name}-x{scale:g}.yaml"
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def measure_solo(servers: dict[str, SGLangServer], w: Workload) -> dict:
    out = {}
    for name, s in servers.items():
        runs = [stream_one(s.url, prompt(99, i, w.prompt_words), w.new_tokens) for i in range(5)]
        bad = [r for r in runs if "error" in r]
        if bad:
            raise RuntimeError(f"{name}: solo request failed: {bad[0]['error']}")
        out[name] = {"ttft_s": statistics.median(r["ttft"] for r in runs),
                     "tpot_s": statistics.median(r["tpot"] for r in runs)}  # fmt: skip
    return out


def flush(urls) -> None:
    for url in urls:
        try:
            urllib.request.urlopen(url + "/flush_cache", timeout=60).read()  # an empty prefix cache per run
        except OSError:
            pass


def play_run(urls: dict[str, str], sched, w: Workload) -> dict:
    results, wall = play(urls, sched, w.new_tokens)
    for r in results:
        r["model"] = r.pop("server")
    keep = ("model", "offset", "ttft", "tpot", "tokens", "error")
    return {"wall_s": wall, "requests": [{k: r[k] for k in keep if k in r} for r in results]}


class MemxRun:
    """One memx run at one scale: a fresh ``serve``, warmed up, played through the router, stopped."""

    def __init__(self, w: Workload, paths, plan, solo, memx_args: list[str], tmp: Path):
        self.w, self.paths, self.plan, self.solo, self.memx_args, self.tmp = w, paths, plan, solo, memx_args, tmp

    def __call__(self, scale: float, sched) -> dict:
        port = free_port()
        cfg = serve_config(self.w, self.paths, self.plan, self.solo, scale, self.memx_args, port, self.tmp)
        serve = Serve(cfg, port, f"bench-matrix-{self.w.name}-serve")
        try:
            t0 = time.monotonic()
            serve.wait_ready()
            startup = time.monotonic() - t0
            urls = {n: f"{serve.url}/models/{n}" for n in self.w.models}
            for url in urls.values():
                stream_one(url, "warm up", 4)
            out = play_run(urls, sched, self.w)
            out["startup_s"] = startup
            return out
        finally:
            serve.stop()


def run_workload(w: Workload, args) -> dict:
    from benchmark.e2e.consolidation import model_specs
    from sglang_memx.models.tiny import tiny_model

    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    specs = model_specs()
    paths = {n: tiny_model(specs[n], root) for n in w.models}
    sched = schedule(w)
    plan = memory_plan(w, model_sizes(w, paths, sched))
    splits = [s for s in candidate_splits(w, plan) if not args.splits or s.name in args.splits]
    if not any(s.name == "equal" for s in splits):
        raise SystemExit(f"{w.name}: the equal split (the default) is not feasible or not selected: {json.dumps(plan)}")
    print(f"# {w.name}: {len(sched)} requests; plan {json.dumps(plan)}", flush=True)
    print(f"# splits: {[(s.name, s.fractions, s.cores) for s in splits]}", flush=True)
    if args.dry_run:
        return {"plan": plan, "splits": [s.__dict__ for s in splits]}
    check_memory(len(splits) * len(w.models) + len(w.models))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-bench-matrix-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    stock = {s.name: stock_servers(w, s, paths, plan) for s in splits}
    every = [srv for group in stock.values() for srv in group.values()]
    try:
        for srv in every:
            srv.start()
        for srv in every:
            srv.wait_ready(900)
            srv.generate("warm up", max_new_tokens=4, temperature=0)
        solo = measure_solo(stock["equal"], w)
        print(f"# solo: {json.dumps(solo)}", flush=True)
        memx = MemxRun(w, paths, plan, solo, args.memx_args, tmp)
        setups = [s.name for s in splits] + [f"memx@{k:g}" for k in args.scales]

        def run(setup: str, r: int) -> dict:
            dead = [srv.name for srv in every if not srv.running]
            if dead:  # its requests would count as misses: a lost server is not a result
                raise RuntimeError(f"stock servers died (out of memory? see dmesg and test-logs/): {dead}")
            if setup.startswith("memx@"):
                return memx(float(setup[5:]), sched)
            urls = {n: srv.url for n, srv in stock[setup].items()}
            flush(urls.values())
            return play_run(urls, sched, w)

        rounds = run_rounds(args.rounds, setups, run)
    finally:
        for srv in every:
            srv.stop()
    return {"plan": plan, "splits": [{"name": s.name, "fractions": s.fractions, "cores": s.cores,
                                      "max_total_tokens": s.max_total_tokens(plan)} for s in splits],
            "solo": solo, "schedule_requests": len(sched), "rounds": rounds,
            "cells": score_cells(w, rounds, [s.name for s in splits], solo, args.scales)}  # fmt: skip


def score_cells(w: Workload, rounds: list[dict], split_names: list[str], solo: dict, scales) -> dict:
    cells = {}
    for k in scales:
        memx = [score_run(r[f"memx@{k:g}"]["requests"], solo, k, r[f"memx@{k:g}"]["wall_s"]) for r in rounds]
        stock = {n: [score_run(r[n]["requests"], solo, k, r[n]["wall_s"]) for r in rounds] for n in split_names}
        cells[f"{k:g}"] = cell(memx, stock, split_names, "equal", w.memory_bound, k)
    return cells


def heatmap(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["workloads"])
    scales = doc["params"]["scales"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(scales), 1.0 + 0.8 * len(names)))
    grid = [[doc["workloads"][n]["cells"][f"{k:g}"]["ratio_vs_best"]["median"] for k in scales] for n in names]
    ax.imshow([[min(v, 2.0) for v in row] for row in grid], cmap="RdYlGn", vmin=0.0, vmax=2.0, aspect="auto")
    for i, n in enumerate(names):
        for j, k in enumerate(scales):
            c = doc["workloads"][n]["cells"][f"{k:g}"]
            st = c["ratio_vs_best"]
            ax.text(j, i, f"{st['median']:.2f}\n[{st['min']:.2f}, {st['max']:.2f}]\n{c['best_split']}",
                    ha="center", va="center", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(scales)), [f"x{k:g}" for k in scales])
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("SLO scale (x solo TTFT / TPOT)")
    ax.set_title("SLO attainment, memx / best static split (median [min, max]; best split)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {sorted(WORKLOADS)}")
    ap.add_argument("--scales", default=",".join(map(str, SCALES)), help="comma-separated SLO scales")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--splits", default="", help="comma-separated candidate names to keep (default: all feasible)")
    ap.add_argument("--memx-args", default="--memx-host-buffer-gb 1", help="memx flags for every engine (serve.sh's)")
    ap.add_argument("--dry-run", action="store_true", help="print the plans and splits and exit")
    ap.add_argument("--out", default="matrix", help="results name under benchmark/results/e2e/")
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="recompute the cells and claims of <out>.json from its recorded requests (no server)",
    )
    args = ap.parse_args(argv)
    args.workloads = [x for x in args.workloads.split(",") if x]
    for name in args.workloads:
        if name not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    try:
        args.scales = [float(x) for x in args.scales.split(",") if x]
    except ValueError:
        ap.error(f"--scales: not a list of numbers: {args.scales!r}")
    if not args.scales or any(k <= 0 for k in args.scales):
        ap.error("--scales: give one or more scales > 0")
    if args.rounds < 1:
        ap.error("--rounds: must be >= 1")
    args.splits = [x for x in args.splits.split(",") if x]
    args.memx_args = args.memx_args.split()
    return args


def rescore(path: Path) -> dict:
    """The cells and claims of a results file, recomputed from the requests it recorded (the scoring
    code may have gained fields since the run); the measurements are untouched."""
    doc = json.loads(path.read_text())
    for name, wd in doc["workloads"].items():
        split_names = [s["name"] for s in wd["splits"]]
        wd["cells"] = score_cells(WORKLOADS[name], wd["rounds"], split_names, wd["solo"], doc["params"]["scales"])
    doc["claims"] = claims({n: d["cells"] for n, d in doc["workloads"].items()})
    doc["rescored"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return doc


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rescore:
        path = RESULTS / f"{args.out}.json"
        doc = rescore(path)
        path.write_text(json.dumps(doc, indent=1))
        heatmap(doc, path.with_suffix(".png"))
        print(json.dumps(doc["claims"], indent=1))
        return 0
    command = "python benchmark/e2e/matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# {command}", flush=True)
    doc = {"command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "params": {**vars(args)}, "missing_workloads": MISSING_WORKLOADS, "workloads": {}}  # fmt: skip
    for name in args.workloads:
        w = WORKLOADS[name]
        doc["workloads"][name] = {"description": w.description, "memory_bound": w.memory_bound,
                                  **run_workload(w, args)}  # fmt: skip
        if not args.dry_run:  # after every workload: a run cut short keeps the workloads it finished
            doc["workloads_done"] = list(doc["workloads"])
            doc["claims"] = claims({n: d["cells"] for n, d in doc["workloads"].items()})
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
            heatmap(doc, RESULTS / f"{args.out}.png")
            print(json.dumps(doc["claims"], indent=1))
            print(f"wrote {RESULTS / args.out}.json, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
