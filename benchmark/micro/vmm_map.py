"""VMM microbenchmark: cost of the virtual-memory primitives, next to plain torch.

Measured in one run on one backend (host today; CUDA when that backend exists):
  * map + unmap of one chunk at a slot: latency p50 / p99 (µs), chunks per second;
  * tensor_view creation over a mapped slot (µs);
  * a fresh chunk-sized ``torch.empty`` + first touch, and ``torch.empty`` alone,
    as the plain-allocation reference.
Writes JSON + PNG under benchmark/results/micro/.

    python benchmark/micro/vmm_map.py [--backend host] [--iters 2000] [--granularity-mib 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results" / "micro"


sys.path.insert(0, str(REPO / "benchmark"))
from _stats import summary_us as _summary  # noqa: E402


def run(backend_name: str, iters: int, granularity: int) -> dict:
    from memory_ext.vmm import cuda_available, cuda_backend, host_backend

    if backend_name == "host":
        vmm, device = host_backend(granularity), "cpu"
    elif backend_name == "cuda":
        if not cuda_available():
            raise SystemExit("--backend: 'cuda' needs a CUDA GPU and driver (none here)")
        vmm, device = cuda_backend(0, granularity), "cuda"
    else:
        raise SystemExit(f"--backend: {backend_name!r} is not one of 'host', 'cuda'")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    slots = 64
    r = vmm.reserve(slots * granularity)
    chunks = [vmm.create_chunk() for _ in range(slots)]
    for c in chunks:  # touch once so first-fault cost is not in the map/unmap loop
        vmm.map(r, 0, c)
        vmm.tensor_view(r, 0, granularity).fill_(1)
        vmm.unmap(r, 0)

    map_unmap, view = [], []
    calls_before = vmm.counters()
    for i in range(iters):
        off = (i % slots) * granularity
        c = chunks[i % slots]
        t0 = time.perf_counter()
        vmm.map(r, off, c)
        vmm.unmap(r, off)
        map_unmap.append(time.perf_counter() - t0)
    vmm.map(r, 0, chunks[0])
    for _ in range(iters):
        t0 = time.perf_counter()
        v = vmm.tensor_view(r, 0, (granularity // 2,), torch.float16)
        view.append(time.perf_counter() - t0)
        del v
    vmm.unmap(r, 0)
    calls = {k: vmm.counters()[k] - calls_before.get(k, 0) for k in ("map_calls", "unmap_calls")}

    empty, empty_touch = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        t = torch.empty(granularity, dtype=torch.uint8, device=device)
        empty.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        t = torch.empty(granularity, dtype=torch.uint8, device=device)
        t.fill_(1)
        sync()
        empty_touch.append(time.perf_counter() - t0)
        del t
    for c in chunks:
        vmm.destroy_chunk(c)
    vmm.release(r)
    vmm.close()
    mu = _summary(map_unmap)
    return {
        "backend": backend_name,
        "device": device,
        "granularity_bytes": granularity,
        "iters": iters,
        "map_unmap": mu,
        "chunks_mapped_per_s": 1e6 / mu["mean_us"],
        "tensor_view": _summary(view),
        "torch_empty": _summary(empty),
        "torch_empty_and_touch": _summary(empty_touch),
        "driver_calls_in_loop": calls,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="host")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--granularity-mib", type=int, default=2)
    args = ap.parse_args()
    command = "python benchmark/micro/vmm_map.py " + " ".join(sys.argv[1:])
    print(f"command: {command}")
    res = run(args.backend, args.iters, args.granularity_mib << 20)
    res["command"] = command
    if args.backend == "cuda":
        res["where"] = f"GPU: {torch.cuda.get_device_name(0)}, cuda backend"
    else:
        res["where"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores), host backend"
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"vmm_map_{args.backend}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["map_unmap", "tensor_view", "torch_empty", "torch_empty_and_touch"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [res[n]["p50_us"] for n in names], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [res[n]["p99_us"] for n in names], 0.4, label="p99")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("µs per operation")
    ax.set_yscale("log")
    ax.set_title(f"VMM primitives vs torch.empty ({args.backend}, {args.granularity_mib} MiB chunks)")
    ax.legend()
    fig.text(0.01, 0.01, command + " — " + res["where"], fontsize=6)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(
        json.dumps(
            {
                k: res[k]
                for k in ("map_unmap", "chunks_mapped_per_s", "tensor_view", "torch_empty", "torch_empty_and_touch")
            },
            indent=2,
        )
    )
    print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
