"""Which model families does stock upstream SGLang serve on CPU here? (issue 28, item 1)

For each probe: build its tiny model (``sglang_memx.models.tiny`` / ``tiny_families``), start
one stock server (memx filtered out with SGLANG_PLUGINS, the CPU flags of
``test/support/server.py``, ``--sleep-on-idle``), send one greedy ``/generate``, stop it, and
record: started, answered, start-up time, the KV pool upstream built (from its log), and when
it did not answer the last lines of its log with upstream's refusal. One server at a time.

    nice -n 19 python -m benchmark.families_probe            # all probes
    nice -n 19 python -m benchmark.families_probe mla tp2    # some (merged into the JSON)

Writes ``benchmark/results/families/probe.json``; ``python -m benchmark.families_table``
renders it into ``docs/models.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from sglang_memx.models.tiny import TinyModelSpec, checkpoint_checksum, tiny_model  # noqa: E402
from sglang_memx.models.tiny_families import TinyFamilySpec, tiny_family_model  # noqa: E402
from support.server import CPU_ARGS, LOG_DIR, SGLangServer  # noqa: E402

RESULT = REPO / "benchmark" / "results" / "families" / "probe.json"
PROMPT = "The capital of France is"
MAX_NEW_TOKENS = 8
LLAMA = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
HYBRID = TinyFamilySpec(family="hybrid_linear", num_layers=4)


@dataclasses.dataclass(frozen=True)
class Probe:
    key: str
    family: str
    spec: TinyModelSpec | TinyFamilySpec
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


PROBES = [
    Probe("llama", "Llama-like GQA (control)", LLAMA),
    Probe("mla", "MLA (DeepSeek-V2)", TinyFamilySpec(family="mla")),
    Probe("mla_v3", "MLA with q LoRA (DeepSeek-V3)", TinyFamilySpec(family="mla_v3")),
    Probe("sliding_window", "sliding window beside full attention (Gemma2)", TinyFamilySpec(family="sliding_window")),
    Probe("swa_gpt_oss", "sliding window, SWA pool (GPT-OSS)", TinyFamilySpec(family="swa_gpt_oss")),
    Probe("swa_mellum", "sliding window, SWA pool (Mellum, dense)", TinyFamilySpec(family="swa_mellum")),
    Probe("hybrid_linear", "hybrid linear attention (Qwen3-Next)", HYBRID),
    # with the overlap schedule on, upstream's mamba radix-cache strategy resolves to extra_buffer,
    # which it refuses on CPU; without it, to no_buffer (which in turn needs the overlap schedule off)
    Probe("hybrid_linear_no_overlap", "hybrid linear attention (Qwen3-Next)", HYBRID, ("--disable-overlap-schedule",)),
    Probe("fp8_kv", "fp8 KV (tiny Llama)", LLAMA, ("--kv-cache-dtype", "fp8_e4m3")),
    Probe("tp2", "tensor parallel 2 (tiny Llama)", LLAMA, ("--tp", "2")),
    # upstream binds one rank per NUMA node unless told which cores each rank gets (one node here)
    Probe(
        "tp2_bound",
        "tensor parallel 2 (tiny Llama), a core per rank",
        LLAMA,
        ("--tp", "2"),
        (("SGLANG_CPU_OMP_THREADS_BIND", "0|1"),),
    ),  # fmt: skip
    # the CUDA torch wheel brings libnccl, so upstream builds a NCCL communicator on a CPU device;
    # without the library it disables NCCL and reduces over gloo
    Probe(
        "tp2_no_nccl",
        "tensor parallel 2 (tiny Llama), a core per rank, no NCCL library",
        LLAMA,
        ("--tp", "2"),
        (("SGLANG_CPU_OMP_THREADS_BIND", "0|1"), ("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")),
    ),  # fmt: skip
]

# Log lines where upstream reports the KV memory it built (memory_pool.py's allocation logs,
# the SWA pool's and the mamba pool's), and the lines of a Python traceback.
_POOL_LINE = re.compile(r"\b((\w+ )?KV Cache is allocated.*|Mamba Cache is allocated.*|\w+Pool mem usage.*)")
_NAMED_POOL = re.compile(r"^(\w+Pool) mem usage")
_EXCEPTION_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exit)\b(: .*)?$")
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d):\d\d\]")
_FRAME_LINE = re.compile(r'^File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def build(probe: Probe, cache_root: Path) -> tuple[Path, dict]:
    if isinstance(probe.spec, TinyFamilySpec):
        path = tiny_family_model(probe.spec, cache_root)
    else:
        path = tiny_model(probe.spec, cache_root)
    config = json.loads((path / "config.json").read_text())
    weights = path / "model.safetensors"
    return path, {
        "name": probe.spec.name,
        "architecture": config["architectures"][0],
        "layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
        "weights_bytes": weights.stat().st_size,
        "checksum": checkpoint_checksum(path),
    }


def _log_lines(server: SGLangServer) -> list[str]:
    try:
        return server.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def pool_evidence(lines: list[str]) -> list[str]:
    """The log lines where upstream reports the KV memory it allocated (deduplicated, in order)."""
    seen: list[str] = []
    for line in lines:
        if "server_args=" in line:
            continue
        m = _POOL_LINE.search(line)
        if m and m.group(0).strip() not in seen:
            seen.append(m.group(0).strip())
    return seen[:6]


def pool_class(pool_log: list[str]) -> str | None:
    """The pool class behind upstream's allocation lines (each is printed by one class in the
    installed sglang's ``mem_cache/``: a K and a V size by ``MHATokenToKVPool``, one KV size by
    ``MLATokenToKVPool``, "Mamba Cache" by ``MambaPool`` inside ``HybridLinearKVPool``; a
    composite pool such as ``SWAKVPool`` prints "<class> mem usage" itself)."""
    named = [m[1] for m in map(_NAMED_POOL.match, pool_log) if m]
    if named:  # the pool printed its own class name
        return named[0]
    text = "\n".join(pool_log)
    if "Mamba Cache is allocated" in text:
        return "HybridLinearKVPool + MambaPool"
    if "KV Cache is allocated" in text:
        return "MHATokenToKVPool" if "K size:" in text else "MLATokenToKVPool"
    return None


def _short(path: str) -> str:
    """A path from the installed packages, from the package on (``sglang/srt/...``, ``torch/...``)."""
    for anchor in ("site-packages/", "dist-packages/"):
        if anchor in path:
            return path.split(anchor, 1)[1]
    return path


def _frames(stripped: list[str], end: int) -> list[tuple[str, str]]:
    """The traceback frames above line ``end`` (up to its "Traceback" line): (where, statement)."""
    frames = []
    for j in range(end - 1, max(end - 200, -1), -1):
        if stripped[j].startswith("Traceback"):
            break
        frame = _FRAME_LINE.match(stripped[j])
        if frame:
            code = stripped[j + 1] if j + 1 < end and not _FRAME_LINE.match(stripped[j + 1]) else ""
            code = "" if set(code) <= set("^~ ") else code
            frames.append((f"{_short(frame['path'])}:{frame['line']} in {frame['func']}", code))
    return frames  # innermost first


def refusal(lines: list[str]) -> str | None:
    """Upstream's refusal: the last exception of the log, after the innermost upstream frame on its
    traceback and, when the raise itself happened below upstream (torch), that frame too:
    ``sglang/...py:LINE in FUNC: statement [-> torch/...py:LINE in FUNC] -> Exception: message``.
    None when the log holds no exception."""
    stripped = [ln.strip() for ln in lines]
    for i in range(len(stripped) - 1, -1, -1):
        if not _EXCEPTION_LINE.match(stripped[i]):
            continue
        frames = _frames(stripped, i)
        if not frames:
            return stripped[i]
        upstream = next((f for f in frames if f[0].startswith("sglang/")), None)
        parts = [f"{upstream[0]}: {upstream[1]}" if upstream and upstream[1] else (upstream or frames[0])[0]]
        if upstream is not None and upstream is not frames[0]:
            parts.append(frames[0][0])
        return " -> ".join(parts + [stripped[i]])
    return None


def run_probe(probe: Probe, cache_root: Path, timeout: float) -> dict:
    path, model = build(probe, cache_root)
    server = SGLangServer(
        path,
        name=f"probe-{probe.key}",
        stock=True,
        max_total_tokens=1024,
        extra_args=list(probe.extra_args),
        env=dict(probe.env),
    )
    row = {"key": probe.key, "family": probe.family, "model": model, "extra_args": list(probe.extra_args),
           "env": dict(probe.env),
           "started": False, "answered": False, "startup_s": None, "output_ids": None, "error": None}  # fmt: skip
    row["time"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout)
        row["started"], row["startup_s"] = True, round(server.startup_s, 1)
        out = server.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS, temperature=0)
        row["answered"] = len(out.get("output_ids") or []) == MAX_NEW_TOKENS
        row["output_ids"] = out.get("output_ids")
    except Exception as exc:  # the server's refusal is in its log; keep our side short
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    finally:
        server.stop()
    lines = _log_lines(server)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    derive_from_log(row, lines)
    return row


def derive_from_log(row: dict, lines: list[str]) -> None:
    """Fill the row's log-derived fields: the pool lines and class, and when it did not answer
    upstream's refusal with the last lines of the log."""
    if not row.get("time"):  # rows from before the probe recorded it: the log's first timestamp
        stamp = next((m for m in map(_STAMP.match, lines) if m), None)
        row["time"] = f"{stamp[1]} UTC" if stamp else None
    row["pool_log"] = pool_evidence(lines)
    row["pool_class"] = pool_class(row["pool_log"])
    row.pop("upstream_refusal", None)
    row.pop("log_tail", None)
    if not row["answered"]:
        row["upstream_refusal"] = refusal(lines)
        row["log_tail"] = [ln for ln in lines if ln.strip()][-12:]


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def write(doc: dict, rows: dict, command: str) -> None:
    doc.update(
        command=command.strip(),
        time=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine={"cpus": os.cpu_count(), "platform": platform.platform()},
        sglang=_sglang_version(),
        flags=CPU_ARGS + ["--max-total-tokens", "1024", "--random-seed", "0"],
        env={"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "every installed plugin but memx"},
        prompt=PROMPT,
        max_new_tokens=MAX_NEW_TOKENS,
        probes=[rows[p.key] for p in PROBES if p.key in rows],
    )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("keys", nargs="*", help=f"probes to run (default: all of {[p.key for p in PROBES]})")
    default_root = Path(os.environ.get("MEMX_TINY_ROOT", "/tmp/memx-tiny-families"))
    ap.add_argument("--cache-root", type=Path, default=default_root)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--from-logs", action="store_true", help="start nothing: re-derive the log fields of the JSON's "
                    "rows from their test-logs/probe-KEY.log (after a change to the parsing)")  # fmt: skip
    args = ap.parse_args(argv)
    unknown = set(args.keys) - {p.key for p in PROBES}
    if unknown:
        ap.error(f"keys: unknown probe(s) {sorted(unknown)}")
    doc = json.loads(RESULT.read_text()) if RESULT.exists() else {"probes": []}
    known = {p.key for p in PROBES}
    rows = {r["key"]: r for r in doc["probes"] if r["key"] in known}  # a renamed probe's old row goes
    if args.from_logs:
        for probe in PROBES:
            log = LOG_DIR / f"probe-{probe.key}.log"
            if probe.key in rows and log.exists() and (not args.keys or probe.key in args.keys):
                rows[probe.key]["model"] = build(probe, args.cache_root)[1]  # deterministic: same files
                derive_from_log(rows[probe.key], log.read_text(errors="replace").splitlines())
        doc["probes"] = [rows[p.key] for p in PROBES if p.key in rows]
        RESULT.write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    command = "nice -n 19 python -m benchmark.families_probe [KEY ...]"  # each row records its own time
    for probe in PROBES:
        if args.keys and probe.key not in args.keys:
            continue
        print(f"[probe] {probe.key}: {probe.family}", flush=True)
        rows[probe.key] = r = run_probe(probe, args.cache_root, args.timeout)
        print(f"[probe] {probe.key}: started={r['started']} answered={r['answered']} "
              f"startup_s={r['startup_s']} refusal={r.get('upstream_refusal')}", flush=True)  # fmt: skip
        write(doc, rows, command)  # after every probe: a later hang loses nothing
    return 0


if __name__ == "__main__":
    sys.exit(main())
