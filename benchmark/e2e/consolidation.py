"""Consolidation: three models with bursty, out-of-phase traffic in the memory stock SGLang
needs for one and a half of them. Stock static split vs memx (``sglang-memx serve``: router,
one shared pool, sleep / wake), measured in repeated interleaved rounds (issue 17, goal P5).

Same machine, same models, same request schedule, same SLOs.

* Memory. A model's *need* is its weights plus the KV of one whole burst
  (``burst x (prompt + new tokens)``, prompts tokenized with the model's tokenizer). The
  budget ``M`` is 1.5x the mean need: what stock needs for one and a half models.
* ``stock``: three stock SGLang servers; server i gets the share ``M x need_i / sum(need)``
  of it (half its need): its weights, and ``--max-total-tokens`` for the rest. Its
  activations are outside the share.
* ``memx``: ``sglang-memx serve`` with the three models on one CPU device of ``M`` plus the
  three models' prefill activations (stock keeps those outside its shares; in memx the pool
  holds them). Placement, pool budget, core split and engine flags are the router's own;
  every model has ``sleep_after_s``, so an idle model's weights and KV go back to the pool
  and its next request wakes it. Requests go through the router
  (``/models/<name>/generate``: EDF admission, ``max_inflight`` per engine).
* SLOs (FineServe's way): each model's TTFT / TPOT SLO is ``--slo-scale`` x its uncontended
  TTFT / TPOT, measured once on its stock server before the rounds (median of 5 solo
  requests); the same SLOs bind both setups and are the router's ``ttft_slo_ms``.
* Traffic: in phase k model k gets ``--burst`` concurrent requests at the phase start and one
  more every ``--steady-s`` for the rest of the phase; the other models get nothing, so each
  model is idle for two phases out of three.

Per run: SLO attainment (a request attains when it answered, TTFT <= its model's TTFT SLO
and TPOT <= its TPOT SLO; a refusal or an error misses), goodput (output tokens/s of the
attaining requests), TTFT / TPOT p50 / p99, failures, and for memx each wake (model, seconds,
whether all layers came back) read from the router's ``/memx/serve`` while the run goes.
Every ratio memx/stock is computed per round; reported as median and range; a claim holds
only when no pair contradicts it. JSON + PNG under ``benchmark/results/e2e/consolidation*``.

    python benchmark/e2e/consolidation.py [--rounds 5] [--burst 12] [--phase-s 20] [--slo-scale 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark._stats import percentile  # noqa: E402
from benchmark.e2e.load import play, stream_one  # noqa: E402
from benchmark.e2e.router_proc import Serve, http_json  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats, run_rounds, wins  # noqa: E402
from support.server import LOG_DIR, SGLangServer, free_port  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
GIB = 1 << 30
CHUNKED_PREFILL = 64  # every engine of both setups
COMMON = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNKED_PREFILL)]
KEYS = ("slo_attainment", "goodput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def model_specs():
    """Three tiny Llamas with different KV cells (float32: 512, 1536 and 2048 B per token), narrow
    (hidden 32) so that, as with real LLMs under load, a burst's KV outweighs the weights."""
    from sglang_memx.models.tiny import TinyModelSpec

    common = {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "head_dim": 16}
    return {
        "tiny-a": TinyModelSpec(num_layers=2, num_kv_heads=2, seed=11, **common),
        "tiny-b": TinyModelSpec(num_layers=3, num_kv_heads=4, seed=12, **common),
        "tiny-c": TinyModelSpec(num_layers=4, num_kv_heads=4, seed=13, **common),
    }


def prompt(phase: int, i: int, words: int) -> str:
    return f"phase {phase} request {i} " + " ".join(f"w{i}_{j}" for j in range(words))


def schedule(args, names: list[str]) -> list[tuple[float, str, str]]:
    """``(offset s, model, prompt)``: phase k's model gets a burst at the phase start, then one
    request every ``steady_s``; the other models get nothing during phase k."""
    out = []
    for phase in range(args.phases):
        name, start = names[phase % len(names)], phase * args.phase_s
        out += [(start, name, prompt(phase, b, args.prompt_words)) for b in range(args.burst)]
        k = 1
        while k * args.steady_s < args.phase_s:
            out.append((start + k * args.steady_s, name, prompt(phase, args.burst + k, args.prompt_words)))
            k += 1
    return out


def prompt_tokens(model_path: Path, texts: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    return max(len(tok(t)["input_ids"]) for t in texts)


def activation_bytes(spec) -> int:
    """One CHUNKED_PREFILL-token prefill's activation in float32 (memx's own profile)."""
    from memory_ext.policy.activation import ActivationProfile

    p = ActivationProfile.from_model_dims(hidden=spec.hidden_size, intermediate=spec.intermediate_size,
                                          num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                          head_dim=spec.head_dim, vocab=spec.vocab_size, itemsize=4)  # fmt: skip
    return p.bytes_for(CHUNKED_PREFILL, 1)


def memory_plan(args, models: dict[str, Path], specs, sched) -> dict:
    """Needs, the 1.5-model budget, stock's shares and the memx device size (module docstring)."""
    from sglang_memx.serve.placement import read_model_size

    plan = {"models": {}}
    for name, path in models.items():
        size = read_model_size(path, "float32")
        ptoks = prompt_tokens(path, [t for _, n, t in sched if n == name])
        need_tokens = args.burst * (ptoks + args.new_tokens)
        plan["models"][name] = {
            "weight_bytes": size.weight_bytes,
            "kv_bytes_per_token": size.kv_bytes_per_token,
            "prompt_tokens_max": ptoks,
            "need_tokens": need_tokens,
            "need_bytes": size.weight_bytes + need_tokens * size.kv_bytes_per_token,
            "activation_bytes": activation_bytes(specs[name]),
        }
    needs = [m["need_bytes"] for m in plan["models"].values()]
    plan["budget_bytes"] = int(args.budget_models * statistics.mean(needs))
    for m in plan["models"].values():
        share = plan["budget_bytes"] * m["need_bytes"] // sum(needs)
        m["stock_share_bytes"] = share
        m["stock_max_total_tokens"] = (share - m["weight_bytes"]) // m["kv_bytes_per_token"]
        if m["stock_max_total_tokens"] < args.new_tokens + m["prompt_tokens_max"]:
            raise SystemExit(f"--budget-models {args.budget_models}: a stock share holds no whole request: "
                             f"{json.dumps(plan)}")  # fmt: skip
    plan["memx_device_bytes"] = plan["budget_bytes"] + sum(m["activation_bytes"] for m in plan["models"].values())
    return plan


def serve_config(args, models, plan, slos, port: int, tmp: Path) -> Path:
    doc = {
        "models": [
            {"name": name, "path": str(path), "dtype": "float32", "ttft_slo_ms": slos[name]["ttft_s"] * 1000,
             "tpot_slo_ms": slos[name]["tpot_s"] * 1000, "max_total_tokens": plan["models"][name]["need_tokens"],
             "kv_reserve_tokens": CHUNKED_PREFILL, "sleep_after_s": args.sleep_after_s,
             "max_inflight": args.burst, "max_queued": 4 * args.burst,
             "server_args": ["--chunked-prefill-size", str(CHUNKED_PREFILL)]}
            for name, path in models.items()
        ],
        "devices": [{"name": "cpu0", "kind": "cpu", "memory_gb": plan["memx_device_bytes"] / GIB}],
        "router": {"port": port, "max_queued": 16 * args.burst},
        "launch": {"log_dir": str(LOG_DIR / "bench-consolidation-serve"), "pool_dir": str(tmp / "pools")},
    }  # fmt: skip
    path = tmp / "consolidation.yaml"
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def measure_slos(stock: dict[str, SGLangServer], args) -> dict:
    """Each model's uncontended TTFT / TPOT on its stock server (median of 5 solo requests) x scale."""
    out = {}
    for name, s in stock.items():
        runs = [stream_one(s.url, prompt(99, i, args.prompt_words), args.new_tokens) for i in range(5)]
        bad = [r for r in runs if "error" in r]
        if bad:
            raise RuntimeError(f"{name}: solo request failed: {bad[0]['error']}")
        ttft, tpot = statistics.median(r["ttft"] for r in runs), statistics.median(r["tpot"] for r in runs)
        out[name] = {"solo_ttft_s": ttft, "solo_tpot_s": tpot, "ttft_s": args.slo_scale * ttft,
                     "tpot_s": args.slo_scale * tpot}  # fmt: skip
    return out


class WakeWatcher:
    """Polls the router's ``/memx/serve`` and records every wake (a model's ``sleep.wakes`` rising)."""

    def __init__(self, url: str, period_s: float = 0.25):
        self.url, self.period_s = url, period_s
        self.wakes: list[dict] = []
        self.sleeps = 0
        self._seen: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._poll(record=False)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self, record: bool = True) -> None:
        try:
            models = http_json(self.url + "/memx/serve", timeout=5)["models"]
        except (OSError, ValueError, KeyError):
            return
        for name, info in models.items():
            sleep = info.get("sleep") or {}
            now = (int(sleep.get("wakes", 0)), int(sleep.get("sleeps", 0)))
            before = self._seen.get(name, now)
            if record and now[0] > before[0]:
                self.wakes.append({"model": name, "wake_s": sleep.get("last_wake_s"),
                                   "full": sleep.get("last_wake_full"), "missed": now[0] - before[0] - 1})  # fmt: skip
            if record:
                self.sleeps += max(0, now[1] - before[1])
            self._seen[name] = now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._poll()
        times = [w["wake_s"] for w in self.wakes if isinstance(w.get("wake_s"), (int, float))]
        return {"wakes": self.wakes, "sleeps": self.sleeps,
                "wake_p50_s": statistics.median(times) if times else float("nan"),
                "wake_max_s": max(times) if times else float("nan")}  # fmt: skip


SCALES = (2, 5, 10, 20, 50)  # SLO scales of the attainment curve (FineServe Fig. 10 sweeps it too)


def attains(r: dict, slo: dict, scale_over: float = 1.0) -> bool:
    """Answered, TTFT and TPOT within the model's SLOs (stretched by ``scale_over``)."""
    return "error" not in r and r["ttft"] <= slo["ttft_s"] * scale_over and r["tpot"] <= slo["tpot_s"] * scale_over


def summarize(results: list[dict], wall: float, slos: dict, slo_scale: float) -> dict:
    ok = [r for r in results if "error" not in r]
    attained = [r for r in ok if attains(r, slos[r["model"]])]
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok]
    nan = float("nan")
    out = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "slo_attainment": len(attained) / len(results) if results else nan,
        "ttft_attainment": sum(r["ttft"] <= slos[r["model"]]["ttft_s"] for r in ok) / max(1, len(results)),
        "goodput_tok_s": sum(r["tokens"] for r in attained) / wall,
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": percentile(ttft, 0.5) if ttft else nan,
        "ttft_p99_s": percentile(ttft, 0.99) if ttft else nan,
        "tpot_p50_s": percentile(tpot, 0.5) if tpot else nan,
        "tpot_p99_s": percentile(tpot, 0.99) if tpot else nan,
        "wall_s": wall,
        "errors": sorted({r["error"][:160] for r in results if "error" in r})[:5],
        # the same requests against SLOs of other scales (solo latency x scale); the router's own
        # deadlines stay those of --slo-scale
        "attainment_by_scale": {str(k): sum(attains(r, slos[r["model"]], k / slo_scale) for r in results)
                                / max(1, len(results)) for k in SCALES},
        "results": [{k: r.get(k) for k in ("model", "offset", "ttft", "tpot", "tokens", "error")} for r in results],
    }  # fmt: skip
    out["per_model"] = {}
    for name in slos:
        mine = [r for r in results if r["model"] == name]
        if mine:
            good = [r for r in attained if r["model"] == name]
            out["per_model"][name] = {"requests": len(mine), "attainment": len(good) / len(mine),
                                      "ttft_p99_s": percentile([r["ttft"] for r in mine if "error" not in r] or [nan],
                                                               0.99)}  # fmt: skip
    return out


def run_once(setup: str, urls: dict[str, str], sched, args, slos, router_url: str) -> dict:
    for url in urls.values():
        try:
            urllib.request.urlopen(url + "/flush_cache", timeout=60).read()  # an empty prefix cache per run
        except OSError:
            pass
    watcher = WakeWatcher(router_url) if setup == "memx" else None
    results, wall = play(urls, sched, args.new_tokens)  # keyed by model name: "server" is the model
    for r in results:
        r["model"] = r.pop("server")
    out = summarize(results, wall, slos, args.slo_scale)
    if watcher is not None:
        out["wake"] = watcher.stop()
    time.sleep(args.cooldown_s)  # idle models fall asleep again, as between bursts in production
    return out


def plot(doc: dict, path: Path) -> None:
    """The memx/stock ratios (one panel per key) and, beside, SLO attainment against the SLO scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_ratios({"ratios": doc["ratios"]}, KEYS, path,
                f"3 models, bursty out-of-phase, memory for {doc['params']['budget_models']} of them; "
                f"{doc['params']['rounds']} rounds", "memx/stock")  # fmt: skip
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for setup, color in (("stock", "#c44"), ("memx", "#2a7")):
        curve = doc["attainment_by_scale"][setup]
        xs = [int(k) for k in curve]
        ax.plot(xs, [curve[k]["median"] for k in curve], marker="o", color=color, label=setup)
        ax.fill_between(xs, [curve[k]["min"] for k in curve], [curve[k]["max"] for k in curve], color=color, alpha=0.2)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("SLO scale (x uncontended TTFT / TPOT)")
    ax.set_ylabel("SLO attainment (median, range)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "_attainment.png"), dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phases", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--burst", type=int, default=12)
    ap.add_argument("--steady-s", type=float, default=2.0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--budget-models", type=float, default=1.5, help="memory: this many models' needs (mean)")
    ap.add_argument("--slo-scale", type=float, default=10.0, help="SLO = this x the uncontended TTFT / TPOT")
    ap.add_argument("--sleep-after-s", type=float, default=5.0, help="memx: an idle model sleeps after this")
    ap.add_argument("--cooldown-s", type=float, default=8.0, help="idle seconds after every run")
    ap.add_argument("--dry-run", action="store_true", help="print the memory plan and exit")
    ap.add_argument("--out", default="consolidation", help="results name under benchmark/results/e2e/")
    args = ap.parse_args()
    for field in ("rounds", "phases", "burst"):
        if getattr(args, field) < 1:
            ap.error(f"--{field}: must be >= 1")
    command = "python benchmark/e2e/consolidation.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    from sglang_memx.models.tiny import tiny_model

    root = Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models"
    specs = model_specs()
    models = {name: tiny_model(spec, root) for name, spec in specs.items()}
    names = list(models)
    sched = schedule(args, names)
    plan = memory_plan(args, models, specs, sched)
    print(json.dumps(plan, indent=1), flush=True)
    if args.dry_run:
        return 0
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-bench-consolidation-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    stock = {}
    for i, name in enumerate(names):  # the cores as serve splits them among its three engines
        stock[name] = SGLangServer(models[name], name=f"bench-consolidation-stock-{name}", stock=True,
                                   max_total_tokens=plan["models"][name]["stock_max_total_tokens"],
                                   extra_args=COMMON,
                                   env={"SGLANG_CPU_OMP_THREADS_BIND": str(i % 2), "OMP_NUM_THREADS": "1"})  # fmt: skip
    serve = None
    try:
        for s in stock.values():
            s.start()
        for s in stock.values():
            s.wait_ready(900)
        slos = measure_slos(stock, args)
        print(f"SLOs: {json.dumps(slos)}", flush=True)
        port = free_port()
        serve = Serve(serve_config(args, models, plan, slos, port, tmp), port, "bench-consolidation-serve")
        serve.wait_ready()
        placement = http_json(serve.url + "/memx/serve")
        urls = {
            "stock": {n: s.url for n, s in stock.items()},
            "memx": {n: f"{serve.url}/models/{n}" for n in names},
        }
        for setup in urls.values():  # warm up every engine once
            for url in setup.values():
                stream_one(url, "warm up", 4)
        rounds = run_rounds(args.rounds, ["stock", "memx"],
                            lambda setup, r: run_once(setup, urls[setup], sched, args, slos, serve.url))  # fmt: skip
    finally:
        if serve is not None:
            serve.stop()
        for s in stock.values():
            s.stop()
    doc = {"command": command, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "params": vars(args), "memory": plan, "slos": slos,
           "placement": {k: placement.get(k) for k in ("placement", "engines") if k in placement},
           "rounds": rounds}  # fmt: skip
    doc["ratios"] = {k: ratio_stats(rounds, k, "memx", "stock") for k in KEYS}
    doc["attainment_by_scale"] = {}
    for setup in ("stock", "memx"):
        doc["attainment_by_scale"][setup] = {}
        for k in map(str, SCALES):
            values = [r[setup]["attainment_by_scale"][k] for r in rounds]
            doc["attainment_by_scale"][setup][k] = {"values": values, "median": statistics.median(values),
                                                    "min": min(values), "max": max(values)}  # fmt: skip
    attain = doc["ratios"]["slo_attainment"]
    doc["claims"] = {
        "P5: memx SLO attainment >= stock's in every pair": bool(attain["values"])
        and all(v >= 1.0 for v in attain["values"]),
        "memx ttft_p99 <= 0.5x stock at the median, < 1x in every pair": wins(doc["ratios"]["ttft_p99_s"], 0.5, 1.0),
    }
    wakes = [w["wake_s"] for r in rounds for w in r["memx"].get("wake", {}).get("wakes", [])
             if isinstance(w.get("wake_s"), (int, float))]  # fmt: skip
    doc["wake_s"] = {"count": len(wakes), "p50": statistics.median(wakes) if wakes else None,
                     "max": max(wakes) if wakes else None}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, RESULTS / f"{args.out}.png")
    summary = {k: {m: v for m, v in st.items() if m != "values"} for k, st in doc["ratios"].items()}
    absolute = {s: {k: statistics.median(r[s][k] for r in rounds) for k in KEYS} for s in ("stock", "memx")}
    curve = {s: {k: v["median"] for k, v in c.items()} for s, c in doc["attainment_by_scale"].items()}
    print(json.dumps({"ratios": summary, "medians": absolute, "attainment_by_scale": curve, "wake_s": doc["wake_s"],
                      "claims": doc["claims"]}, indent=1))  # fmt: skip
    print(f"wrote {RESULTS / args.out}.json, .png, _attainment.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
