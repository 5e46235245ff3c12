"""Weight store microbenchmark: restore bandwidth and the layer pipeline's hidden fraction.

Measured in one run on one backend (``--backend cuda`` on a lent GPU; ``host`` here):
  * the reference copy bandwidth: one ``--layer-mib`` host tensor (pinned on CUDA) copied to
    the device (on the host backend: to another host buffer), best of ``--repeats``;
  * restore bandwidth: ``WeightStore.set_streamed`` restores of every layer (map + async copy
    from the master copy, waited for), as a fraction of that reference (the issue's goal on a
    GPU: >= 90 %);
  * the hidden fraction in the layer pipeline: a stack of ``--layers`` square linear layers
    with every other layer streamed through 2 slots, ``--steps`` forwards; 1 - stall / copy
    time (goal on a GPU: >= 95 %), and the step time against the same stack unpooled.
Writes JSON + PNG under benchmark/results/micro/ (``weights_restore_<backend>``).

    python benchmark/micro/weights_restore.py [--backend cuda] [--layers 16] [--layer-mib 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmark" / "results" / "micro"


def _backend(name: str):
    from memory_ext.vmm import cuda_available, cuda_backend, host_backend
    from memory_ext.weights import CudaCopier, HostCopier

    if name == "cuda":
        if not cuda_available():
            raise SystemExit("--backend: 'cuda' needs a CUDA GPU and driver (none here)")
        return cuda_backend(0), torch.device("cuda:0"), CudaCopier(torch.device("cuda:0"))
    if name == "host":
        return host_backend(2 << 20), torch.device("cpu"), HostCopier()
    raise SystemExit(f"--backend: {name!r} is not one of 'host', 'cuda'")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reference_bandwidth(device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # warm-up: first touch of both buffers
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def run(args) -> dict:
    from memory_ext.pool import ChunkPool
    from memory_ext.weights import LayerPipeline, WeightStore

    vmm, device, copier = _backend(args.backend)
    width = int(math.sqrt(args.layer_mib * (1 << 20) / 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(args.layers)]).to(device)
    x = torch.randn(args.batch, width, device=device)

    def step_time(steps: int, pipe=None) -> float:
        best = math.inf
        for _ in range(steps + 1):  # the first forward warms up and is not timed
            if pipe:
                pipe.begin_forward()
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(x)
            _sync(device)
            if _ > 0:
                best = min(best, time.perf_counter() - t0)
            if pipe:
                pipe.end_forward()
        return best

    plain = step_time(args.steps)
    layer_bytes = width * width * 4
    chunks = args.layers * -(-layer_bytes // vmm.granularity) + 8
    store = WeightStore(ChunkPool(vmm, chunks), copier)
    for i, layer in enumerate(model):
        (p,) = list(layer.parameters())
        (p.data,) = store.add_layer(i, [p.data])
    pipe = LayerPipeline(store, list(range(args.layers)))
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda m, a, i=i: pipe.before_layer(i))
        layer.register_forward_hook(lambda m, a, o, i=i: pipe.after_layer(i))

    ref = reference_bandwidth(device, layer_bytes, args.repeats)
    restore = []
    for _ in range(args.repeats):
        store.set_streamed(range(args.layers), 1)
        _sync(device)
        t0 = time.perf_counter()
        store.set_streamed([], 0)
        for i in range(args.layers):
            store.ensure(i)
        _sync(device)
        restore.append(args.layers * layer_bytes / (time.perf_counter() - t0))
    pipe.request(range(0, args.layers, 2), 2)
    before = store.status()
    streamed = step_time(args.steps, pipe)
    after = store.status()
    copy = after["copy_seconds"] - before["copy_seconds"]
    stall = after["stall_seconds"] - before["stall_seconds"]
    store.close()
    return {
        "backend": args.backend, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "params": vars(args), "layer_bytes": layer_bytes, "reference_bytes_per_s": ref,
        "restore_bytes_per_s": max(restore), "restore_fraction_of_reference": max(restore) / ref,
        "hidden_fraction": None if copy <= 0 else max(0.0, 1 - stall / copy), "copy_s": copy, "stall_s": stall,
        "step_s_plain": plain, "step_s_half_streamed": streamed, "step_ratio": streamed / plain,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "command": "python benchmark/micro/weights_restore.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="host", help="host (default) or cuda")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--layer-mib", type=int, default=16, help="bytes of one layer's weight, MiB")
    ap.add_argument("--batch", type=int, default=64, help="rows of the input (sets the compute per layer)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    res = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"weights_restore_{args.backend}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = ["restore / reference copy", "hidden fraction", "step: half streamed / plain"]
    vals = [res["restore_fraction_of_reference"], res["hidden_fraction"] or 0.0, res["step_ratio"]]
    ax.bar(names, vals, color=["tab:blue", "tab:green", "tab:gray"])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_title(f"weight store on {res['device']} ({args.layers} layers x {args.layer_mib} MiB)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(json.dumps({k: v for k, v in res.items() if k != "params"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
