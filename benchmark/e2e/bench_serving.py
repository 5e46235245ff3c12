"""Upstream's own load client against ``scripts/serve.sh``, memx against stock, in interleaved pairs.

Issue 26's user check: a new user runs ``python -m sglang.bench_serving`` (random token ids,
256 in / 64 out, range ratio 0.5, Poisson arrivals at 4 requests/s) against

* ``stock``: ``scripts/serve.sh --memx-disable`` (one upstream server, the plugin idle), and
* ``memx``: ``scripts/serve.sh`` (the main job: the router and two co-located engines on one
  CPU device sharing one memx pool; only the bf16 model gets requests, its sibling is idle),

each started fresh for every run, exactly as the README says, on the same port. ``rounds``
rounds, the order alternating (``benchmark.pairs.run_rounds``); per pair the ratios memx /
stock of request throughput, output throughput, TTFT p50 / p99 and TPOT p50. A p99 is
reported only with at least 100 requests per run (``--num-prompts``), else p90.

Claims (``claims`` in the JSON): every request served by memx in every run; memx's request
throughput >= stock's and its TTFT p99 (p90) <= stock's in every pair.

    benchmark/e2e/bench_serving.py [--rounds 5] [--num-prompts 100] [--memx-features FLAGS]
                                   [--out benchmark/results/e2e/bench_serving.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "test")]

from benchmark.e2e.router_proc import http_json  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats, run_rounds  # noqa: E402
from benchmark.quiet_point import engines  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
SETUPS = ("stock", "memx")
KEYS = ("request_throughput", "output_throughput", "median_ttft_ms", "tail_ttft_ms", "median_tpot_ms")


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


class ServeScript:
    """``scripts/serve.sh`` in its own session, stopped with its whole group."""

    def __init__(self, setup: str, port: int, log: Path, memx_features: str | None = None):
        """``log``: serve.sh's own output; the engines' logs go beside it, ``logs-<log's stem>/``."""
        args = ["--memx-disable"] if setup == "stock" else []
        env = {**os.environ, "MEMX_PORT": str(port), "MEMX_LOG_DIR": str(log.parent / f"logs-{log.stem}")}
        env.pop("MEMX_FEATURES", None)  # serve.sh's own default unless --memx-features says otherwise
        if memx_features is not None and setup == "memx":
            env["MEMX_FEATURES"] = memx_features
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen([str(ROOT / "scripts" / "serve.sh"), *args], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.sh exited with {self.proc.returncode}; see {self._log.name}")
            if _get(self.url + "/health", 30.0) == 200 and _get(self.url + "/v1/models") == 200:
                return time.monotonic() - t0
            time.sleep(1.0)
        raise RuntimeError(f"serve.sh not ready after {timeout_s:.0f} s; see {self._log.name}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


def engine_states(url: str) -> dict:
    """After a memx run, before its stop: each engine's host buffer counters (parked, fetched,
    recomputed ...), its compute share (cores, changes, the lending trial), heap trims and, with
    the governor, its admission verdicts, from its ``/memx/status`` through the router's
    ``/memx/serve``. For diagnosis; nothing is scored."""
    try:
        listed = engines(url)
    except (OSError, ValueError, KeyError) as exc:
        return {"error": repr(exc)[:200]}
    out: dict = {}
    for key, e in listed.items():
        try:
            sched = http_json(e["url"] + "/memx/status", timeout=10)["schedulers"][0]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            out[key] = {"error": repr(exc)[:200]}
            continue
        elastic = sched.get("elastic_kv") or {}
        governor = elastic.get("governor")
        out[key] = {"host_buffer": elastic.get("host_buffer"), "compute_share": sched.get("compute_share"),
                    "heap_trim": sched.get("heap_trim"), "requests": sched.get("requests")}  # fmt: skip
        if governor is not None:  # its admission verdicts by reason and the largest batch it saw
            out[key]["governor"] = {k: governor.get(k) for k in ("admission_verdicts", "max_running_seen")}
    return out


def _serve_default_features() -> str:
    """The memx flags ``scripts/serve.sh`` passes by default (its ``MEMX_FEATURES`` line)."""
    text = (ROOT / "scripts" / "serve.sh").read_text()
    found = re.search(r'^MEMX_FEATURES="\$\{MEMX_FEATURES-"([^"]*)"\}"$', text, re.M)
    if found is None:
        raise RuntimeError("scripts/serve.sh: no MEMX_FEATURES default line")
    return found.group(1)


def bench(url: str, tokenizer: str, args, seed: int, out: Path) -> dict:
    port = url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--host", "127.0.0.1",
           "--port", port, "--model", NAME, "--tokenizer", tokenizer, "--dataset-name", "random-ids",
           "--random-input-len", "256", "--random-output-len", "64", "--random-range-ratio", "0.5",
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
           "--seed", str(seed), "--output-file", str(out), "--disable-tqdm"]  # fmt: skip
    out.unlink(missing_ok=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=3600,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})  # fmt: skip
    doc = json.loads(out.read_text().strip().splitlines()[-1])
    tail = "p99_ttft_ms" if args.num_prompts >= 100 else "p90_ttft_ms"
    return {
        "completed": doc["completed"],
        "request_throughput": doc["request_throughput"],
        "output_throughput": doc["output_throughput"],
        "median_ttft_ms": doc["median_ttft_ms"],
        "tail_ttft_ms": doc.get(tail, float("nan")),
        "median_tpot_ms": doc["median_tpot_ms"],
    }


def claims(rounds: list[dict], ratios: dict, num_prompts: int) -> dict:
    served = all(r["memx"]["completed"] == num_prompts for r in rounds)
    thr = ratios["request_throughput"]["values"]
    ttft = ratios["tail_ttft_ms"]["values"]
    return {
        "memx_served_every_request": served,
        "stock_served_every_request": all(r["stock"]["completed"] == num_prompts for r in rounds),
        "throughput_at_least_stock_every_pair": bool(thr) and all(v >= 1.0 for v in thr),
        "tail_ttft_at_most_stock_every_pair": bool(ttft) and all(v <= 1.0 for v in ttft),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument(
        "--memx-features",
        default=None,
        help="the memx flags of the main job (serve.sh's MEMX_FEATURES); default: serve.sh's own",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmark/results/e2e/bench_serving.json"))
    args = ap.parse_args()
    out = Path(args.out)
    work = out.parent / "bench_serving_runs"
    work.mkdir(parents=True, exist_ok=True)
    py = subprocess.run([str(ROOT / "scripts/env.sh")], capture_output=True, text=True, check=True).stdout.strip()
    tokenizer = subprocess.run([py, "-m", "sglang_memx.cli", "models", "prepare"], capture_output=True, text=True,
                               check=True).stdout.strip()  # fmt: skip
    startups: dict[str, list[float]] = {s: [] for s in SETUPS}

    def run(setup: str, r: int) -> dict:
        server = ServeScript(setup, args.port, work / f"serve-{setup}-{r}.log", args.memx_features)
        try:
            startups[setup].append(server.wait_ready())
            result = bench(server.url, tokenizer, args, seed=r + 1, out=work / f"{setup}-{r}.jsonl")
            if setup == "memx":
                result["engines"] = engine_states(server.url)
            return result
        finally:
            server.stop()

    rounds = run_rounds(args.rounds, SETUPS, run)
    ratios = {k: ratio_stats(rounds, k, "memx", "stock") for k in KEYS}
    doc = {
        "benchmark": "bench_serving",
        "command": "python -m sglang.bench_serving --backend sglang-oai --dataset-name random-ids "
        f"--random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --num-prompts {args.num_prompts} "
        f"--request-rate {args.request_rate} --seed <round>",
        "tail": "p99" if args.num_prompts >= 100 else "p90",
        "memx_features": args.memx_features if args.memx_features is not None else _serve_default_features(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": rounds,
        "startup_s": startups,
        "ratios": ratios,
        "claims": claims(rounds, ratios, args.num_prompts),
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot_ratios(doc, KEYS, out.with_suffix(".png"), "bench_serving vs scripts/serve.sh: memx / stock",
                "memx/stock")  # fmt: skip
    print(json.dumps({"ratios": {k: v["median"] for k, v in ratios.items()}, "claims": doc["claims"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
