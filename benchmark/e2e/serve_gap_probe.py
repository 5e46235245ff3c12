"""A diagnostic, not a benchmark: where ``scripts/serve.sh``'s throughput gap against stock comes from.

The same upstream ``bench_serving`` load as ``bench_serving.py`` (100 prompts at 4/s), on setups
started fresh in turn, the order reversed every other round, memx with elastic KV only:

* ``stock``: ``scripts/serve.sh --memx-disable``;
* ``single``: ``scripts/serve.sh --single`` (the memx plugin in one upstream server, no router);
* ``router1``: ``sglang-memx serve`` with the bf16 model alone (router + one engine);
* ``router2``: ``scripts/serve.sh`` (router + the two co-located engines);
* ``router2direct``: as ``router2``, the load sent to the bf16 engine's own port (past the router).

Prints one line per run (bench_serving's JSON numbers); nothing is scored, no claim rests on it.

    python benchmark/e2e/serve_gap_probe.py ROUNDS [SETUP ...]
"""

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "test")]
from benchmark.e2e.bench_serving import ServeScript, bench  # noqa: E402
from benchmark.quiet_point import engines  # noqa: E402


def python() -> str:
    return subprocess.run([str(ROOT / "scripts/env.sh")], capture_output=True, text=True, check=True).stdout.strip()


def tokenizer() -> str:
    cmd = [python(), "-m", "sglang_memx.cli", "models", "prepare"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


PORT = 30500
WORK = ROOT / "benchmark/results/e2e/bench_serving_runs/serve_gap_probe"  # git-ignored


def one_engine_config() -> str:
    PY = python()
    out = WORK / "one.yaml"
    subprocess.run(
        [
            PY,
            "-m",
            "sglang_memx.cli",
            "models",
            "serve-config",
            "--host",
            "127.0.0.1",
            "--port",
            str(PORT),
            "--max-total-tokens",
            "16384",
            "--memory-gb",
            "2",
            "--memx-args=--memx-elastic-kv",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    text = out.read_text()
    head, rest = text.split("- name: SmolLM2-135M-Instruct-fp32", 1)
    out.write_text(head + "devices:" + rest.split("devices:", 1)[1])
    return str(out)


class ProbeServer(ServeScript):
    """One setup started in its own session (``ServeScript``'s readiness wait and group stop)."""

    def __init__(self, setup: str, log: Path):
        env = {**os.environ, "MEMX_PORT": str(PORT), "MEMX_FEATURES": "--memx-elastic-kv",
               "MEMX_LOG_DIR": str(WORK / f"logs-{setup}")}  # fmt: skip
        if setup == "stock":
            cmd = [str(ROOT / "scripts/serve.sh"), "--memx-disable"]
        elif setup == "single":
            cmd = [str(ROOT / "scripts/serve.sh"), "--single"]
        elif setup in ("router2", "router2direct"):
            cmd = [str(ROOT / "scripts/serve.sh")]
        else:
            cmd = [python(), "-m", "sglang_memx.cli", "serve", "--config", one_engine_config()]
        self.url = f"http://127.0.0.1:{PORT}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip


def run(setup: str, r: int) -> None:
    server = ProbeServer(setup, WORK / f"{setup}-{r}.log")
    try:
        server.wait_ready()
        time.sleep(5)
        target = server.url
        if setup.endswith("direct"):  # the engine's own port, past the router
            target = next(e["url"] for k, e in engines(server.url).items() if not k.endswith("fp32"))
        args = types.SimpleNamespace(num_prompts=100, request_rate=4.0)
        res = bench(target, tokenizer(), args, seed=r + 1, out=WORK / f"{setup}-{r}.jsonl")
        print(setup, r, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
    finally:
        server.stop()
        time.sleep(3)


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    setups = sys.argv[2:] or ["stock", "single", "router1", "router2"]
    for r in range(int(sys.argv[1])):
        for s in setups if r % 2 == 0 else setups[::-1]:
            run(s, r)


if __name__ == "__main__":
    main()
