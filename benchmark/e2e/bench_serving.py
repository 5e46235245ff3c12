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

``--same-window``: this machine's speed drifts by ~10 % within minutes, so runs of servers
started one after another compare the drift too. In this mode every setup is started once,
each on its own port with ``--sleep-on-idle`` (an idle server takes no CPU), and all stay up
while the rounds alternate between them. ``--single``: memx setups are one server
(``scripts/serve.sh --single``) instead of the main job. ``--variant NAME=FLAGS`` adds a memx
setup with other memx flags (repeatable); each is compared with stock like ``memx``.
``--serve-args FLAGS``: launch_server flags given to every setup, stock included (e.g.
``--decode-log-interval 1``, a decode line per step in every engine log). With that flag each run
also records, from what the engines' logs gained during it (``benchmark.step_log``), the decode
step time by batch size and the prefill forwards (``steps``), and ``step_ratios_by_setup`` holds
the per-round ratios of the median step time at equal batch size, setup / stock, per bin.

Claims (``claims`` in the JSON, and per setup in ``claims_by_setup``): every request served by
memx in every run; memx's request throughput >= stock's and its TTFT p99 (p90) <= stock's in
every pair.

    benchmark/e2e/bench_serving.py [--rounds 5] [--num-prompts 100] [--memx-features FLAGS]
                                   [--same-window] [--single] [--variant NAME=FLAGS ...]
                                   [--serve-args FLAGS]
                                   [--out benchmark/results/e2e/bench_serving.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "test")]

from benchmark.e2e.router_proc import http_json  # noqa: E402
from benchmark.pairs import plot_ratios, ratio_stats, run_rounds, value_stats  # noqa: E402
from benchmark.provenance import code_version  # noqa: E402
from benchmark.quiet_point import engines  # noqa: E402
from benchmark.step_log import BINS, MIN_STEPS, bin_key, read_from, summarize  # noqa: E402
from sglang_memx.serve.engine_specs import OMP_WAIT_ENV  # noqa: E402

NAME = "SmolLM2-135M-Instruct"
STOCK = "stock"
KEYS = ("request_throughput", "output_throughput", "median_ttft_ms", "tail_ttft_ms", "median_tpot_ms")


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


class ServeScript:
    """``scripts/serve.sh`` in its own session, stopped with its whole group."""

    def __init__(self, args: list[str], port: int, log: Path, memx_features: str | None = None):
        """``args``: serve.sh's (``--memx-disable`` for stock); ``memx_features``: its MEMX_FEATURES
        (None: serve.sh's own default). ``log``: serve.sh's own output; the engines' logs go beside
        it, ``logs-<log's stem>/``."""
        env = {**os.environ, "MEMX_PORT": str(port), "MEMX_LOG_DIR": str(log.parent / f"logs-{log.stem}")}
        env.pop("MEMX_FEATURES", None)
        if memx_features is not None:
            env["MEMX_FEATURES"] = memx_features
        self.url = f"http://127.0.0.1:{port}"
        self.log_dir = log.parent / f"logs-{log.stem}"
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

    def log_sizes(self) -> dict[Path, int]:
        """Every log this setup's engines write (serve.sh's own output, where a single server's
        goes, and the main job's engine logs), with its size now."""
        paths = [Path(self._log.name), *sorted(self.log_dir.glob("**/*.log"))]
        return {p: p.stat().st_size for p in paths if p.is_file()}

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


def engine_states(url: str, single: bool = False) -> dict:
    """After a memx run, before its stop: each engine's host buffer counters (parked, fetched,
    recomputed ...), its compute share (cores, changes, the lending trial), heap trims and, with
    the governor, its admission verdicts, from its ``/memx/status`` through the router's
    ``/memx/serve`` (``single``: the one server at ``url``, key ``single``). For diagnosis; nothing
    is scored."""
    try:
        listed = {"single": {"url": url}} if single else engines(url)
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
        if governor is not None:  # its verdicts and decisions by reason, the largest batch, the SLO and cap in force
            keep = ("admission_verdicts", "max_running_seen", "decisions", "tpot_slo_ms", "slo_origin", "default_slo",
                    "batch_cap", "batch_cap_reason")  # fmt: skip
            out[key]["governor"] = {k: governor[k] for k in keep if k in governor}
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
        # inter-token latency: a parked request's wait for device room is one long gap (not scored)
        "median_itl_ms": doc.get("median_itl_ms", float("nan")),
        "tail_itl_ms": doc.get(tail.replace("ttft", "itl"), float("nan")),
    }


def claims(rounds: list[dict], ratios: dict, num_prompts: int, setup: str = "memx") -> dict:
    """The issue's user check for ``setup`` against stock (``ratios``: ``setup`` / stock per key)."""
    served = all(r[setup]["completed"] == num_prompts for r in rounds)
    thr = ratios["request_throughput"]["values"]
    ttft = ratios["tail_ttft_ms"]["values"]
    return {
        "memx_served_every_request": served,
        "stock_served_every_request": all(r[STOCK]["completed"] == num_prompts for r in rounds),
        "throughput_at_least_stock_every_pair": bool(thr) and all(v >= 1.0 for v in thr),
        "tail_ttft_at_most_stock_every_pair": bool(ttft) and all(v <= 1.0 for v in ttft),
    }


def logs_every_step(serve_args: str) -> bool:
    """Whether ``--serve-args`` makes upstream log every decode step (``--decode-log-interval 1``)."""
    words = shlex.split(serve_args)
    return "--decode-log-interval=1" in words or any(
        a == "--decode-log-interval" and b == "1" for a, b in zip(words, words[1:])
    )


def step_ratios(rounds: list[dict], setup: str, min_steps: int = MIN_STEPS) -> dict:
    """Per batch-size bin: the per-round ratios of the median decode step time, ``setup`` / stock,
    over the rounds where both timed at least ``min_steps`` steps in that bin (``benchmark.step_log``);
    median [min, max] and the rounds counted."""
    out = {}
    for lo, hi in BINS:
        key = bin_key(lo, hi)
        values = []
        for r in rounds:
            a, b = (r[s]["steps"]["by_batch"].get(key) for s in (setup, STOCK))
            if a and b and min(a["steps"], b["steps"]) >= min_steps:
                values.append(a["step_ms_p50"] / b["step_ms_p50"])
        if values:
            out[key] = value_stats(values)
    return out


def parse_setups(args) -> dict[str, tuple[list[str], str | None]]:
    """Setup name -> (serve.sh's arguments, its MEMX_FEATURES or None for serve.sh's default)."""
    memx_args = ["--single"] if args.single else []
    common = ["--sleep-on-idle"] if args.same_window else []
    common += shlex.split(args.serve_args)  # every setup's, stock included
    setups = {STOCK: (["--memx-disable", *common], None), "memx": ([*memx_args, *common], args.memx_features)}
    for spec in args.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in setups:
            raise SystemExit(f"--variant: want NAME=FLAGS with a new lower-case NAME, got {spec!r}")
        setups[name] = ([*memx_args, *common], flags)
    return setups


def _args(argv: list[str] | None = None):
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
    ap.add_argument("--same-window", action="store_true", help="every setup up at once, the rounds alternating")
    ap.add_argument("--single", action="store_true", help="memx setups: scripts/serve.sh --single (one server)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", help="another memx setup")
    ap.add_argument("--serve-args", default="", metavar="FLAGS", help="launch_server flags for every setup")
    ap.add_argument("--out", default=str(ROOT / "benchmark/results/e2e/bench_serving.json"))
    return ap.parse_args(argv)


def main() -> int:
    args = _args()
    code = code_version()  # before the runs: the code every server started from (unless edited meanwhile)
    setups = parse_setups(args)
    step_logs = logs_every_step(args.serve_args)
    out = Path(args.out)
    work = out.parent / f"{out.stem}_runs"
    work.mkdir(parents=True, exist_ok=True)
    py = subprocess.run([str(ROOT / "scripts/env.sh")], capture_output=True, text=True, check=True).stdout.strip()
    tokenizer = subprocess.run([py, "-m", "sglang_memx.cli", "models", "prepare"], capture_output=True, text=True,
                               check=True).stdout.strip()  # fmt: skip
    startups: dict[str, list[float]] = {s: [] for s in setups}
    live: dict[str, ServeScript] = {}

    def start(setup: str, port: int, tag: str) -> ServeScript:
        serve_args, features = setups[setup]
        server = ServeScript(serve_args, port, work / f"serve-{setup}-{tag}.log", features)
        try:
            startups[setup].append(server.wait_ready())
        except BaseException:
            server.stop()
            raise
        return server

    def run(setup: str, r: int) -> dict:
        server = live[setup] if args.same_window else start(setup, args.port, str(r))
        try:
            before = server.log_sizes()
            result = bench(server.url, tokenizer, args, seed=r + 1, out=work / f"{setup}-{r}.jsonl")
            if step_logs:
                result["steps"] = summarize([read_from(p, before.get(p, 0)) for p in server.log_sizes()])
            if setup != STOCK:  # counters since the server's start (in --same-window: every round so far)
                result["engines"] = engine_states(server.url, single=args.single)
            return result
        finally:
            if not args.same_window:
                server.stop()

    try:
        if args.same_window:
            for i, setup in enumerate(setups):
                live[setup] = start(setup, args.port + 10 * i, "live")
        rounds = run_rounds(args.rounds, list(setups), run)
    finally:
        for server in live.values():
            server.stop()
    others = [s for s in setups if s != STOCK]
    by_setup = {s: {k: ratio_stats(rounds, k, s, STOCK) for k in KEYS} for s in others}
    doc = {
        "benchmark": "bench_serving",
        "command": "python -m sglang.bench_serving --backend sglang-oai --dataset-name random-ids "
        f"--random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --num-prompts {args.num_prompts} "
        f"--request-rate {args.request_rate} --seed <round>",
        "driver": " ".join(["benchmark/e2e/bench_serving.py", *sys.argv[1:]]),
        "mode": "same_window" if args.same_window else "fresh_starts",
        "memx_serve": "single" if args.single else "main_job",
        "tail": "p99" if args.num_prompts >= 100 else "p90",
        "memx_features": args.memx_features if args.memx_features is not None else _serve_default_features(),
        "setups": {s: {"serve_args": a, "memx_features": f} for s, (a, f) in setups.items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        # the OpenMP wait settings every setup inherited (the launcher leaves them alone when set)
        "environment": {k: os.environ[k] for k in OMP_WAIT_ENV if k in os.environ},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code": code,
        "rounds": rounds,
        "startup_s": startups,
        "ratios": by_setup["memx"],
        "ratios_by_setup": by_setup,
        "claims": claims(rounds, by_setup["memx"], args.num_prompts),
        "claims_by_setup": {s: claims(rounds, by_setup[s], args.num_prompts, s) for s in others},
    }
    if step_logs:
        doc["step_ratios_by_setup"] = {s: step_ratios(rounds, s) for s in others}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot_ratios(doc, KEYS, out.with_suffix(".png"), "bench_serving vs scripts/serve.sh: memx / stock",
                "memx/stock")  # fmt: skip
    print(json.dumps({"ratios": {s: {k: v["median"] for k, v in r.items()} for s, r in by_setup.items()},
                      "claims": doc["claims_by_setup"]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
