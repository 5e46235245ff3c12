"""Speed benchmark: one simulated hour of three models at ~10 requests/s in
total must take < 60 s of wall time on the project's 2-core CI machine.

Three H100s, one model each: Llama-3.1-8B on ShareGPT-like Poisson traffic,
Qwen2.5-7B on Alpaca-like bursty (gamma, CV 2) traffic, Mistral-7B on
ShareGPT-like multi-turn sessions (prefix cache). Writes
``benchmark/results/sim/speed.{json,png}``.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

from .core.stats import summarize, timeline
from .runner import RESULTS, build_simulation, write_json
from .scenario import parse_scenario

TARGET_S = 60.0

SPEED_SCENARIO: dict[str, Any] = {
    "name": "speed",
    "description": "3 models x 1 simulated hour, ~10 req/s total",
    "duration_s": 3600,
    "drain_s": 600,
    "seed": 0,
    "sample_period_s": 5.0,
    "node": {"gpu": "H100-SXM", "count": 3},
    "models": [
        {"name": "llama8b", "model": "Llama-3.1-8B", "gpu": 0},
        {"name": "qwen7b", "model": "Qwen2.5-7B", "gpu": 1},
        {"name": "mistral7b", "model": "Mistral-7B", "gpu": 2},
    ],
    "workloads": [
        {
            "model": "llama8b",
            "arrival": {"kind": "poisson", "rate": 4.0},
            "input": "sharegpt_input",
            "output": "sharegpt_output",
        },
        {
            "model": "qwen7b",
            "arrival": {"kind": "gamma", "rate": 4.0, "cv": 2.0},
            "input": "alpaca_input",
            "output": "alpaca_output",
        },
        {
            "model": "mistral7b",
            "arrival": {"kind": "poisson", "rate": 0.7},
            "input": "sharegpt_input",
            "output": "sharegpt_output",
            "sessions": {"turns_mean": 3.0, "think_s": 20.0},
            "system_prompt_tokens": 256,
        },
    ],
}


def run_speed(
    duration_s: float | None = None, out: Path = RESULTS / "speed", command: str = "python -m benchmark.sim speed"
) -> dict[str, Any]:
    data = dict(SPEED_SCENARIO)
    if duration_s is not None:
        data["duration_s"] = duration_s
    spec = parse_scenario(data, "<speed>")
    t0 = time.perf_counter()
    sim = build_simulation(spec)
    t_build = time.perf_counter() - t0
    sim.run()
    wall = time.perf_counter() - t0
    sim.check()
    summ = summarize(sim)
    scale = 3600.0 / spec.duration_s
    obj = {
        "command": command,
        "where": f"{platform.machine()} {platform.processor() or ''}, python {platform.python_version()}",
        "simulated_s": spec.duration_s,
        "wall_s": wall,
        "build_s": t_build,
        "target_s": TARGET_S / scale,
        "ratio_to_target": wall / (TARGET_S / scale),
        "requests": len(sim.requests),
        "iterations": sum(i.iterations for i in sim.instances),
        "requests_per_s_sim": len(sim.requests) / spec.duration_s,
        "summary": summ,
        "timeline": timeline(sim),
    }
    write_json(out.with_suffix(".json"), obj)
    from .plots import plot_speed

    plot_speed(obj, out.with_suffix(".png"))
    return obj
