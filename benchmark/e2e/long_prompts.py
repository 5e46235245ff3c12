"""One server, long prompts near its memory limit: static KV + activation split (stock) vs one
ballooning pool for both (memx elastic KV, eLLM E1/E2), in repeated interleaved rounds.

Same machine, same memory M = KV of ``--kv-tokens`` tokens + the activation of one
``--chunk``-token prefill batch (from the model's activation profile). Stock SGLang gets
``--max-total-tokens kv-tokens`` (its activations live outside the KV pool, sized for the
largest batch, idle while it decodes); memx gets ``--memx-pool-budget-gb M``, so KV can
inflate into activation memory that is idle during decode. ``--requests`` long prompts
(``--prompt-words`` each) arrive together. Both servers start once and stay up
(``--sleep-on-idle``); every run starts with an empty prefix cache.

The bound on the batch gain: memx can hold at most ``M`` bytes of KV, stock ``kv-tokens``'
worth, so memx decodes at most ``(kv + activation) / kv`` times as many requests at once (1.37x
at the defaults; eLLM's 3x comes from activation reserves much larger than the KV pool).

Per run: the most requests decoding at once (from the clients' own first-token and end times,
not from sampled log lines), TTFT p50/p99, TPOT p50, throughput, retractions; every ratio
memx/stock per round, median and range. JSON + PNG under benchmark/results/e2e/.

    python benchmark/e2e/long_prompts.py [--kv-tokens 1024] [--chunk 64] [--requests 12] [--rounds 5]

CPU elastic buffer (eLLM E3): ``--host-buffer-gb G`` gives the memx setup
``--memx-host-buffer-gb G``; ``--baseline memx`` then compares against memx *without* the
buffer (same budget) instead of stock. Results go to ``long_prompts_host_buffer.*`` then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.e2e.load import play, serve_rounds, summarize  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats  # noqa: E402
from support.server import SGLangServer  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
CHUNK_KB = 4
LAYERS = 2
KEYS = ("max_decoding", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s")


def model_and_profile():
    from memory_ext.policy.activation import ActivationProfile
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    spec = TinyModelSpec(arch="llama", num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    profile = ActivationProfile.from_model_dims(
        hidden=spec.hidden_size, intermediate=spec.intermediate_size, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab=spec.vocab_size, itemsize=2,
    )  # fmt: skip
    kv_token_bytes = 2 * LAYERS * spec.num_kv_heads * spec.head_dim * 2  # K and V, bf16
    return tiny_model(spec, root), profile, kv_token_bytes


def max_concurrent(results: list[dict]) -> int:
    """Most requests between their first token and their end at one instant (client clocks)."""
    events = []
    for r in results:
        if "error" not in r:
            start = r["offset"] + r["ttft"]
            events += [(start, 1), (r["offset"] + r["e2e"], -1)]
    live = best = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        live += d
        best = max(best, live)
    return best


def make_servers(model, memory_bytes: int, args) -> dict[str, SGLangServer]:
    common = ["--chunked-prefill-size", str(args.chunk), "--sleep-on-idle"]
    memx = common + ["--memx-elastic-kv", "--memx-chunk-kb", str(CHUNK_KB),
                     "--memx-pool-budget-gb", f"{memory_bytes / (1 << 30):.12f}"]  # fmt: skip
    servers = {}
    if args.baseline == "stock":
        servers["stock"] = SGLangServer(model, name="bench-long-stock", stock=True, max_total_tokens=args.kv_tokens,
                                        extra_args=common)  # fmt: skip
    else:
        servers["memx_no_buffer"] = SGLangServer(model, name="bench-long-memx-nobuf",
                                                 max_total_tokens=4 * args.kv_tokens, extra_args=memx)  # fmt: skip
    if args.host_buffer_gb is not None:
        memx = memx + ["--memx-host-buffer-gb", str(args.host_buffer_gb)]
    servers["memx"] = SGLangServer(model, name="bench-long-memx", max_total_tokens=4 * args.kv_tokens,
                                   extra_args=memx)  # fmt: skip
    return servers


def host_offloads(server: SGLangServer) -> int:
    """The memx server's ``prefill_offloads`` so far (a counter since start; 0 without a host buffer)."""
    host = server.request("/memx/status")["schedulers"][0]["elastic_kv"]["host_buffer"]
    return host["prefill_offloads"] if host else 0


def run_once(server: SGLangServer, args) -> dict:
    server.flush_cache()
    before = None if server.stock else host_offloads(server)
    sched = [(0.0, 0, f"long {i} " + " ".join(f"p{i}_{j}" for j in range(args.prompt_words)))
             for i in range(args.requests)]  # fmt: skip
    results, wall = play([server.url], sched, args.new_tokens)
    out = summarize(results, wall)
    out["max_decoding"] = max_concurrent(results)
    if not server.stock:  # this run's offloads: the server stays up across rounds
        out["prefill_offloads"] = host_offloads(server) - before
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-tokens", type=int, default=1024, help="stock's KV pool (--max-total-tokens)")
    ap.add_argument("--chunk", type=int, default=64, help="--chunked-prefill-size of both setups")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host-buffer-gb", type=float, default=None, help="give memx a CPU elastic buffer this big")
    ap.add_argument("--baseline", choices=("stock", "memx"), default="stock",
                    help="compare against stock SGLang, or against memx without the host buffer")  # fmt: skip
    args = ap.parse_args()
    if args.baseline == "memx" and args.host_buffer_gb is None:
        ap.error("--baseline memx compares against memx without the host buffer: give --host-buffer-gb")
    command = "python benchmark/e2e/long_prompts.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    model, profile, kv_token_bytes = model_and_profile()
    activation = profile.bytes_for(args.chunk, 1)
    memory = args.kv_tokens * kv_token_bytes + activation
    servers = make_servers(model, memory, args)
    base = "stock" if args.baseline == "stock" else "memx_no_buffer"
    rounds = serve_rounds(servers, args.rounds, lambda s: run_once(s, args))
    doc = {
        "command": command, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "memory_bytes": memory, "kv_bytes_stock": args.kv_tokens * kv_token_bytes, "activation_bytes": activation,
        "batch_gain_bound": memory / (args.kv_tokens * kv_token_bytes), "params": vars(args), "rounds": rounds,
        "ratios": {k: ratio_stats(rounds, k, "memx", base) for k in KEYS},
    }  # fmt: skip
    name = "long_prompts" + ("_host_buffer" if args.host_buffer_gb is not None else "") + f"_chunk{args.chunk}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=1))
    label = "memx/stock" if base == "stock" else "buffer/no buffer"
    plot_ratios(doc, KEYS, RESULTS / f"{name}.png", f"one tiny Llama server, {memory} B for KV + activations, "
                f"{args.requests} long prompts at once, {args.rounds} rounds", label)  # fmt: skip
    print(json.dumps({k: {m: v for m, v in s.items() if m != "values"} for k, s in doc["ratios"].items()}, indent=1))
    print(f"wrote {RESULTS / name}.json and .png (batch gain bound {doc['batch_gain_bound']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
