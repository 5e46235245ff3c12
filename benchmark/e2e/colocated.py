"""Three co-located servers, bursty out-of-phase traffic: static KV split (stock) vs one shared
budget (memx), measured in repeated interleaved rounds.

Same machine, same memory, same request schedule. Setups (all servers start once and stay up;
before each run every server's prefix cache is flushed):

* ``stock``: stock SGLang, each server gets a third of the KV budget (``--max-total-tokens``),
  its activations outside it;
* ``memx``: three servers in one pool (``--memx-elastic-kv --memx-pool``) whose budget is the
  whole KV amount plus three prefill batches' activations (KV and activations share it), each
  with the whole amount as logical capacity;
* ``stock_ample`` (reference, not a competitor): stock with the whole KV budget *per server*,
  i.e. 3x the memory. If stock_ample is much faster than stock, stock's queue waits for KV,
  not for CPU: the workload is memory-bound.
* ``memx_buffer`` (optional, ``--setups``): memx with the features ``scripts/serve.sh`` turns
  on, i.e. also the CPU elastic buffer (``--memx-host-buffer-gb 1``): requests refused for want
  of KV reservation prefill anyway and wait on the host for their decode.

Traffic comes in phases: in phase k server k gets a burst of concurrent requests while the
others see a trickle, so at any time one server needs far more than a third of the memory.
Each server runs single-threaded (``OMP_NUM_THREADS=1``) with ``--sleep-on-idle``, so three
servers and the load generator share the 2 cores without oversubscription or busy polling.

Per run: TTFT p50/p99 (all requests and the bursts alone), TPOT p50, throughput, failures,
retractions, and each server's running batch / waiting queue / token usage over time (from
its scheduler log). Reported: every ratio memx/stock (and stock_ample/stock) per round, its
median and range; TPOT at equal running batch (decode step time per running-request count).
JSON + PNGs under benchmark/results/e2e/colocated*.

``--families F0,F1,F2``: the model family of each server, ``llama`` (the default) or
``sliding_window`` (the tiny Gemma2 of ``docs/models.md``: sliding-window layers beside full
attention, the same hidden size, heads and KV row as the tiny Llama, so every setup's memory is
counted the same way). Mixed families co-locate different architectures on one shared pool;
MLA cannot run here (upstream does not serve it on CPU, ``docs/models.md``).

The pool's activation allowance is measured, per family, before the rounds
(``measure_activations``): one memx server of the family, alone in an ample pool, serves one
burst and its most activation chunks held (``/memx/status``) is that family's allowance; the
pool's budget is the KV amount plus each server's allowance, so stock's KV bytes and memx's are
the same whatever the family (stock's activations are outside its split, as upstream sizes them).
Until 2026-12-06 the allowance was the tiny Llama's estimate for every family, and a memx Gemma2
server held ~1.5x that: with Gemma2, memx had fewer KV bytes than stock.

    python benchmark/e2e/colocated.py [--rounds 5] [--phases 3] [--phase-s 20] [--burst 16]
                                      [--families llama,sliding_window,llama]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark._stats import percentile  # noqa: E402
from benchmark.e2e.load import play, server_timeline, summarize  # noqa: E402
from benchmark.matrix_score import tail_key  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats, run_rounds, wins  # noqa: E402
from support.server import SGLangServer, start_all  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
CHUNK_KB = 4
TOKEN_ROW_BYTES = 64  # tiny Llama and tiny Gemma2: 2 KV heads x 16 dims x bf16, per layer and K/V
LAYERS = 2
FAMILIES = ("llama", "sliding_window")
CHUNKED_PREFILL = 64  # every setup; bounds one prefill batch's activation
SETUPS = ("stock", "memx", "stock_ample", "memx_buffer")
DEFAULT_SETUPS = ("stock", "memx", "stock_ample")
KEYS = (
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "burst_ttft_p90_s",
    "burst_ttft_p99_s",
    "tpot_p50_s",
    "throughput_tok_s",
)
SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
COMMON = ["--chunked-prefill-size", str(CHUNKED_PREFILL), "--sleep-on-idle", "--decode-log-interval", "4"]


def schedule(args) -> list[tuple[float, int, str]]:
    """Phase k: server k gets ``burst`` requests at the phase start, the others one every ``trickle_s``."""
    out = []
    for phase in range(args.phases):
        busy, start = phase % 3, phase * args.phase_s
        for b in range(args.burst):
            out.append(
                (start, busy, f"phase {phase} burst {b} " + " ".join(f"w{b}_{j}" for j in range(args.prompt_words)))
            )
        for k in range(int(args.phase_s // args.trickle_s)):
            for i in range(3):
                if i != busy:
                    words = " ".join(f"v{k}_{j}" for j in range(args.prompt_words))
                    out.append((start + k * args.trickle_s, i, f"phase {phase} trickle {k} {words}"))
    return out


def activation_bytes() -> int:
    """One CHUNKED_PREFILL-token prefill's activation of the tiny Llama in bf16 (memx's profile):
    the calibration pool's allowance per server, and the floor of a measured one."""
    from memory_ext.policy.activation import ActivationProfile

    p = ActivationProfile.from_model_dims(hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, head_dim=16,
                                          vocab=512, itemsize=2)  # fmt: skip
    return p.bytes_for(CHUNKED_PREFILL, 1)


def kv_bytes(budget_tokens: int) -> int:
    """The KV of ``budget_tokens`` tokens, in whole 64-token groups over every layer's K and V."""
    return (budget_tokens // 64) * 64 * TOKEN_ROW_BYTES * 2 * LAYERS


def memx_args(pool: str, budget_bytes: int, pool_dir: Path) -> list[str]:
    return COMMON + [
        "--memx-elastic-kv", "--memx-pool", pool, "--memx-pool-budget-gb", f"{budget_bytes / (1 << 30):.12f}",
        "--memx-pool-dir", str(pool_dir), "--memx-chunk-kb", str(CHUNK_KB),
    ]  # fmt: skip


def measure_activations(models: list[Path], families: list[str], args, pool_dir: Path) -> dict[str, dict]:
    """Per family: the most activation bytes a memx server of it held while serving one burst of
    ``args.burst`` requests alone, in a pool with room for eight allowances (so nothing it asked
    for was refused); ``allowance_bytes`` is that, at least the Llama estimate."""
    out = {}
    for family in dict.fromkeys(families):
        model = models[families.index(family)]
        pool = f"calib{os.getpid()}{family}"
        server = SGLangServer(model, name=f"bench-colo-calib-{family}", env=SERVER_ENV,
                              max_total_tokens=args.budget_tokens,
                              extra_args=memx_args(pool, kv_bytes(args.budget_tokens) + 8 * activation_bytes(),
                                                   pool_dir))  # fmt: skip
        start_all([server])
        try:
            server.generate("warm up", max_new_tokens=4, temperature=0)
            burst = [(0.0, 0, text) for offset, i, text in schedule(args) if offset == 0 and i == 0]
            results, _ = play([server.url], burst, args.new_tokens)
            el = server.request("/memx/status")["schedulers"][0]["elastic_kv"]
            peak = el["activation"]["peak_held"] * el["chunk_bytes"]
        finally:
            server.stop()
            stop_pool(pool, pool_dir)
        failed = sum("error" in r for r in results)
        if failed:
            raise RuntimeError(f"activation calibration of {family}: {failed} of {len(results)} requests failed")
        out[family] = {
            "measured_peak_bytes": peak,
            "estimate_bytes": activation_bytes(),
            "allowance_bytes": max(peak, activation_bytes()),
            "requests": len(results),
        }
        print(f"# activation allowance of {family}: {out[family]}", flush=True)
    return out


def stop_pool(pool: str, pool_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "sglang_memx.cli", "pool", "stop", pool, "--pool-dir", str(pool_dir)],
                   check=False, capture_output=True)  # fmt: skip


def family_models(families: list[str], root: Path) -> list[Path]:
    """One checkpoint per server: the tiny Llama or the tiny Gemma2 of the same dimensions (seed 5)."""
    from sglang_memx.models.tiny import TinyModelSpec, tiny_model
    from sglang_memx.models.tiny_families import TinyFamilySpec, tiny_family_model

    made = {
        "llama": lambda: tiny_model(TinyModelSpec(arch="llama", num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                                                  head_dim=16, seed=5), root),
        "sliding_window": lambda: tiny_family_model(TinyFamilySpec(family="sliding_window", num_layers=LAYERS,
                                                                   hidden_size=64, seed=5), root),
    }  # fmt: skip
    return [made[f]() for f in families]


def parse_families(text: str) -> list[str]:
    """``--families``: three names from ``FAMILIES``; raises ValueError naming the flag."""
    families = [f.strip() for f in text.split(",")]
    if len(families) != 3 or any(f not in FAMILIES for f in families):
        raise ValueError(f"--families: three of {', '.join(FAMILIES)}, comma-separated; got {text!r}")
    return families


def make_servers(models: list[Path], args, pool_dir: Path, allowances: list[int]) -> dict[str, list[SGLangServer]]:
    """Every setup's three servers; memx's pool holds the KV amount plus ``allowances`` (one
    activation allowance per server, bytes)."""
    budget = kv_bytes(args.budget_tokens) + sum(allowances)
    memx = memx_args(f"bench{os.getpid()}", budget, pool_dir)
    buffered = memx_args(f"benchbuf{os.getpid()}", budget, pool_dir) + ["--memx-host-buffer-gb", "1"]
    return {
        "stock": [SGLangServer(models[i], name=f"bench-colo-stock{i}", stock=True, env=SERVER_ENV,
                               max_total_tokens=args.budget_tokens // 3, extra_args=COMMON) for i in range(3)],
        "memx": [SGLangServer(models[i], name=f"bench-colo-memx{i}", env=SERVER_ENV,
                              max_total_tokens=args.budget_tokens, extra_args=memx) for i in range(3)],
        "stock_ample": [SGLangServer(models[i], name=f"bench-colo-ample{i}", stock=True, env=SERVER_ENV,
                                     max_total_tokens=args.budget_tokens, extra_args=COMMON) for i in range(3)],
        "memx_buffer": [SGLangServer(models[i], name=f"bench-colo-memxbuf{i}", env=SERVER_ENV,
                                     max_total_tokens=args.budget_tokens, extra_args=buffered)
                        for i in range(3)],
    }  # fmt: skip


def tpot_by_batch(timelines: list[list[dict]]) -> dict[int, float]:
    """Median decode step time per running-request count (s), from the servers' log lines."""
    steps: dict[int, list[float]] = {}
    for tl in timelines:
        for p in tl:
            if p["running"] > 0 and p["throughput"] > 0:
                steps.setdefault(p["running"], []).append(p["running"] / p["throughput"])
    return {k: statistics.median(v) for k, v in sorted(steps.items())}


def run_once(servers: list[SGLangServer], sched, args) -> dict:
    for s in servers:
        s.flush_cache()  # every run starts with an empty prefix cache
    marks = [len(s.log_path.read_text(errors="replace")) for s in servers]
    t0_wall = time.time()
    results, wall = play([s.url for s in servers], sched, args.new_tokens)
    out = summarize(results, wall)
    bursts = [r["ttft"] for r in results if "error" not in r and " burst " in r["text"]]
    out["burst_ttft_p99_s"] = percentile(bursts, 0.99) if bursts else float("nan")
    ttft = [r["ttft"] for r in results if "error" not in r]
    out["ttft_p90_s"] = percentile(ttft, 0.90) if ttft else float("nan")  # p99 needs 100 a run: 78 by default
    out["burst_ttft_p90_s"] = percentile(bursts, 0.90) if bursts else float("nan")
    out["timelines"] = [server_timeline(s.log_path.read_text(errors="replace")[m:], t0_wall)
                        for s, m in zip(servers, marks)]  # fmt: skip
    out["max_running"] = max((p["running"] for tl in out["timelines"] for p in tl), default=0)
    out["tpot_by_batch_s"] = tpot_by_batch(out["timelines"])
    if not servers[0].stock:  # map calls on the request path vs premapped, per server, this run
        out["elastic_kv"] = [elastic_counters(s) for s in servers]
        steps = sum(e["decode_steps"] for e in out["elastic_kv"])
        out["decode_map_calls_per_step"] = sum(e["decode_map_calls"] for e in out["elastic_kv"]) / max(1, steps)
    return out


_COUNTERS = ("decode_steps", "decode_steps_with_map", "decode_map_calls")


def elastic_counters(server: SGLangServer) -> dict:
    """A memx server's map counters since its previous call (they are cumulative in /memx/status)."""
    el = server.request("/memx/status")["schedulers"][0]["elastic_kv"]
    now = {**{k: el[k] for k in _COUNTERS}, **{f"map_calls_{p}": n for p, n in el["map_calls"].items()}}
    before = vars(server).setdefault("_counters_seen", dict.fromkeys(now, 0))
    delta = {k: now[k] - before.get(k, 0) for k in now}
    server._counters_seen = now
    return delta


def _with_idle_gaps(timeline: list[dict], gap_s: float = 1.5):
    """The log has lines only while a server decodes: a gap longer than ``gap_s`` is idle (0, 0)."""
    t, running, queue = [], [], []
    for p in timeline:
        if t and p["t"] - t[-1] > gap_s:
            t.append(t[-1] + 1.0)
            running.append(0)
            queue.append(0)
        t.append(p["t"])
        running.append(p["running"])
        queue.append(p["queue"])
    return t, running, queue


def plot_timelines(doc: dict, path: Path) -> None:
    """Running batch and waiting queue of each server over time, one run per setup (the first round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = [s for s in SETUPS if s in doc["rounds"][0]]
    fig, axes = plt.subplots(len(setups), 1, figsize=(10, 2.4 * len(setups)), sharex=True)
    for ax, name in zip(axes, setups):
        for i, tl in enumerate(doc["rounds"][0][name]["timelines"]):
            t, running, queue = _with_idle_gaps(tl)
            ax.plot(t, running, drawstyle="steps-post", label=f"server {i} running")
            ax.plot(t, queue, drawstyle="steps-post", ls=":", label=f"server {i} waiting")
        ax.set_ylabel(name)
        ax.legend(fontsize=6, ncol=3)
    axes[-1].set_xlabel("seconds into the run (round 1)")
    fig.suptitle("running requests (solid) and waiting queue (dotted) per server", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phases", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--trickle-s", type=float, default=4.0)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--budget-tokens", type=int, default=1536, help="total KV tokens of the three servers")
    ap.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help="comma-separated subset of " + ",".join(SETUPS))
    ap.add_argument("--families", default="llama,llama,llama", help="each server's model family: three of "
                    + ", ".join(FAMILIES))  # fmt: skip
    ap.add_argument("--out", default="colocated", help="results name under benchmark/results/e2e/")
    args = ap.parse_args()
    try:
        families = parse_families(args.families)
    except ValueError as exc:
        ap.error(str(exc))
    command = "python benchmark/e2e/colocated.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    models = family_models(families, Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models")
    pool_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-bench-pools-{os.getpid()}"
    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or "stock" not in setups:
        ap.error(f"--setups: need stock and some of {', '.join(SETUPS)}; unknown: {', '.join(unknown) or '-'}")
    activation = measure_activations(models, families, args, pool_dir) if set(setups) - {"stock", "stock_ample"} else {}
    allowances = [activation[f]["allowance_bytes"] if activation else 0 for f in families]
    servers = {k: v for k, v in make_servers(models, args, pool_dir, allowances).items() if k in setups}
    sched = schedule(args)
    start_all([s for group in servers.values() for s in group])
    try:
        for group in servers.values():
            for s in group:
                s.generate("warm up", max_new_tokens=4, temperature=0)
        rounds = run_rounds(args.rounds, setups, lambda name, r: run_once(servers[name], sched, args))
    finally:
        for group in servers.values():
            for s in group:
                s.stop()
        for pool in (f"bench{os.getpid()}", f"benchbuf{os.getpid()}"):
            stop_pool(pool, pool_dir)
    doc = {"command": command, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "params": vars(args), "families": families, "server_env": SERVER_ENV, "common_flags": COMMON,
           "activation_allowance": {"per_family": activation, "per_server_bytes": allowances,
                                    "kv_bytes": kv_bytes(args.budget_tokens)},
           "rounds": rounds}  # fmt: skip
    doc["ratios"] = {k: ratio_stats(rounds, k, "memx", "stock") for k in KEYS} if "memx" in setups else {}
    if "memx_buffer" in setups:
        doc["buffer_over_stock"] = {k: ratio_stats(rounds, k, "memx_buffer", "stock") for k in KEYS}
    if "stock_ample" in setups:
        doc["ample_over_stock"] = {k: ratio_stats(rounds, k, "stock_ample", "stock") for k in KEYS}
        if "memx" in setups:  # memx against stock with the memory it would need: equal running batches
            doc["memx_over_ample"] = {k: ratio_stats(rounds, k, "memx", "stock_ample") for k in KEYS}
    doc["claims"] = {}
    tail, _ = tail_key(min(r["stock"]["requests"] for r in rounds))  # the highest percentile a run's count means
    for label, ratios in (("memx", doc["ratios"]), ("memx_buffer", doc.get("buffer_over_stock"))):
        if ratios:
            doc["claims"][f"{label}: ttft_{tail} <= 0.5x stock at the median, < 1x in every pair"] = wins(
                ratios[f"ttft_{tail}_s"], 0.5, 1.0
            )
            doc["claims"][f"{label}: tpot_p50 <= 1.1x stock at the median, < 1.1x in every pair"] = wins(
                ratios["tpot_p50_s"], 1.1, 1.1)  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
    main_ratio = "memx" if "memx" in setups else "memx_buffer"
    shown = doc["ratios"] if "memx" in setups else doc["buffer_over_stock"]
    plot_ratios({"ratios": shown}, KEYS, RESULTS / f"{args.out}.png",
                f"3 co-located tiny servers ({', '.join(families)}), {args.budget_tokens} KV tokens in total, "
                f"{args.rounds} rounds",
                f"{main_ratio}/stock")  # fmt: skip
    plot_timelines(doc, RESULTS / f"{args.out}_timeline.png")
    summary = {name: {k: {m: v for m, v in st.items() if m != "values"} for k, st in block.items()}
               for name, block in doc.items() if name in ("ratios", "buffer_over_stock", "memx_over_ample",
                                                           "ample_over_stock")}  # fmt: skip
    print(json.dumps({**summary, "claims": doc["claims"]}, indent=1))
    print(f"wrote {RESULTS / args.out}.json, .png, _timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
