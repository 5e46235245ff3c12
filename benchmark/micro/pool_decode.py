"""Pool microbenchmark: the decode-step allocation cost of elastic KV, on the server's own mechanism.

``ElasticKV`` over ``LayeredKVBuffers`` (host backend) drives upstream's real
``TokenToKVPoolAllocator``. A decode loop: R requests each get one new KV slot per step; a
request that reaches its (random) length frees all its slots and is replaced; between steps
the server's tick runs ``shrink`` (keeping spare groups) and, in the premapped variant,
``refill`` (the premap). The timed region ("request path") is what upstream's decode step does:
``alloc`` (with memx's hook: ``grow`` first) and the frees. Variants, same lengths:

  (a) on_demand:  no spare group, no premap: groups are mapped on the request path;
  (b) premapped:  one spare group kept and ``refill`` between steps (memx's tick, off the path);
  (c) stock:      upstream's allocator over plain tensors (no elastic KV).

Reports per-step p50/p99 µs and the map calls made on the request path per step. JSON + PNG
under benchmark/results/micro/.

    python benchmark/micro/pool_decode.py [--steps 20000] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results" / "micro"
sys.path.insert(0, str(REPO))

from benchmark._stats import summary_us  # noqa: E402

ROW = 256  # bytes per token row per buffer (4 KV heads x 32 dims x bf16)
BUFFERS = 8  # 4 layers, K and V
CHUNK = 64 << 10


def _allocator(num_tokens: int, elastic: bool, spare: int):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from memory_ext.pool import ChunkPool, LayeredKVBuffers
    from memory_ext.vmm import host_backend
    from sglang_memx.coordinator import device
    from sglang_memx.elastic.kv import ElasticKV

    cache = types.SimpleNamespace()
    alloc = TokenToKVPoolAllocator(num_tokens, torch.bfloat16, "cpu", cache, need_sort=True)
    if not elastic:
        return alloc, None
    backend = host_backend(CHUNK)
    layered = LayeredKVBuffers(ChunkPool(backend, 1 << 16), [ROW] * BUFFERS, num_tokens + 1, 1)
    kv = ElasticKV(layered, 1, num_tokens, spare_groups=spare)
    device.attach(alloc, kv)
    kv.restrict_free_list(alloc)
    return alloc, kv


def run(variant: str, steps: int, requests: int, num_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    alloc, kv = _allocator(num_tokens, variant != "stock", spare=1 if variant == "premapped" else 0)
    live = [[] for _ in range(requests)]
    target = [rng.randint(32, 512) for _ in range(requests)]
    times, maps_before = [], kv.map_calls["request"] if kv else 0
    for _ in range(steps):
        if kv is not None:  # the tick, off the request path
            kv.shrink(alloc)
            if variant == "premapped":
                kv.refill(alloc, requests + kv.spare_groups * kv.group_pages)
        t0 = time.perf_counter()
        if kv is not None:
            kv.grow(alloc, requests)  # memx's alloc hook
        got = alloc.alloc(requests)
        done = []
        for i in range(requests):
            live[i].append(got[i : i + 1])
            if len(live[i]) >= target[i]:
                done.append(i)
        for i in done:
            alloc.free(torch.cat(live[i]))
            live[i], target[i] = [], rng.randint(32, 512)
        times.append(time.perf_counter() - t0)
    maps = (kv.map_calls["request"] - maps_before) if kv else 0
    return {**summary_us(times), "request_path_maps_per_step": maps / steps,
            "premap_calls": kv.map_calls["premap"] if kv else 0}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    command = "python benchmark/micro/pool_decode.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    doc = {"command": command, "where": f"CPU host backend, {platform.machine()}, {os.cpu_count()} cores",
           "params": vars(args), "variants": {}}  # fmt: skip
    for variant in ("on_demand", "premapped", "stock"):
        doc["variants"][variant] = run(variant, args.steps, args.requests, args.tokens, args.seed)
        print(variant, json.dumps(doc["variants"][variant]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pool_decode_host.json").write_text(json.dumps(doc, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["variants"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].bar(names, [doc["variants"][n]["p50_us"] for n in names], label="p50")
    axes[0].bar(names, [doc["variants"][n]["p99_us"] for n in names], alpha=0.4, label="p99")
    axes[0].set_ylabel("µs per decode step (request path)")
    axes[0].legend()
    axes[1].bar(names, [doc["variants"][n]["request_path_maps_per_step"] for n in names], color="#c44")
    axes[1].set_ylabel("map calls per decode step")
    fig.suptitle(f"{args.requests} decoding requests, {args.steps} steps (CPU host backend)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "pool_decode_host.png", dpi=110)
    print(f"wrote {RESULTS / 'pool_decode_host.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
