"""Plugin overhead at low load: memx with its features on vs stock SGLang, same model, same machine.

Both servers start once and stay up (``--sleep-on-idle``: the idle one takes no CPU); the memx
server runs with the features ``scripts/serve.sh`` turns on (elastic KV + host buffer). In each
of ``--rounds`` rounds (order rotating) every server is measured on:

* TPOT of one greedy stream (``--decode-tokens`` new tokens, ``ignore_eos``),
* output throughput of ``--concurrency`` concurrent greedy streams,
* latency of a short greedy request (16 new tokens), median over ``--requests``,
* (memx) the ``/memx/status`` round trip.

Reports memx/stock per round, median and range. Goal (kvcached reports about 2 %): TPOT and
throughput within 2 % of stock at the median. JSON + PNG under benchmark/results/e2e/.

    python benchmark/e2e/plugin_overhead.py [--model embedded|tiny] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.e2e.load import play, summarize  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats, run_rounds  # noqa: E402
from support.server import SGLangServer, start_all  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
FEATURES = ["--memx-elastic-kv", "--memx-host-buffer-gb", "1"]  # scripts/serve.sh's defaults
KEYS = ("tpot_s", "throughput_tok_s", "latency_s")


def _model(kind: str):
    if kind == "embedded":
        from sglang_memx.models.embedded import prepare_embedded_model

        return prepare_embedded_model()
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    return tiny_model(TinyModelSpec(), Path(tempfile.mkdtemp()))


def measure(server: SGLangServer, args) -> dict:
    server.flush_cache()
    one, _ = play([server.url], [(0.0, 0, "Tell a long story about the sea:")], args.decode_tokens)
    streams = [(0.0, 0, f"Stream {i}: write about memory and caches.") for i in range(args.concurrency)]
    many, wall = play([server.url], streams, args.decode_tokens)
    lat = []
    for i in range(args.requests):
        t = time.perf_counter()
        server.generate(f"Request {i}: the capital of France is", max_new_tokens=16, temperature=0, ignore_eos=True)
        lat.append(time.perf_counter() - t)
    out = {"tpot_s": one[0]["tpot"], "throughput_tok_s": summarize(many, wall)["throughput_tok_s"],
           "latency_s": statistics.median(lat)}  # fmt: skip
    if not server.stock:
        ts = []
        for _ in range(args.requests):
            t = time.perf_counter()
            server.request("/memx/status")
            ts.append(time.perf_counter() - t)
        out["status_roundtrip_ms"] = 1000 * statistics.median(ts)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    command = "python benchmark/e2e/plugin_overhead.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    model = _model(args.model)
    common = ["--sleep-on-idle"]
    servers = {
        "stock": SGLangServer(model, name=f"bench-{args.model}-stock", stock=True, max_total_tokens=16384,
                              extra_args=common),
        "memx": SGLangServer(model, name=f"bench-{args.model}-memx", max_total_tokens=16384,
                             extra_args=common + FEATURES),
    }  # fmt: skip
    start_all(list(servers.values()))
    try:
        for s in servers.values():
            s.generate("warm up", max_new_tokens=4, temperature=0)
        rounds = run_rounds(args.rounds, list(servers), lambda name, r: measure(servers[name], args))
        startup = {name: s.startup_s for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    doc = {"command": command, "where": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "model": args.model, "memx_flags": FEATURES, "params": vars(args), "startup_s": startup,
           "rounds": rounds, "ratios": {k: ratio_stats(rounds, k, "memx", "stock") for k in KEYS}}  # fmt: skip
    doc["status_roundtrip_ms"] = statistics.median(r["memx"]["status_roundtrip_ms"] for r in rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"plugin_overhead_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    title = f"plugin overhead, features on ({args.model} model, CPU), {args.rounds} rounds"
    plot_ratios(doc, KEYS, stem.with_suffix(".png"), title, "memx/stock")
    print(json.dumps({k: {m: v for m, v in s.items() if m != "values"} for k, s in doc["ratios"].items()}, indent=1))
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
