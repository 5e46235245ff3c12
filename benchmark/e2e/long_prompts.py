"""One server, long prompts near its memory limit: static KV + activation split (stock) vs one
ballooning pool for both (memx elastic KV, eLLM E1/E2).

Same machine, same run, same memory M = KV of ``--kv-tokens`` tokens + the activation of one
``--chunk``-token prefill batch (from the model's activation profile). Stock SGLang gets
``--max-total-tokens kv-tokens`` (its activations live outside the KV pool, sized for the
largest batch, idle while it decodes); memx gets ``--memx-pool-budget-gb M``, so KV can
inflate into activation memory that is idle during decode. ``--requests`` long prompts
(``--prompt-words`` each) arrive together.

Reports per setup: the most requests decoding at once (from the server's decode log lines),
TTFT p50/p99, TPOT p50, throughput, retractions (medians over ``--repeats`` runs per setup, the
order alternating); memx/stock ratios. JSON + PNG under
benchmark/results/e2e/.

    python benchmark/e2e/long_prompts.py [--kv-tokens 1024] [--chunk 64] [--requests 12]

CPU elastic buffer (eLLM E3): ``--host-buffer-gb G`` gives the memx setup
``--memx-host-buffer-gb G``, so requests refused for want of decode reservation prefill anyway
and wait on the host; ``--baseline memx`` then compares against memx *without* the buffer
(same budget) instead of stock, isolating the buffer's effect. Results go to
``long_prompts_host_buffer.*`` then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmark" / "e2e"))

from colocated import LAYERS, ratio_bars, stream_one, summarize, write_results  # noqa: E402

from support.server import SGLangServer, start_all  # noqa: E402

CHUNK_KB = 4
RUNNING = re.compile(r"Decode batch, #running-req: (\d+)")


def model_and_profile():
    from memory_ext.policy.activation import ActivationProfile
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    spec = TinyModelSpec(arch="llama", num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    profile = ActivationProfile.from_model_dims(
        hidden=spec.hidden_size,
        intermediate=spec.intermediate_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab=spec.vocab_size,
        itemsize=2,
    )
    kv_token_bytes = 2 * LAYERS * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
    return tiny_model(spec, root), profile, kv_token_bytes


def run_setup(kind: str, model, memory_bytes: int, args) -> dict:
    """``kind``: "stock", or "memx" (with the host buffer if ``--host-buffer-gb``); the baseline
    side is "stock" or, with ``--baseline memx``, memx without the host buffer."""
    common = ["--chunked-prefill-size", str(args.chunk)]
    host_buffer = kind == "memx" and args.host_buffer_gb is not None
    if kind == "stock" and args.baseline == "memx":
        kind = "memx"
    if kind == "stock":
        server = SGLangServer(
            model, name="bench-long-stock", stock=True, max_total_tokens=args.kv_tokens, extra_args=common
        )
    else:
        extra = common + [
            "--memx-elastic-kv",
            "--memx-chunk-kb",
            str(CHUNK_KB),
            "--memx-pool-budget-gb",
            f"{memory_bytes / (1 << 30):.12f}",
        ]
        if host_buffer:
            extra += ["--memx-host-buffer-gb", str(args.host_buffer_gb)]
        server = SGLangServer(model, name="bench-long-memx", max_total_tokens=4 * args.kv_tokens, extra_args=extra)
    start_all([server])
    try:
        server.generate("warm up", max_new_tokens=4, temperature=0)
        mark = len(server.log_path.read_text(errors="replace"))
        results, lock = [], threading.Lock()

        def one(i):
            text = f"long {i} " + " ".join(f"p{i}_{j}" for j in range(args.prompt_words))
            r = stream_one(server, text, args.new_tokens)
            with lock:
                results.append(r)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out = summarize(results, time.perf_counter() - t0)
        running = [int(m) for m in RUNNING.findall(server.log_path.read_text(errors="replace")[mark:])]
        out["max_running_requests"] = max(running, default=0)
        if kind == "memx":
            out["elastic_kv"] = server.request("/memx/status")["schedulers"][0]["elastic_kv"]
    finally:
        server.stop()
    return out


def labels(args) -> list:
    base = "memx,\nno host buffer" if args.baseline == "memx" else "stock (static)"
    return [base, "memx\n+ host buffer" if args.host_buffer_gb is not None else "memx (ballooning)"]


def plot(doc: dict, path: Path) -> None:
    ratio_bars(
        doc,
        ["max_running_requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s"],
        doc["labels"],
        f"one tiny Llama server, {doc['memory_bytes']} B for KV + activations, "
        f"{doc['params']['requests']} long prompts at once",
        path,
        "buffer/no buffer" if doc["params"].get("baseline") == "memx" else "memx/stock",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-tokens", type=int, default=1024, help="stock's KV pool (--max-total-tokens)")
    ap.add_argument("--chunk", type=int, default=64, help="--chunked-prefill-size of both setups")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per setup, order alternating; medians reported")
    ap.add_argument("--host-buffer-gb", type=float, default=None, help="give memx a CPU elastic buffer this big")
    ap.add_argument(
        "--baseline",
        choices=("stock", "memx"),
        default="stock",
        help="compare against stock SGLang, or against memx without the host buffer",
    )
    args = ap.parse_args()
    if args.baseline == "memx" and args.host_buffer_gb is None:
        ap.error("--baseline memx compares against memx without the host buffer: give --host-buffer-gb")
    command = "python benchmark/e2e/long_prompts.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    model, profile, kv_token_bytes = model_and_profile()
    memory = args.kv_tokens * kv_token_bytes + profile.bytes_for(args.chunk, 1)
    doc = {
        "command": command,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "memory_bytes": memory,
        "kv_bytes_stock": args.kv_tokens * kv_token_bytes,
        "activation_bytes_per_chunk": profile.bytes_for(args.chunk, 1),
        "params": vars(args),
        "labels": labels(args),
    }
    keys = ("max_running_requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s")
    runs = {"stock": [], "memx": []}
    for rep in range(args.repeats):  # alternate the order: a noisy neighbour hits both setups alike
        for kind in ("stock", "memx") if rep % 2 == 0 else ("memx", "stock"):
            runs[kind].append(run_setup(kind, model, memory, args))
            print(kind, json.dumps({k: v for k, v in runs[kind][-1].items() if k != "elastic_kv"}), flush=True)
    for kind, rs in runs.items():  # per metric, the median over repeats
        doc[kind] = {k: statistics.median(r[k] for r in rs) for k in keys + ("retractions", "failed")}
        doc[kind]["runs"] = rs
    for kind, rs in runs.items():
        hosts = [r["elastic_kv"]["host_buffer"] for r in rs if (r.get("elastic_kv") or {}).get("host_buffer")]
        if hosts:
            doc[kind]["prefill_offloads"] = statistics.median(h["prefill_offloads"] for h in hosts)
    write_results(doc, keys, "long_prompts" + ("_host_buffer" if args.host_buffer_gb is not None else ""), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
