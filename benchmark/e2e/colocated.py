"""Three co-located servers, bursty traffic: static KV split (stock) vs one shared budget (memx).

Same machine, same run, same memory. Stock SGLang gets a third of the KV
budget per server (``--max-total-tokens``) and its activations outside it;
memx servers join one pool (``--memx-elastic-kv --memx-pool``) whose budget
is the whole KV amount plus three prefill batches' activations (KV and
activations share it), each with the whole amount as logical capacity. Both
use 64-token chunked prefill. Traffic comes in phases: in phase
k model k gets a burst of concurrent requests while the others see a trickle,
so at any time one server needs far more than a third of the memory.

Reports per setup TTFT p50/p99, TPOT p50, throughput (output tok/s), and the
number of retractions; and memx/stock ratios. JSON + PNG under
benchmark/results/e2e/.

    python benchmark/e2e/colocated.py [--phases 3] [--phase-s 20] [--burst 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark._stats import percentile  # noqa: E402
from support.server import SGLangServer, start_all  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
CHUNK_KB = 4
TOKEN_ROW_BYTES = 64  # tiny Llama: 2 KV heads x 16 dims x bf16, per layer and K/V
LAYERS = 2


def stream_one(server: SGLangServer, text: str, new_tokens: int) -> dict:
    """One streaming /generate; returns ttft, e2e, tokens, retractions (or error)."""
    body = json.dumps(
        {
            "text": text,
            "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        }
    ).encode()
    req = urllib.request.Request(server.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, last = None, None
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = json.loads(line[5:])
    except Exception as exc:  # noqa: BLE001 - recorded, counted as a failure
        return {"error": repr(exc)}
    e2e = time.perf_counter() - t0
    if last is None or "meta_info" not in last:
        return {"error": f"stream ended without a result: {last!r}"}
    meta = last["meta_info"]
    n = meta["completion_tokens"]
    return {
        "ttft": ttft,
        "e2e": e2e,
        "tokens": n,
        "tpot": (e2e - ttft) / max(1, n - 1),
        "retractions": meta.get("num_retractions", 0),
    }


def drive(
    servers, phases: int, burst: int, trickle_s: float, new_tokens: int, prompt_words: int, phase_s: float
) -> list:
    """The same request schedule for every setup: each phase lasts ``phase_s``; the busy
    model gets ``burst`` requests at its start, the others one every ``trickle_s``."""
    results, lock, threads = [], threading.Lock(), []

    def run(i, text):
        r = stream_one(servers[i], text, new_tokens)
        r["server"] = i
        with lock:
            results.append(r)

    def launch(i, text):
        threads.append(threading.Thread(target=run, args=(i, text)))
        threads[-1].start()

    for phase in range(phases):
        busy = phase % len(servers)
        start = time.perf_counter()
        for b in range(burst):
            launch(busy, f"phase {phase} burst {b} " + " ".join(f"w{b}_{j}" for j in range(prompt_words)))
        for k in range(int(phase_s // trickle_s)):
            time.sleep(max(0.0, start + k * trickle_s - time.perf_counter()))
            for i in range(len(servers)):
                if i != busy:
                    launch(i, f"phase {phase} trickle {k} " + " ".join(f"v{k}_{j}" for j in range(prompt_words)))
        time.sleep(max(0.0, start + phase_s - time.perf_counter()))
    for t in threads:
        t.join()
    return results


def summarize(results: list, wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_p50_s": percentile(ttft, 0.50),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": statistics.median(r["tpot"] for r in ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
        "retractions": sum(r["retractions"] for r in ok),
        "wall_s": wall,
    }


CHUNKED_PREFILL = 64  # both setups; bounds one prefill batch's activation


def activation_bytes() -> int:
    """One CHUNKED_PREFILL-token prefill's activation of the tiny Llama in bf16 (memx's profile)."""
    from memory_ext.policy.activation import ActivationProfile

    p = ActivationProfile.from_model_dims(
        hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab=512, itemsize=2
    )
    return p.bytes_for(CHUNKED_PREFILL, 1)


def run_setup(kind: str, model, budget_tokens: int, args, pool_dir: Path) -> dict:
    """Same memory: stock's three KV pools + each server's activations (outside its pool, up to one
    prefill batch each) = memx's shared budget for KV and activations together."""
    per_group = 64 * TOKEN_ROW_BYTES * 2 * LAYERS  # bytes of one 64-token group over all buffers
    budget_gb = ((budget_tokens // 64) * per_group + 3 * activation_bytes()) / (1 << 30)
    common = ["--chunked-prefill-size", str(CHUNKED_PREFILL)]
    if kind == "stock":
        servers = [
            SGLangServer(
                model, name=f"bench-colo-stock{i}", stock=True, max_total_tokens=budget_tokens // 3, extra_args=common
            )
            for i in range(3)
        ]
    else:
        extra = common + [
            "--memx-elastic-kv",
            "--memx-pool",
            f"bench{os.getpid()}",
            "--memx-pool-budget-gb",
            f"{budget_gb:.12f}",
            "--memx-pool-dir",
            str(pool_dir),
            "--memx-chunk-kb",
            str(CHUNK_KB),
        ]
        servers = [
            SGLangServer(model, name=f"bench-colo-memx{i}", max_total_tokens=budget_tokens, extra_args=extra)
            for i in range(3)
        ]
    start_all(servers)
    try:
        for s in servers:
            s.generate("warm up", max_new_tokens=4, temperature=0)
        t0 = time.perf_counter()
        results = drive(
            servers, args.phases, args.burst, args.trickle_s, args.new_tokens, args.prompt_words, args.phase_s
        )
        out = summarize(results, time.perf_counter() - t0)
    finally:
        for s in servers:
            s.stop()
        if kind == "memx":
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "sglang_memx.cli",
                    "pool",
                    "stop",
                    f"bench{os.getpid()}",
                    "--pool-dir",
                    str(pool_dir),
                ],
                check=False,
                capture_output=True,
            )
    out["budget_tokens_total"] = budget_tokens
    return out


def ratio_bars(doc: dict, keys, labels, title: str, path: Path, ratio_name: str = "memx/stock") -> None:
    """One bar pair (stock, memx) per metric, titled with the memx/stock ratio; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(14, 3.2))
    for ax, key in zip(axes, keys):
        ax.bar(labels, [doc["stock"][key], doc["memx"][key]], color=["#999", "#2a7"])
        ax.set_title(f"{key}\n{ratio_name} = {doc['ratios'][key]:.2f}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(doc: dict, path: Path) -> None:
    ratio_bars(
        doc,
        ["ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s"],
        ["stock (static split)", "memx (shared pool)"],
        f"3 co-located tiny Llama servers, {doc['budget_tokens_total']} KV tokens in total",
        path,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--trickle-s", type=float, default=4.0)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--budget-tokens", type=int, default=1536, help="total KV tokens of the three servers")
    args = ap.parse_args()
    command = "python benchmark/e2e/colocated.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    model = tiny_model(
        TinyModelSpec(arch="llama", num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16, seed=5), root
    )
    pool_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-bench-pools-{os.getpid()}"
    doc = {
        "command": command,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "budget_tokens_total": args.budget_tokens,
        "params": vars(args),
    }
    for kind in ("stock", "memx"):
        doc[kind] = run_setup(kind, model, args.budget_tokens, args, pool_dir)
        print(kind, json.dumps(doc[kind]), flush=True)
    write_results(doc, ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s"), "colocated", plot)
    return 0


def write_results(doc: dict, keys, name: str, plot_fn) -> None:
    """Add memx/stock ratios of ``keys`` to ``doc``; write ``<name>.json`` and ``<name>.png``."""
    doc["ratios"] = {k: (doc["memx"][k] / doc["stock"][k] if doc["stock"][k] else float("nan")) for k in keys}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2))
    plot_fn(doc, RESULTS / f"{name}.png")
    print(json.dumps(doc["ratios"], indent=2))
    print(f"wrote {RESULTS / name}.json and {name}.png")


if __name__ == "__main__":
    sys.exit(main())
