"""Pool microbenchmark: steady-state decode-step allocation cost of the KV eTensor.

A decode loop: R requests each get one new KV page per step; a request that
reaches its (random) length frees all its pages and is replaced. Per step the
timed region ("hot path") is ``ensure_mapped(new pages)`` + ``free_pages(pages
of finished requests)``. Three variants, same page choice and request lengths:

  (a) on_demand:      KVETensor(headroom 0, sync unmap): maps/unmaps on the hot path;
  (b) premap_async:   KVETensor(headroom K, async unmap), ``refill()`` between steps
                      (outside the timed region, standing in for a background worker);
  (c) torch_empty:    plain ``torch.empty(page_bytes)`` per new page, freed by dropping it.

Page picking (``suggest_pages``) is the caller's allocator and is not timed.
Reports per-step p50/p99 µs and map/unmap calls made by the calling thread
during the timed region, per step. Writes JSON + PNG under benchmark/results/micro/.

    python benchmark/micro/pool_decode.py [--steps 20000] [--requests 16] [--headroom 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results" / "micro"
sys.path.insert(0, str(REPO))


sys.path.insert(0, str(REPO / "benchmark"))
from _stats import summary_us as _summary  # noqa: E402


class _ThreadCalls:
    """Counts backend map/unmap calls made by the thread that created it."""

    def __init__(self, vmm):
        self.me = threading.get_ident()
        self.n = {"map": 0, "unmap": 0}
        for name in ("map", "unmap"):
            orig = getattr(vmm, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                out = _orig(*a, **k)
                if threading.get_ident() == self.me:
                    self.n[_name] += 1
                return out

            setattr(vmm, name, wrapped)


def _lengths(seed, n, lo, hi):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def run_kv(variant, args, lengths):
    from memory_ext.pool import ChunkPool, KVETensor
    from memory_ext.vmm import host_backend

    vmm = host_backend(args.granularity)
    pool = ChunkPool(vmm, args.num_pages * args.page_bytes // args.granularity + 8)
    premap = variant == "premap_async"
    kv = KVETensor(
        pool, args.page_bytes, args.num_pages, headroom_slots=args.headroom if premap else 0, async_unmap=premap
    )
    calls = _ThreadCalls(vmm)
    reqs, it = {}, iter(lengths)
    times, hot_maps, hot_unmaps = [], 0, 0
    for step in range(args.warmup + args.steps):
        if premap:
            kv.refill()
        while len(reqs) < args.requests:
            reqs[len(reqs) + step * args.requests] = ([], next(it))
        want = kv.suggest_pages(len(reqs))
        m0, u0 = calls.n["map"], calls.n["unmap"]
        t0 = time.perf_counter()
        kv.ensure_mapped(want)
        done = []
        for (r, (pages, n)), p in zip(list(reqs.items()), want):
            pages.append(p)
            if len(pages) >= n:
                done.append(r)
        kv.free_pages([p for r in done for p in reqs[r][0]])
        dt = time.perf_counter() - t0
        for r in done:
            del reqs[r]
        if step >= args.warmup:
            times.append(dt)
            hot_maps += calls.n["map"] - m0
            hot_unmaps += calls.n["unmap"] - u0
    kv.flush()
    kv.check_invariants()
    pool.check_invariants()
    stats = kv.stats()
    kv.close()
    total = vmm.counters()
    pool.close()
    vmm.close()
    out = _summary(times)
    out.update(
        {
            "hot_path_map_calls_per_step": hot_maps / args.steps,
            "hot_path_unmap_calls_per_step": hot_unmaps / args.steps,
            "all_threads_map_calls": total["map_calls"],
            "all_threads_unmap_calls": total["unmap_calls"],
            "kv_stats": stats,
        }
    )
    return out


def run_torch(args, lengths):
    reqs, it = {}, iter(lengths)
    times = []
    for step in range(args.warmup + args.steps):
        while len(reqs) < args.requests:
            reqs[len(reqs) + step * args.requests] = ([], next(it))
        t0 = time.perf_counter()
        done = []
        for r, (pages, n) in list(reqs.items()):
            pages.append(torch.empty(args.page_bytes, dtype=torch.uint8))
            if len(pages) >= n:
                done.append(r)
        for r in done:
            del reqs[r]  # drops the tensors: the allocator frees them here
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
    out = _summary(times)
    out.update({"hot_path_map_calls_per_step": 0.0, "hot_path_unmap_calls_per_step": 0.0})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--headroom", type=int, default=4)
    ap.add_argument("--granularity-mib", type=int, default=2)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.granularity = args.granularity_mib << 20
    args.page_bytes = args.page_kib << 10
    args.num_pages = args.requests * args.max_len * 2
    command = "python benchmark/micro/pool_decode.py " + " ".join(sys.argv[1:])
    print(f"command: {command}")
    lengths = _lengths(
        args.seed, (args.warmup + args.steps) * args.requests + args.requests, args.min_len, args.max_len
    )
    t_start = time.perf_counter()
    res = {
        "variants": {
            "on_demand": run_kv("on_demand", args, lengths),
            "premap_async": run_kv("premap_async", args, lengths),
            "torch_empty": run_torch(args, lengths),
        }
    }
    res.update(
        {
            "command": command,
            "where": f"CPU host backend (memfd + mmap), {platform.machine()}, {os.cpu_count()} cores, no GPU",
            "config": {
                k: getattr(args, k)
                for k in (
                    "steps",
                    "warmup",
                    "requests",
                    "headroom",
                    "granularity",
                    "page_bytes",
                    "num_pages",
                    "min_len",
                    "max_len",
                    "seed",
                )
            },
            "timed_region": "ensure_mapped(new pages) + free_pages(finished requests); refill() and page "
            "picking excluded; torch_empty: one torch.empty per new page + dropping finished",
            "wall_s": time.perf_counter() - t_start,
            "torch": torch.__version__,
        }
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / "pool_decode_host"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [res["variants"][n]["p50_us"] for n in names], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [res["variants"][n]["p99_us"] for n in names], 0.4, label="p99")
    labels = [
        f"{n}\n{res['variants'][n]['hot_path_map_calls_per_step']:.3f} map + "
        f"{res['variants'][n]['hot_path_unmap_calls_per_step']:.3f} unmap /step"
        for n in names
    ]
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("µs per decode step (hot path)")
    ax.set_yscale("log")
    ax.set_title(
        f"Decode-step allocation, {args.requests} requests, {args.page_kib} KiB pages, "
        f"{args.granularity_mib} MiB chunks",
        fontsize=9,
    )
    ax.legend()
    fig.text(0.01, 0.01, command + " — " + res["where"], fontsize=6)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(
        json.dumps({n: {k: v for k, v in d.items() if k != "kv_stats"} for n, d in res["variants"].items()}, indent=2)
    )
    print(f"wall {res['wall_s']:.1f}s; wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
