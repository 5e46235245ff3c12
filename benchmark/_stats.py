"""Latency summaries shared by the benchmark scripts."""

import statistics


def percentile(samples, q: float) -> float:
    """Nearest-rank percentile of ``samples`` (q in [0, 1])."""
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary_us(samples_s) -> dict:
    """p50 / p99 / mean in microseconds of durations given in seconds."""
    us = [x * 1e6 for x in samples_s]
    return {"p50_us": percentile(us, 0.50), "p99_us": percentile(us, 0.99), "mean_us": statistics.fmean(us)}
