"""Which memx feature works on which model family on CPU here (issue 28, items 2 and 5).

For the families stock upstream serves on CPU (``benchmark/results/families/probe.json``):

* ``sliding_window`` (Gemma2, one full-length MHATokenToKVPool): a stock and a memx server with elastic
  KV under a tight budget, the host buffer and remappable weights (half the layers streamed) on at once;
  the workload of ``test/integration/test_families.py`` (a batch, prefix hits, chunked prefill,
  retraction under pressure, prefill offload), greedy outputs compared with stock's, memx's counters
  recorded. Then the peer tier: the stock server's answers to six 160-token conversations, and a donor
  and a small borrower on one shared pool answering them (spills to and hits from the donor).
* ``mla`` (DeepSeek-V2, which upstream does not run on CPU): elastic KV and the host buffer are launched to
  show memx building its pool before upstream's own warm-up failure (their test is at the pool level,
  ``test/unit/test_mla_elastic_pool.py``); the other features must be refused at launch.
* every other family: one launch per feature (or one for all, when memx refuses the family whatever the
  feature), with the memx refusal quoted from the server's log.

Servers niced by the caller, at most two at a time, each stopped when done.

    nice -n 19 python -m benchmark.families_memx [KEY ...]

Writes ``benchmark/results/families/memx.json`` (merged by key); ``python -m benchmark.families_table``
renders it into ``docs/models.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark.families_probe import HYBRID, LLAMA, _sglang_version, build  # noqa: E402
from benchmark.families_probe import Probe as Family  # noqa: E402
from sglang_memx.models.tiny_families import TinyFamilySpec  # noqa: E402
from support.server import SGLangServer, start_all  # noqa: E402

RESULT = REPO / "benchmark" / "results" / "families" / "memx.json"
FEATURES = ("elastic_kv", "host_buffer", "weights", "peer_kv")
COMMON = ["--dtype", "float32", "--chunked-prefill-size", "16"]
GEMMA2 = TinyFamilySpec(family="sliding_window")
TP2_ENV = (("SGLANG_CPU_OMP_THREADS_BIND", "0|1"), ("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2"))
FAMILIES = {
    "llama": Family("llama", "Llama-like GQA (control)", LLAMA),
    "sliding_window": Family("sliding_window", "sliding window beside full attention (Gemma2)", GEMMA2),
    "swa_mellum": Family("swa_mellum", "sliding window, SWA pool (Mellum)", TinyFamilySpec(family="swa_mellum")),
    "tp2": Family("tp2", "tensor parallel 2 (tiny Llama)", LLAMA, ("--tp", "2"), TP2_ENV),
    "mla": Family("mla", "MLA (DeepSeek-V2)", TinyFamilySpec(family="mla")),
    "swa_gpt_oss": Family("swa_gpt_oss", "sliding window, SWA pool (GPT-OSS)", TinyFamilySpec(family="swa_gpt_oss")),
    "hybrid_linear": Family("hybrid_linear", "hybrid linear attention (Qwen3-Next)", HYBRID),
    "fp8_kv": Family("fp8_kv", "fp8 KV (tiny Llama)", LLAMA, ("--kv-cache-dtype", "fp8_e4m3")),
}
# Rows this script does not measure: the control, whose features the older integration modules test
# against stock, and fp8 KV, which upstream refuses on this CPU before memx could act
# (benchmark/results/families/probe.json)
_T = "test/integration/"
_LLAMA_TESTS = {"elastic_kv": _T + "test_elastic_kv.py", "host_buffer": _T + "test_elastic_kv.py",
                "weights": _T + "test_weights.py", "peer_kv": _T + "test_peer_kv.py"}  # fmt: skip
FP8_NOTE = (
    "memx refuses a quantized KV pool when the pool is built, on any device (`upstream/kv.py` "
    '`plain_mha_refusal`: "does not support a quantized KV cache")'
)
STATIC_CELLS = {
    "llama": {f: {"verdict": "works", "test": t} for f, t in _LLAMA_TESTS.items()},
    "fp8_kv": {"all": {"verdict": "upstream", "note": FP8_NOTE}},
}
# Tensor parallel 2: elastic KV, the host buffer and remappable weights are served (their tests compare
# them with stock under pressure); the peer tier is refused at launch, measured here
TP2_SERVED = {f: {"verdict": "works", "test": _T + "test_tensor_parallel.py"}
              for f in ("elastic_kv", "host_buffer", "weights")}  # fmt: skip
# Families memx refuses whatever the feature, and upstream does not serve on CPU either: one launch
REFUSED_ONCE = ("swa_gpt_oss", "hybrid_linear")
# MLA: elastic KV and the host buffer back upstream's MLA pool (tested at the pool level on CPU, since upstream's
# DeepSeek models stop in their warm-up here); in a server memx must build its pool before upstream's own failure
MLA_POOL_TEST = "test/unit/test_mla_elastic_pool.py"
MLA_POOL_LEVEL = ("elastic_kv", "host_buffer")
_BUILT = re.compile(r"memx: elastic KV on \w+: .*")


def feature_args(feature: str, pool_dir: str) -> list[str]:
    """The memx flags one feature needs (each needs elastic KV; the host buffer with its SLO pair)."""
    pool = ["--memx-pool", "famprobe", "--memx-pool-budget-gb", "0.02", "--memx-pool-dir", pool_dir]
    return ["--memx-elastic-kv"] + {
        "elastic_kv": [],
        "host_buffer": ["--memx-host-buffer-gb", "0.01", "--memx-ttft-slo-ms", "1000", "--memx-tpot-slo-ms", "1000"],
        "weights": ["--memx-pool-budget-gb", "0.05", "--memx-weights", "remap"],
        "peer_kv": pool + ["--memx-peer-kv", "borrow"],
    }[feature]


_REFUSAL = re.compile(r"error: (argument --memx-[\w-]+: .*)$")


def _launch_until_exit(family: Family, path: Path, feature: str, timeout: float, kind: str) -> tuple:
    """Launch a memx server of ``family`` with ``feature``'s flags and wait for it to exit (it must):
    (exit code or None, its log lines, seconds)."""
    with tempfile.TemporaryDirectory() as pool_dir:
        args = COMMON + list(family.extra_args) + feature_args(feature, pool_dir)
        server = SGLangServer(path, name=f"fam-{kind}-{family.key}-{feature}", extra_args=args, env=dict(family.env))
        t0 = time.monotonic()
        server.start()
        try:
            code = server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            server.stop()
    return code, server.log_path.read_text(errors="replace").splitlines(), round(time.monotonic() - t0, 1)


def launch_refusal(family: Family, path: Path, feature: str, timeout: float) -> dict:
    """Launch a memx server of ``family`` with ``feature``'s flags; it must exit with memx's refusal."""
    code, lines, wall = _launch_until_exit(family, path, feature, timeout, "refuse")
    message = next((m[1] for m in map(_REFUSAL.search, lines) if m), None)
    return {"verdict": "refused" if code == 2 and message else "unexpected", "exit_code": code,
            "message": message, "memx_args": feature_args(feature, "DIR"), "wall_s": wall,
            "stage": "launch (argument parsing, before any model is loaded)"}  # fmt: skip


def pool_level_launch(family: Family, path: Path, feature: str, timeout: float) -> dict:
    """Launch a memx server of ``family`` (which upstream does not run on CPU) with ``feature``'s flags: memx
    must build its elastic pool (its log line) and the server then stop in upstream's own failure, as stock's."""
    from benchmark.families_probe import refusal

    code, lines, wall = _launch_until_exit(family, path, feature, timeout, "pool")
    built = next((m[0] for m in map(_BUILT.search, lines) if m), None)
    failure = refusal(lines)
    ok = code not in (0, None) and built is not None and failure is not None
    return {"verdict": "pool_level" if ok else "unexpected", "exit_code": code, "built": built, "note": failure,
            "test": MLA_POOL_TEST, "memx_args": feature_args(feature, "DIR"), "wall_s": wall}  # fmt: skip


def mla_cells(family: Family, path: Path, timeout: float) -> dict:
    return {f: (pool_level_launch if f in MLA_POOL_LEVEL else launch_refusal)(family, path, f, timeout)
            for f in FEATURES}  # fmt: skip


# ------------------------------------------------------------------ Gemma2: the served features
SERVED_MEMX = ["--memx-elastic-kv", "--memx-chunk-kb", "4", "--memx-pool-budget-gb", "0.0006",
               "--schedule-conservativeness", "0.05", "--memx-host-buffer-gb", "0.01",
               "--memx-weights", "static", "--memx-weights-streamed", "0.5"]  # fmt: skip
PROMPTS = ["The capital of France is", "Pages map to chunks", "one two three four five", "Elastic memory for serving"]


def _gen(server, prompt, n=24, ignore_eos=True):
    """Greedy /generate of a text, a batch of texts, or token ids."""
    key = "input_ids" if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else "text"
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": ignore_eos}
    return server.request("/generate", {key: prompt, "sampling_params": params})


def _ids(out):
    return [r["output_ids"] for r in out] if isinstance(out, list) else out["output_ids"]


def _elastic(server) -> dict:
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]


def served_workload(stock, memx) -> dict:
    """The checks of test_families.py, recorded instead of asserted."""
    checks = {"batch": _ids(_gen(memx, PROMPTS)) == _ids(_gen(stock, PROMPTS))}
    prefix = " ".join(f"shared{i}" for i in range(40))
    want = [_ids(_gen(stock, prefix + t)) for t in (" alpha", " beta")]
    got = [_gen(memx, prefix + t) for t in (" alpha", " beta")]
    checks["prefix_hits"] = [_ids(g) for g in got] == want and got[1]["meta_info"]["cached_tokens"] > 0
    long_prompt = " ".join(f"w{i % 37}x{i}" for i in range(60))
    checks["chunked_prefill"] = _ids(_gen(memx, long_prompt, 16)) == _ids(_gen(stock, long_prompt, 16))
    texts = [f"request {i} " + " ".join(f"t{i}_{j}" for j in range(20)) for i in range(12)]
    want = _ids(_gen(stock, texts, 200, ignore_eos=False))
    got = _gen(memx, texts, 200, ignore_eos=False)
    checks["pressure"] = _ids(got) == want
    retractions = sum(r["meta_info"].get("num_retractions", 0) for r in got)
    texts = [f"offload {i} " + " ".join(f"o{i}_{j}" for j in range(20)) for i in range(8)]
    checks["offload"] = _ids(_gen(memx, texts, 100)) == _ids(_gen(stock, texts, 100))
    el = _elastic(memx)
    host, w = el["host_buffer"], el["weights"]
    return {"checks": checks, "retractions": retractions,
            "elastic_kv": {k: el[k] for k in ("groups_mapped_total", "groups_unmapped_total", "group_bytes",
                                               "pool_capacity_bytes")},
            "host_buffer": {k: host[k] for k in ("parked", "restored", "dropped", "prefill_offloads",
                                                 "used_bytes")},
            "weights": {k: w[k] for k in ("mode", "resident_layers", "streamed_layers", "fetches",
                                          "forwards")}}  # fmt: skip


def served_cells(result: dict) -> dict:
    equal = all(result["checks"].values())
    el, host, w = result["elastic_kv"], result["host_buffer"], result["weights"]
    test = "test/integration/test_families.py"
    return {
        "elastic_kv": {"verdict": "works" if equal and el["groups_unmapped_total"] > 0 and result["retractions"] > 0
                       else "differs", "test": test, "evidence": el | {"retractions": result["retractions"]}},
        "host_buffer": {"verdict": "works" if equal and host["restored"] > 0 and host["prefill_offloads"] > 0
                        else "differs", "test": test, "evidence": host},
        "weights": {"verdict": "works" if equal and w["streamed_layers"] > 0 and w["fetches"] > 0 else "differs",
                    "test": test, "evidence": w},
    }  # fmt: skip


# ------------------------------------------------------------------ Gemma2: the peer tier
def peer_conversations(vocab: int) -> tuple[list, list]:
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, vocab) for _ in range(160)] for _ in range(6)]
    return prefixes, [p + [rng.randrange(3, vocab) for _ in range(48)] for p in prefixes]


def peer_turns(server, turn) -> list:
    return [_ids(_gen(server, ids, 8)) for ids in turn]  # one at a time: the borrower holds three


def peer_cell(path: Path, want: list, turns: list, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as pool_dir:
        pool = ["--memx-elastic-kv", "--memx-pool", "famprobe", "--memx-pool-budget-gb", "0.02", "--memx-pool-dir",
                pool_dir]  # fmt: skip
        donor = SGLangServer(path, name="fam-peer-donor", max_total_tokens=2048, extra_args=COMMON + pool + [
            "--memx-peer-kv", "donate", "--memx-peer-donate-max-gb", "0.00048828125"])  # fmt: skip
        borrower = SGLangServer(path, name="fam-peer-borrower", max_total_tokens=512,
                                extra_args=COMMON + pool + ["--memx-peer-kv", "borrow"])  # fmt: skip
        try:
            start_all([donor, borrower])
            deadline = time.monotonic() + 60
            while _peer(borrower)["borrower"]["borrowed_bytes"] == 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            got = [peer_turns(borrower, t) for t in turns]
            st = _peer(borrower)
        finally:
            for s in (donor, borrower):
                s.stop()
            subprocess.run([sys.executable, "-m", "sglang_memx.cli", "pool", "stop", "famprobe", "--pool-dir",
                            pool_dir], check=False, capture_output=True)  # fmt: skip
    evidence = {"spills": st["spills"], "hits": st["hits"], "tokens_loaded": st["tokens_loaded"],
                "borrowed_bytes": st["borrower"]["borrowed_bytes"]}  # fmt: skip
    works = got == want and st["spills"] > 0 and st["hits"] > 0
    return {"verdict": "works" if works else "differs", "equal": got == want, "evidence": evidence,
            "test": "`families_memx.py` only: stock, donor and borrower are 3 servers"}  # fmt: skip


def _peer(server) -> dict:
    return server.request("/memx/status")["schedulers"][0]["peer_kv"]


REMAP_MEMX = ["--memx-elastic-kv", "--memx-chunk-kb", "4", "--memx-pool-budget-gb", "0.0006",
              "--memx-weights", "remap", "--memx-weights-idle-after-s", "600"]  # fmt: skip


def remap_under_pressure(stock, path: Path) -> dict:
    """``--memx-weights remap`` with a budget that holds both layers and ~250 tokens of KV (upstream's
    request limit): four requests of ~100 + 120 tokens, each within the limit, together well beyond
    it; answers must be stock's, every one at full length. Whether the controller released layers
    is recorded (on this tiny model upstream queued the requests and none was released)."""
    from concurrent.futures import ThreadPoolExecutor

    server = SGLangServer(path, name="fam-gemma2-remap", max_total_tokens=4096, extra_args=COMMON + REMAP_MEMX)
    prompts = [f"remap {i} " + " ".join(f"r{i}_{j}" for j in range(20)) for i in range(4)]
    n_new = 120
    try:
        start_all([server])
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(_gen, server, p, n_new) for p in prompts]
            lent, deadline = 0, time.monotonic() + 300
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                lent = max(lent, _elastic(server)["weights"]["lent_layers"])
                time.sleep(0.2)
            got = [_ids(f.result(timeout=600)) for f in futures]
        w = _elastic(server)["weights"]
    finally:
        server.stop()
    want = [_ids(_gen(stock, p, n_new)) for p in prompts]
    return {"equal": got == want, "full_length": all(len(g) == n_new for g in got), "max_lent_layers": lent,
            "remap_decisions": w["decisions"]["remap"], "restore_decisions": w["decisions"]["restore"]}  # fmt: skip


def run_served(family: Family, path: Path, model: dict, timeout: float) -> dict:
    stock = SGLangServer(path, name="fam-gemma2-stock", stock=True, max_total_tokens=4096, extra_args=COMMON)
    memx = SGLangServer(path, name="fam-gemma2-memx", max_total_tokens=4096, extra_args=COMMON + SERVED_MEMX)
    turns = peer_conversations(model["vocab_size"])
    try:
        start_all([stock, memx])
        result = served_workload(stock, memx)
        memx.stop()
        try:
            remap = remap_under_pressure(stock, path)
        except Exception as exc:  # noqa: BLE001 - recorded: the weights cell then says it differs
            remap = {"equal": False, "max_lent_layers": 0, "error": f"{type(exc).__name__}: {exc}"[:300]}
        want = [peer_turns(stock, t) for t in turns]
    finally:
        stock.stop()
        memx.stop()
    cells = served_cells(result)
    cells["weights"]["remap"] = remap
    if not (remap["equal"] and remap.get("full_length")):  # a release is recorded, not required (see docs)
        cells["weights"]["verdict"] = "differs"
    cells["weights"]["memx_args"] = cells["elastic_kv"]["memx_args"] = cells["host_buffer"]["memx_args"] = SERVED_MEMX
    cells["peer_kv"] = peer_cell(path, want, turns, timeout)
    return {"checks": result["checks"], "cells": cells}


def run_family(key: str, cache_root: Path, timeout: float) -> dict:
    family = FAMILIES[key]
    path, model = build(family, cache_root)
    row = {"key": key, "family": family.family, "model": model, "extra_args": list(family.extra_args),
           "env": dict(family.env), "time": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}  # fmt: skip
    if key in STATIC_CELLS:
        row["cells"] = STATIC_CELLS[key]
    elif key == "sliding_window":
        row.update(run_served(family, path, model, timeout))
    elif key == "mla":
        row["cells"] = mla_cells(family, path, timeout)
    elif key in REFUSED_ONCE:
        row["cells"] = {"all": launch_refusal(family, path, "elastic_kv", timeout)}
    else:
        served = TP2_SERVED if key == "tp2" else {}
        row["cells"] = {f: served.get(f) or launch_refusal(family, path, f, timeout) for f in FEATURES}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("keys", nargs="*", help=f"families (default: all of {list(FAMILIES)})")
    ap.add_argument("--cache-root", type=Path, default=Path("/tmp/memx-tiny-families"))
    ap.add_argument("--timeout", type=float, default=420.0)
    args = ap.parse_args(argv)
    unknown = set(args.keys) - set(FAMILIES)
    if unknown:
        ap.error(f"keys: unknown families {sorted(unknown)}")
    doc = json.loads(RESULT.read_text()) if RESULT.exists() else {"rows": []}
    rows = {r["key"]: r for r in doc["rows"] if r["key"] in FAMILIES}
    for key in FAMILIES:
        if args.keys and key not in args.keys:
            continue
        print(f"[families_memx] {key}", flush=True)
        rows[key] = run_family(key, args.cache_root, args.timeout)
        print(json.dumps(rows[key]["cells"])[:600], flush=True)
        doc.update(command="nice -n 19 python -m benchmark.families_memx [KEY ...]", sglang=_sglang_version(),
                   common_args=COMMON, rows=[rows[k] for k in FAMILIES if k in rows])  # fmt: skip
        RESULT.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
