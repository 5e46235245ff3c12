"""Max context on the same local memory: stock SGLang vs memx's layer stream cache (SwiftCache W2).

Both servers get ``--max-total-tokens T`` (default 1024): stock holds T tokens of every layer; memx with
``--memx-peer-kv borrow --memx-peer-layer-stream`` takes those T tokens x L layers as its local KV budget
and, with a co-located donor (``--memx-peer-kv donate`` on the same pool) lending memory, holds as many
tokens as ``plan_layer_stream`` (plan_lsc, Eq. 1-5) allows (docs/peer-kv.md, "Layer stream cache (W2)").

Per server: ``max_total_num_tokens`` (``/get_server_info``), then the longest prompt that really runs
(bisection on the prompt length, one greedy token each; a refusal or an error is "does not fit"). The
longest prompt memx ran is then run on a stock server with enough memory: its greedy output must be the
same. Max context is a capacity figure (deterministic): one run. Tiny Llama (8 layers, GQA 4/2, head dim
16), float32, CPU. JSON + PNG under benchmark/results/e2e/.

    flock /tmp/memx-cpu.lock python benchmark/e2e/peer_maxctx.py [--tokens 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from support.server import SGLangServer, start_all  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
COMMON = ["--dtype", "float32"]
NEW = 4


def model(layers: int):
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    spec = TinyModelSpec(arch="llama", num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=65536, seed=5)  # fmt: skip
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    return tiny_model(spec, root), spec


def fits(server: SGLangServer, ids: list[int]) -> list[int] | None:
    """The greedy output, or None if the server refused or failed the prompt. Every probe starts
    with an empty prefix cache (``/flush_cache``): probes are independent, and a memx server then
    never has to evict an earlier probe's prefix first (an elastic-KV admission stall seen with an
    evictable 4,115-token prefix and a 6,144-token probe: docs/peer-kv.md)."""
    server.flush_cache()  # retries while a refused probe is still pending
    try:
        out = server.request("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}, timeout=600)  # fmt: skip
    except (urllib.error.HTTPError, urllib.error.URLError, TimeoutError, OSError) as exc:
        print(f"  {server.name}: {len(ids)} tokens: refused ({str(exc)[:120]})", flush=True)
        return None
    if isinstance(out, dict) and out.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort":
        print(f"  {server.name}: {len(ids)} tokens: aborted", flush=True)
        return None
    print(f"  {server.name}: {len(ids)} tokens: ok", flush=True)
    return out["output_ids"]


def longest(server: SGLangServer, tokens: list[int], hi: int) -> int:
    """Largest n <= hi with ``tokens[:n]`` running (bisection; 1 must fit)."""
    lo = 1
    if fits(server, tokens[:hi]) is not None:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(server, tokens[:mid]) is not None:
            lo = mid
        else:
            hi = mid
    return lo


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["stock", "memx LSC (at least)" if doc["memx"].get("max_context_is_lower_bound") else "memx LSC",
             "plan_lsc bound"]  # fmt: skip
    bound = doc["memx"]["layer_stream"]["plan_lsc"]["max_context_tokens"]
    vals = [doc["stock"]["max_context"], doc["memx"]["max_context"], bound]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(names, vals, color=["#888", "#2a7", "#cde"])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v}", ha="center", va="bottom")
    ax.set_ylabel("longest prompt that runs (tokens)")
    ax.set_title(f"Max context, same local KV ({doc['local_tokens']} tokens x {doc['layers']} layers): "
                 f"{doc['ratio']:.2f}x", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="--max-total-tokens of both servers (local budget)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--donate-gb", type=float, default=0.04, help="the donor's --memx-peer-donate-max-gb")
    ap.add_argument("--budget-gb", type=float, default=0.15, help="the shared pool's budget")
    ap.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size of every server")
    ap.add_argument("--out", default="peer_maxctx")
    args = ap.parse_args()
    common = COMMON + ["--chunked-prefill-size", str(args.chunk)]
    path, spec = model(args.layers)
    pool_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"memx-maxctx-{os.getpid()}"
    pool_dir.mkdir(parents=True, exist_ok=True)
    name = f"mc{os.getpid()}"
    pool = ["--memx-elastic-kv", "--memx-pool", name, "--memx-pool-budget-gb", str(args.budget_gb),
            "--memx-pool-dir", str(pool_dir)]  # fmt: skip
    donor = SGLangServer(path, name="maxctx-donor", max_total_tokens=65536,
                         extra_args=common + pool + ["--memx-peer-kv", "donate", "--memx-peer-donate-max-gb",
                                                     str(args.donate_gb)])  # fmt: skip
    stream = ["--memx-peer-kv", "borrow", "--memx-peer-layer-stream"]
    memx = SGLangServer(path, name="maxctx-memx", max_total_tokens=args.tokens, extra_args=common + pool + stream)
    stock = SGLangServer(path, name="maxctx-stock", stock=True, max_total_tokens=args.tokens, extra_args=common)
    rng = random.Random(0)
    t0 = time.time()
    doc: dict = {
        "local_tokens": args.tokens,
        "layers": args.layers,
        "model": "tiny llama, GQA 4/2, head_dim 16",
        "dtype": "float32",
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python benchmark/e2e/peer_maxctx.py", *sys.argv[1:]]),  # as run (a flock is not seen)
    }
    try:
        start_all([donor, memx, stock])
        info = {s.name: s.request("/get_server_info")["max_total_num_tokens"] for s in (memx, stock)}
        hi = max(info.values())
        tokens = [rng.randrange(3, spec.vocab_size) for _ in range(hi)]
        st_stock = longest(stock, tokens, info[stock.name])
        st_memx = longest(memx, tokens, info[memx.name])
        status = memx.request("/memx/status")["schedulers"][0]["peer_kv"]["layer_stream"]
        memx_out = fits(memx, tokens[:st_memx])
        doc["stock"] = {"max_total_num_tokens": info[stock.name], "max_context": st_stock}
        doc["memx"] = {"max_total_num_tokens": info[memx.name], "max_context": st_memx, "layer_stream": status}
        stock.stop()
        big = SGLangServer(path, name="maxctx-stock-big", stock=True, max_total_tokens=st_memx + 256, extra_args=common)
        start_all([big])
        try:
            ref = fits(big, tokens[:st_memx])
        finally:
            big.stop()
        doc["memx"]["greedy_equals_stock_with_enough_memory"] = ref is not None and ref == memx_out
    finally:
        for s in (donor, memx, stock):
            s.stop()
        subprocess.run([sys.executable, "-m", "sglang_memx.cli", "pool", "stop", name, "--pool-dir", str(pool_dir)],
                       check=False)  # fmt: skip
    doc["ratio"] = doc["memx"]["max_context"] / doc["stock"]["max_context"]
    doc["wall_s"] = round(time.time() - t0, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, RESULTS / f"{args.out}.png")
    print(json.dumps({k: doc[k] for k in ("stock", "ratio")}, indent=2))
    print("memx:", {k: v for k, v in doc["memx"].items() if k != "layer_stream"})


if __name__ == "__main__":
    main()
