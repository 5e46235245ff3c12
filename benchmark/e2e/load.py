"""Load generation and per-run summaries for the end-to-end scripts.

A *schedule* is a fixed list of ``(offset seconds, server index, prompt)``, built from the
script's parameters alone, so every setup and every round replays exactly the same requests at
the same offsets. ``play`` sends each as one streaming ``/generate`` (greedy, ``ignore_eos``)
from its own thread at its offset; ``summarize`` turns the results into TTFT / TPOT / throughput
figures; ``server_timeline`` reads what each server's scheduler logged during the run (running
requests, waiting queue, token usage) for the time-series plots.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
import urllib.request
from datetime import datetime

from benchmark._stats import percentile
from benchmark.sse import DONE, data_payloads

DECODE_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] Decode batch.*?#running-req: (\d+).*?token usage: ([\d.]+).*?"
    r"gen throughput \(token/s\): ([\d.]+).*?#queue-req: (\d+)"
)


def stream_generate(url: str, payload: dict, timeout: float) -> tuple[float | None, float, dict | None]:
    """One streaming ``/generate`` of ``payload``: (seconds to the first event or None, seconds to the
    end, the last event or None). Raises what the connection or the JSON decoding raises."""
    body = json.dumps({**payload, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for payload in data_payloads(r):
            if payload is DONE:
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(payload)
    return ttft, time.perf_counter() - t0, last


def stream_one(url: str, text: str, new_tokens: int, timeout: float = 900) -> dict:
    """One streaming /generate; returns ttft, e2e, tokens, tpot, retractions (or error)."""
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    try:
        ttft, e2e, last = stream_generate(url, {"text": text, "sampling_params": sampling}, timeout)
    except Exception as exc:  # noqa: BLE001 - recorded, counted as a failure
        return {"error": repr(exc)}
    if last is None or "meta_info" not in last:
        return {"error": f"stream ended without a result: {last!r}"}
    meta = last["meta_info"]
    n = meta["completion_tokens"]
    return {"ttft": ttft, "e2e": e2e, "tokens": n, "tpot": (e2e - ttft) / max(1, n - 1),
            "retractions": meta.get("num_retractions", 0)}  # fmt: skip


def flush_and_warm(url: str) -> None:
    """An empty prefix cache (``/flush_cache``: prompts that repeat across runs would skip their
    prefill) and one short warm-up request."""
    with urllib.request.urlopen(url + "/flush_cache", timeout=60) as r:
        r.read()
    stream_one(url, "warm up", 4)


def solo_runs(url: str, texts: list[str], new_tokens: int, label: str) -> list[dict]:
    """Each of ``texts`` streamed alone, in order (``stream_one``); a failed request raises
    ``RuntimeError`` naming ``label`` and the server."""
    runs = [stream_one(url, text, new_tokens) for text in texts]
    bad = [r for r in runs if "error" in r]
    if bad:
        raise RuntimeError(f"{label} at {url}: {bad[0]['error']}")
    return runs


def play(urls, schedule: list[tuple[float, object, str]], new_tokens: int) -> tuple[list[dict], float]:
    """Send every scheduled request at its offset; return (results, wall seconds until the last finished).
    ``urls[key]`` is the server of a schedule entry ``(offset, key, prompt)``: a list indexed by
    server number, or a mapping (e.g. by model name); each result records its ``server`` key."""
    results, lock, threads = [], threading.Lock(), []

    def one(i: int, text: str, offset: float):
        r = stream_one(urls[i], text, new_tokens)
        r.update(server=i, offset=offset, text=text)
        with lock:
            results.append(r)

    t0 = time.perf_counter()
    for offset, i, text in sorted(schedule, key=lambda x: x[0]):
        time.sleep(max(0.0, t0 + offset - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i, text, offset)))
        threads[-1].start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_p50_s": percentile(ttft, 0.50) if ttft else float("nan"),
        "ttft_p99_s": percentile(ttft, 0.99) if ttft else float("nan"),
        "tpot_p50_s": statistics.median(r["tpot"] for r in ok) if ok else float("nan"),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
        "retractions": sum(r["retractions"] for r in ok),
        "wall_s": wall,
    }


def server_timeline(log_text: str, t0_wall: float) -> list[dict]:
    """Decode-step log lines of one server since ``log_text``'s start: seconds since ``t0_wall``,
    running requests, token usage, decode throughput since the previous line, waiting queue
    (upstream's own scheduler log, the same for every setup; one-second timestamps)."""
    out = []
    for line in log_text.splitlines():
        m = DECODE_LINE.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() - t0_wall
        out.append({"t": t, "running": int(m.group(2)), "usage": float(m.group(3)),
                    "throughput": float(m.group(4)), "queue": int(m.group(5))})  # fmt: skip
    return out


def serve_rounds(servers: dict, rounds: int, run_once) -> list[dict]:
    """Start every server, warm each up, run ``rounds`` interleaved rounds of ``run_once(server)``,
    stop them all (whatever happens); returns the rounds (``benchmark.pairs.run_rounds``)."""
    from benchmark.pairs import run_rounds
    from support.server import start_all

    start_all(list(servers.values()))
    try:
        for s in servers.values():
            s.generate("warm up", max_new_tokens=4, temperature=0)
        return run_rounds(rounds, list(servers), lambda name, r: run_once(servers[name]))
    finally:
        for s in servers.values():
            s.stop()
