"""What the router's relay adds to a streamed request: TTFT and TPOT through ``sglang-memx serve``'s
router against the same engine called directly, in the same run.

The engine is a stand-in (an HTTP server that streams ``--tokens`` SSE events, the first after
``--first-ms``, then one every ``--gap-ms``), so the figures are the relay's alone: HTTP parse,
admission, the engine client, the chunk copy. The router is the one ``serve`` builds
(``sglang_memx.serve.router.build_app`` with the activity publisher on, served by uvicorn as
``serve`` serves it). Each round sends ``--requests`` requests (``--concurrency`` at a time) to
each setup, the order rotating (``benchmark/pairs.py``); the pair ratio is router / direct per
round, reported as median [min, max] with the added milliseconds.

    python benchmark/micro/router_relay.py [--rounds 7] [--requests 60] [--concurrency 1]

Writes ``benchmark/results/micro/router_relay.json``. The HTTP parser uvicorn picked (``httptools``
or ``h11``) is recorded: it serves the engine stand-in and the router alike. Run on a quiet
machine: every hop is a process wake-up, and a busy core delays each.
"""

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results" / "micro"
sys.path.insert(0, str(REPO / "benchmark"))
from pairs import ratio_stats, run_rounds  # noqa: E402

MODEL = "relay-model"


def _engine(port: int, first_s: float, gap_s: float, tokens: int) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from sglang_memx.serve.activity import ACTIVITY_PATH

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post(ACTIVITY_PATH)  # the router's activity reports, as a memx engine takes them
    async def activity(request: Request):
        await request.body()
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        await request.body()

        async def events():
            await asyncio.sleep(first_s)
            for i in range(tokens):
                if i:
                    await asyncio.sleep(gap_s)
                yield f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _router(port: int, engine_port: int) -> None:
    import uvicorn

    from memory_ext.policy.edf_admission import EdfAdmission, ModelLimits
    from sglang_memx.serve.admission import AdmissionGate
    from sglang_memx.serve.router import EngineRoute, build_app

    routes = {MODEL: EngineRoute(MODEL, f"http://127.0.0.1:{engine_port}", "/models/" + MODEL)}
    gate = AdmissionGate(EdfAdmission({MODEL: ModelLimits(60.0, max_inflight=64, max_queued=256)}))
    app = build_app(routes, gate, activity_interval_s=0.2)  # as serve builds it
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


async def _one(session, url: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url, json={"model": MODEL, "prompt": "hello", "stream": True}) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            times += [now] * (chunk.count(b"data:") - chunk.count(b"data: [DONE]"))
    return times[0] - t0, (times[-1] - times[0]) / (len(times) - 1)


async def _load(url: str, requests: int, concurrency: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def bounded(session):
        async with sem:
            return await _one(session, url)

    async with aiohttp.ClientSession() as session:
        got = await asyncio.gather(*(bounded(session) for _ in range(requests)))
    ttft, tpot = [g[0] for g in got], [g[1] for g in got]
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "tpot_p50_ms": statistics.median(tpot) * 1e3,
            "ttft_samples": len(ttft)}  # fmt: skip


def _wait_up(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up within {timeout_s:g} s")


def http_parser() -> str:
    """The HTTP parser uvicorn's ``auto`` picks here."""
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=60, help="requests per setup per round")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--first-ms", type=float, default=9.0, help="the stand-in engine's time to its first event")
    p.add_argument("--gap-ms", type=float, default=1.2, help="the stand-in engine's time between events")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=31850, help="engine port; the router takes the next one")
    p.add_argument("--out", default=str(RESULTS / "router_relay.json"))
    a = p.parse_args(argv)
    for name in ("rounds", "requests", "concurrency", "tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name}: must be >= 1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_engine, args=(a.port, a.first_ms / 1e3, a.gap_ms / 1e3, a.tokens), daemon=True),
             ctx.Process(target=_router, args=(a.port + 1, a.port), daemon=True)]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        _wait_up(f"http://127.0.0.1:{a.port}/health")
        _wait_up(f"http://127.0.0.1:{a.port + 1}/health")
        urls = {"direct": f"http://127.0.0.1:{a.port}/v1/completions",
                "router": f"http://127.0.0.1:{a.port + 1}/v1/completions"}  # fmt: skip
        asyncio.run(_load(urls["router"], 10, 1))  # warm both paths (connections, imports)
        asyncio.run(_load(urls["direct"], 10, 1))
        rounds = run_rounds(a.rounds, list(urls), lambda s, r: asyncio.run(_load(urls[s], a.requests, a.concurrency)))
    finally:
        for proc in procs:
            proc.terminate()
    doc = {
        "command": "python benchmark/micro/router_relay.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "http_parser": http_parser()},
        "params": {k: getattr(a, k) for k in ("rounds", "requests", "concurrency", "first_ms", "gap_ms", "tokens")},
        "rounds": rounds,
        "ratios": {k: ratio_stats(rounds, k, "router", "direct") for k in ("ttft_p50_ms", "tpot_p50_ms")},
        "added_ms": {k: _added(rounds, k) for k in ("ttft_p50_ms", "tpot_p50_ms")},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    for k, v in doc["added_ms"].items():
        print(f"router adds to {k}: {v['median']:.2f} ms [{v['min']:.2f}, {v['max']:.2f}] "
              f"(ratio {doc['ratios'][k]['median']:.3f})")  # fmt: skip
    print(f"wrote {a.out}")
    return 0


def _added(rounds: list[dict], key: str) -> dict:
    """Per round: router minus direct, in ms (median, min, max)."""
    values = [r["router"][key] - r["direct"][key] for r in rounds]
    return {"values": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    sys.exit(main())
