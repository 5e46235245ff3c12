"""Plugin overhead: memx vs stock SGLang on the same model, same machine, same run.

Starts one stock server (plugin filtered out with SGLANG_PLUGINS) and one memx
server, one after the other so they never share cores, and measures:
  * time from process start to a healthy /health,
  * greedy /generate latency (prompt + N new tokens), median over R requests,
  * decode throughput of one long request,
  * the /memx/status round trip (memx only).
Reports memx/stock ratios. Writes JSON + PNG under benchmark/results/e2e/.

    python benchmark/e2e/plugin_overhead.py [--model embedded|tiny] [--requests 10]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))

from support.server import SGLangServer  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"


def _model(kind: str, root: Path):
    if kind == "embedded":
        from sglang_memx.models.embedded import prepare_embedded_model

        return prepare_embedded_model()
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model

    return tiny_model(TinyModelSpec(), root)


def measure(server: SGLangServer, requests: int, new_tokens: int) -> dict:
    server.start().wait_ready()
    try:
        server.generate("warm up", max_new_tokens=4, temperature=0)
        lat = []
        for i in range(requests):
            t = time.perf_counter()
            server.generate(
                f"Request {i}: the capital of France is", max_new_tokens=new_tokens, temperature=0, ignore_eos=True
            )
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = server.generate("Tell a long story:", max_new_tokens=8 * new_tokens, temperature=0, ignore_eos=True)
        decode_tps = out["meta_info"]["completion_tokens"] / (time.perf_counter() - t)
        status_ms = None
        if not server.stock:
            ts = []
            for _ in range(requests):
                t = time.perf_counter()
                server.request("/memx/status")
                ts.append(time.perf_counter() - t)
            status_ms = 1000 * statistics.median(ts)
        return {
            "startup_s": server.startup_s,
            "latency_median_s": statistics.median(lat),
            "latency_all_s": lat,
            "decode_tokens_per_s": decode_tps,
            "status_roundtrip_ms": status_ms,
        }
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    command = "python benchmark/e2e/plugin_overhead.py " + " ".join(sys.argv[1:])
    print(f"command: {command}")

    import tempfile

    model = _model(args.model, Path(tempfile.mkdtemp()))
    stock = measure(SGLangServer(model, name=f"bench-{args.model}-stock", stock=True), args.requests, args.new_tokens)
    memx = measure(SGLangServer(model, name=f"bench-{args.model}-memx"), args.requests, args.new_tokens)
    ratios = {k: memx[k] / stock[k] for k in ("startup_s", "latency_median_s", "decode_tokens_per_s")}
    result = {
        "command": command,
        "where": f"CPU: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores (no GPU)",
        "model": args.model,
        "stock": stock,
        "memx": memx,
        "memx_over_stock": ratios,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"plugin_overhead_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(ratios)
    ax.bar(names, [ratios[n] for n in names], color=["#4c72b0", "#55a868", "#c44e52"])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("memx / stock")
    ax.set_title(f"Plugin overhead ({args.model} model, CPU)")
    for i, n in enumerate(names):
        ax.text(i, ratios[n], f"{ratios[n]:.3f}", ha="center", va="bottom")
    fig.text(0.01, 0.01, command, fontsize=6)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(
        json.dumps(
            {
                "memx_over_stock": ratios,
                "status_roundtrip_ms": memx["status_roundtrip_ms"],
                "startup_s": {"stock": stock["startup_s"], "memx": memx["startup_s"]},
            },
            indent=2,
        )
    )
    print(f"wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
