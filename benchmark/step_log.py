"""Decode step time by batch size, read from upstream's own scheduler log.

With ``--decode-log-interval 1`` upstream's scheduler logs one ``Decode batch`` line per decode
step: ``#running-req: N`` and ``gen throughput (token/s): G``, the tokens generated since its
previous decode line over the time since that line. When the line before it is also a decode line
(no prefill forward ran in between), that time is one decode step: ``N / G`` seconds. Prefill
lines (``Prefill batch, ... #new-token: T``) are counted: how many prefill forwards ran
and how many tokens they computed.

``summarize(texts)`` gives, per batch-size bin (``BINS``), the number of such steps, the median step
time and the mean batch size, plus the prefill counts, for one run (``texts``: what each engine's
log gained during it). The benchmark compares stock and memx bin by bin: equal step times at
equal batch sizes mean memx does not slow a step down, and a throughput gap is then in what the
batches hold (their sizes, the prefill forwards between them), not in the steps.

One step's reading is an estimate: upstream counts a step's tokens when its result is processed
(under its overlap scheduler, while the next step runs), so a single step can read short or long
(a run with 4 steps at 65 running requests read 138 ms); bins are compared by their median over at
least ``MIN_STEPS`` steps.

Invariant: only a decode line whose predecessor (among decode and prefill lines) is a decode line
gives a step; other lines of the log are ignored.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

__all__ = ["BINS", "MIN_STEPS", "bin_key", "summarize", "read_from"]

MIN_STEPS = 5  # a run's median step in a bin is compared only when it timed at least this many there
BINS = ((1, 8), (9, 16), (17, 32), (33, 48), (49, 64), (65, 96), (97, 10**6))
_DECODE = re.compile(r"Decode batch\b.*?#running-req: (\d+)\b.*?gen throughput \(token/s\): ([0-9.]+)")
_PREFILL = re.compile(r"Prefill batch\b.*?#new-token: (\d+)")


def bin_key(lo: int, hi: int) -> str:
    """The JSON key of a batch-size bin: ``"49-64"``, the last one ``"97+"``."""
    return f"{lo}+" if hi >= 10**6 else f"{lo}-{hi}"


def _steps(text: str) -> tuple[list[tuple[int, float]], int, int]:
    steps: list[tuple[int, float]] = []
    prefills = prefill_tokens = 0
    previous_was_decode = False
    for line in text.splitlines():
        found = _DECODE.search(line)
        if found:
            running, rate = int(found.group(1)), float(found.group(2))
            if previous_was_decode and rate > 0 and running > 0:
                steps.append((running, running / rate))
            previous_was_decode = True
            continue
        found = _PREFILL.search(line)
        if found:
            prefills += 1
            prefill_tokens += int(found.group(1))
            previous_was_decode = False
    return steps, prefills, prefill_tokens


def summarize(texts: list[str]) -> dict:
    """One run's log slices (one per log, each read on its own): ``prefill_batches``,
    ``prefill_tokens``, ``decode_steps`` (timed steps) and ``by_batch`` {bin: {"steps",
    "step_ms_p50", "mean_batch"}} for the bins that had a step."""
    steps: list[tuple[int, float]] = []
    prefills = prefill_tokens = 0
    for text in texts:
        more, n, tokens = _steps(text)
        steps += more
        prefills += n
        prefill_tokens += tokens
    by_batch = {}
    for lo, hi in BINS:
        inside = [(n, s) for n, s in steps if lo <= n <= hi]
        if inside:
            by_batch[bin_key(lo, hi)] = {
                "steps": len(inside),
                "step_ms_p50": 1e3 * statistics.median(s for _, s in inside),
                "mean_batch": statistics.fmean(n for n, _ in inside),
            }
    return {"prefill_batches": prefills, "prefill_tokens": prefill_tokens, "decode_steps": len(steps),
            "by_batch": by_batch}  # fmt: skip


def read_from(path: Path, offset: int) -> str:
    """The text a log gained since ``offset`` bytes (the whole log if it shrank)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() < offset:
            offset = 0
        f.seek(offset)
        return f.read().decode(errors="replace")
