"""A diagnostic client, not a benchmark: a burst of concurrent streaming chat requests against one
OpenAI-compatible server, each cut by the client after a window, as a user's chat front end would
send them (no ``max_tokens`` unless given, so each asks for what the server's context allows).

Prints one JSON line: how many requests got a first token within the window, how many finished,
TTFT p50 / max of those with one, content chunks received (one per token as upstream streams
them), and the most requests decoding at once as the client saw them (first token to last).
Single runs show a behaviour (e.g. how many requests a rule lets run), never a ratio to claim.

    python benchmark/e2e/chat_burst.py [--url http://127.0.0.1:30000] [--requests 24] [--window-s 150]
                                       [--max-tokens N] [--model SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmark.sse import DONE, data_payloads  # noqa: E402

TOPICS = "dragon ship river mountain robot city garden winter ocean desert forest castle".split()


@dataclass
class Outcome:
    first_s: float | None = None  # since the burst started
    last_s: float | None = None
    chunks: int = 0
    finished: bool = False


def _stream(url: str, body: dict, t0: float, window_s: float) -> Outcome:
    out = Outcome()
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=window_s + 5) as reply:
            for payload in data_payloads(reply):
                now = time.monotonic() - t0
                if now > window_s:
                    break
                if payload is DONE:
                    out.finished = True
                    break
                choices = json.loads(payload).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    out.chunks += 1
                    out.first_s = now if out.first_s is None else out.first_s
                    out.last_s = now
    except OSError:  # cut by the client's timeout: counted with what it received
        pass
    return out


def most_at_once(outcomes: list[Outcome]) -> int:
    """The most requests between their first and last token at one instant."""
    events = sorted(e for o in outcomes if o.first_s is not None for e in ((o.first_s, 1), (o.last_s, -1)))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def burst(url: str, requests: int, window_s: float, model: str, max_tokens: int | None) -> dict:
    outcomes: list[Outcome] = [Outcome() for _ in range(requests)]
    t0 = time.monotonic()

    def one(i: int) -> None:
        text = f"Tell me a long story about a {TOPICS[i % len(TOPICS)]}. #{i}"
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": text}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        outcomes[i] = _stream(url, body, t0, window_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = sorted(o.first_s for o in outcomes if o.first_s is not None)
    return {
        "requests": requests, "window_s": window_s, "max_tokens": max_tokens,
        "with_first_token": len(firsts), "finished": sum(o.finished for o in outcomes),
        "ttft_p50_s": round(firsts[len(firsts) // 2], 1) if firsts else None,
        "ttft_max_s": round(firsts[-1], 1) if firsts else None,
        "chunks": sum(o.chunks for o in outcomes), "most_decoding_at_once": most_at_once(outcomes),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--window-s", type=float, default=150.0)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    if args.window_s <= 0:
        ap.error(f"--window-s must be positive, got {args.window_s}")
    print(json.dumps(burst(args.url.rstrip("/"), args.requests, args.window_s, args.model, args.max_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
