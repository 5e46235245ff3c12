"""One server whose KV does not fit beside its full weights: stock SGLang, upstream's
``--cpu-offload-gb``, and memx remappable weights (Oneiros), in repeated interleaved rounds.

Same machine, same memory M = the decoder layers' weights + KV of ``--kv-tokens`` tokens.
Stock gets ``--max-total-tokens kv-tokens`` (its weights sit beside). Upstream's offloader
gets the same plus ``--cpu-offload-gb`` of the weights' size; on a CPU device it offloads
nothing (``OffloaderV1`` skips modules already on the CPU), so on this machine it
measures as stock, and it is kept to show that. memx gets ``--memx-pool-budget-gb M`` (plus
the activation of one prefill chunk, which stock keeps outside its KV too) with
``--memx-weights remap``: layers are released to KV under pressure and streamed back.
``--requests`` prompts arrive together. The servers start once; every run starts with an
empty prefix cache.

Per run: max requests decoding at once, TTFT p50/p99, TPOT p50, throughput, and for memx
the layers lent at the peak, the copy time hidden under compute and the stall time; every
ratio vs stock per round, median and range. JSON + PNG under benchmark/results/e2e/.

    python benchmark/e2e/weights.py [--kv-tokens 512] [--requests 6] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.e2e.load import play, serve_rounds, summarize  # noqa: E402
from benchmark.e2e.long_prompts import max_concurrent  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats  # noqa: E402
from support.server import SGLangServer  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
CHUNK_KB = 16
KEYS = ("max_decoding", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s")


def model_and_sizes(chunk: int):
    from memory_ext.policy.activation import ActivationProfile
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    spec = TinyModelSpec(arch="llama", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                         intermediate_size=512, seed=7)  # fmt: skip
    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    h, i, q, kv, d = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    layer_bytes = 4 * (h * (q + 2 * kv) * d + q * d * h + 2 * i * h + h * i + 2 * h)  # float32
    profile = ActivationProfile.from_model_dims(hidden=h, intermediate=i, num_heads=q, num_kv_heads=kv, head_dim=d,
                                                vocab=spec.vocab_size, itemsize=4)  # fmt: skip
    kv_token_bytes = 2 * spec.num_layers * kv * d * 4
    return tiny_model(spec, root), spec.num_layers * layer_bytes, kv_token_bytes, profile.bytes_for(chunk, 1)


def make_servers(model, weights: int, memory: int, activation: int, args) -> dict[str, SGLangServer]:
    common = ["--dtype", "float32", "--chunked-prefill-size", str(args.chunk), "--sleep-on-idle"]
    servers = {"stock": SGLangServer(model, name="bench-w-stock", stock=True, max_total_tokens=args.kv_tokens,
                                     extra_args=common)}  # fmt: skip
    if "offload" in args.setups:
        offload = common + ["--cpu-offload-gb", str(-(-weights // (1 << 30)))]  # an int: every weight byte
        servers["offload"] = SGLangServer(model, name="bench-w-offload", stock=True, max_total_tokens=args.kv_tokens,
                                          extra_args=offload)  # fmt: skip
    memx = common + ["--memx-elastic-kv", "--memx-chunk-kb", str(CHUNK_KB), "--memx-weights", "remap",
                     "--memx-pool-budget-gb", f"{(memory + activation) / (1 << 30):.12f}"]  # fmt: skip
    servers["memx"] = SGLangServer(model, name="bench-w-memx", max_total_tokens=8 * args.kv_tokens, extra_args=memx)
    return servers


def _weights(server) -> dict:
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["weights"]


def run_once(server: SGLangServer, args) -> dict:
    server.request_text("/flush_cache")
    before = None if server.stock else _weights(server)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.wait(0.25):
            peak[0] = max(peak[0], _weights(server)["lent_layers"])

    watcher = None if server.stock else threading.Thread(target=watch, daemon=True)
    if watcher:
        watcher.start()
    sched = [(0.0, 0, f"req {i} " + " ".join(f"w{i}_{j}" for j in range(args.prompt_words)))
             for i in range(args.requests)]  # fmt: skip
    results, wall = play([server.url], sched, args.new_tokens)
    out = summarize(results, wall)
    out["max_decoding"] = max_concurrent(results)
    if watcher:
        stop.set()
        watcher.join()
        after = _weights(server)
        copy = after["copy_seconds"] - before["copy_seconds"]
        stall = after["stall_seconds"] - before["stall_seconds"]
        out.update(lent_layers_peak=peak[0], copy_s=copy, stall_s=stall,
                   hidden_fraction=None if copy <= 0 else max(0.0, 1 - stall / copy))  # fmt: skip
        deadline = time.monotonic() + 60  # relief: wait for the layers to come back before the next run
        while _weights(server)["lent_layers"] and time.monotonic() < deadline:
            time.sleep(0.5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-tokens", type=int, default=512, help="stock's KV pool beside the full weights")
    ap.add_argument("--chunk", type=int, default=64, help="--chunked-prefill-size of every setup")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--setups", default="stock,offload,memx", help="comma list of stock, offload, memx")
    args = ap.parse_args()
    command = "python benchmark/e2e/weights.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    model, weights, kv_token_bytes, activation = model_and_sizes(args.chunk)
    memory = weights + args.kv_tokens * kv_token_bytes
    servers = make_servers(model, weights, memory, activation, args)
    rounds = serve_rounds(servers, args.rounds, lambda s: run_once(s, args))
    doc = {
        "command": command, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "memory_bytes": memory, "weights_bytes": weights, "kv_bytes_stock": args.kv_tokens * kv_token_bytes,
        "activation_bytes": activation, "params": vars(args), "rounds": rounds,
        "ratios": {f"{k} {s}/stock": ratio_stats(rounds, k, s, "stock") for s in servers if s != "stock"
                   for k in KEYS},
        "memx": {k: [r["memx"][k] for r in rounds] for k in ("lent_layers_peak", "hidden_fraction", "stall_s")},
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weights.json").write_text(json.dumps(doc, indent=1))
    keys = [k for k in doc["ratios"] if k.endswith("memx/stock")]
    plot_doc = dict(doc, ratios={k.split(" ")[0]: doc["ratios"][k] for k in keys})
    plot_ratios(plot_doc, KEYS, RESULTS / "weights.png", f"tiny 8-layer Llama, {memory} B for weights + KV, "
                f"{args.requests} prompts at once, {args.rounds} rounds", "memx/stock")  # fmt: skip
    print(json.dumps({k: {m: v for m, v in s.items() if m != "values"} for k, s in doc["ratios"].items()}, indent=1))
    print(json.dumps(doc["memx"]))
    print(f"wrote {RESULTS}/weights.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
