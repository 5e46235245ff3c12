"""Turn a ``ScenarioSpec`` into a running ``Simulator``; run single
configurations, variant comparisons and rate sweeps; write JSON + PNG.

Memory plan per GPU (invariant: weights + activation reserves + KV <=
``memory_fraction * hbm``): each model's weights and its activation reserve
(``model.activation_bytes(activation_tokens)``, default
``max_batched_tokens`` tokens, like an engine's profiling run) are charged
first; models with ``kv_memory_gb`` get exactly that; the rest is split
equally among the others. A model left with no KV is a ``ScenarioError``.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core.batching import OptionError
from .core.engine import Gpu, Instance, InstanceConfig, Simulator
from .core.hardware import gpu_spec
from .core.models import model_spec
from .core.spec import ScenarioSpec
from .core.stats import summarize, timeline
from .core.workload import generate
from .mechanisms.arbiter import attach_arbiter
from .registry import UnknownKind, make_hook, make_scheduler
from .scenario import Scenario, ScenarioError

__all__ = [
    "plan_instances",
    "build_simulation",
    "run_spec",
    "RunResult",
    "run_scenario",
    "write_json",
    "REPO",
    "RESULTS",
]

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results" / "sim"


def plan_instances(spec: ScenarioSpec) -> list[InstanceConfig]:
    """Instance configs with their KV sizes (see module docstring)."""
    g = gpu_spec(spec.node.gpu)
    usable = g.mem_bytes * spec.node.memory_fraction
    cfgs: list[InstanceConfig | None] = [None] * len(spec.models)
    for gpu in range(spec.node.count):
        idx = [i for i, m in enumerate(spec.models) if m.gpu == gpu]
        fixed, explicit, auto = 0.0, 0.0, []
        acts = {}
        for i in idx:
            m = spec.models[i]
            ms = model_spec(m.model)
            act_tokens = m.max_batched_tokens if m.activation_tokens is None else m.activation_tokens
            acts[i] = ms.activation_bytes(act_tokens, m.weight_dtype)
            fixed += ms.weight_bytes(m.weight_dtype) + acts[i]
            if m.kv_memory_gb is not None:
                explicit += m.kv_memory_gb * 1e9
            else:
                auto.append(i)
        rest = usable - fixed - explicit
        share = rest / len(auto) if auto else 0.0
        for i in idx:
            m = spec.models[i]
            ms = model_spec(m.model)
            kv_bytes = m.kv_memory_gb * 1e9 if m.kv_memory_gb is not None else share
            cfg = InstanceConfig(
                name=m.name,
                model=ms,
                gpu=m.gpu,
                kv_blocks=0,
                block_size=m.block_size,
                weight_dtype=m.weight_dtype,
                kv_dtype=m.kv_dtype,
                max_batched_tokens=m.max_batched_tokens,
                max_running=m.max_running,
                prefix_caching=m.prefix_caching,
                overhead_s=m.overhead_s,
                share=m.share,
                ttft_slo_s=m.ttft_slo_s,
                tpot_slo_s=m.tpot_slo_s,
            )
            blocks = int(kv_bytes // cfg.kv_block_bytes) if kv_bytes > 0 else 0
            if blocks < 1 or rest < 0:
                raise ScenarioError(
                    f"{spec.source}: models[{i}]: {m.model} does not fit on gpu {gpu} ({spec.node.gpu}): "
                    f"weights+activations {fixed / 1e9:.1f} GB + explicit KV {explicit / 1e9:.1f} GB of "
                    f"{usable / 1e9:.1f} GB usable leaves {kv_bytes / 1e9:.2f} GB for KV"
                )
            cfg.kv_blocks = blocks
            cfg.act_blocks = int(acts[i] // cfg.kv_block_bytes)
            cfgs[i] = cfg
    return cfgs  # type: ignore[return-value]


def build_simulation(spec: ScenarioSpec, seed: int | None = None, rate_scale: float = 1.0) -> Simulator:
    """A ready-to-run simulator for ``spec`` (``seed`` overrides ``spec.seed``)."""
    g = gpu_spec(spec.node.gpu).with_efficiency(spec.node.compute_eff, spec.node.memory_eff)
    cfgs = plan_instances(spec)
    gpus = [Gpu(i, g, spec.node.sharing) for i in range(spec.node.count)]
    instances = []
    for i, (cfg, m) in enumerate(zip(cfgs, spec.models)):
        try:
            sched = make_scheduler(m.scheduler, cfg, m.scheduler_options)
        except UnknownKind as e:
            raise ScenarioError(f"{spec.source}: models[{i}].scheduler.kind: {e}") from None
        except OptionError as e:
            raise ScenarioError(f"{spec.source}: models[{i}].scheduler.options.{e}") from None
        except (TypeError, ValueError) as e:
            raise ScenarioError(f"{spec.source}: models[{i}].scheduler.options: {e}") from None
        instances.append(Instance(i, cfg, g, sched))
    for i, (inst, m) in enumerate(zip(instances, spec.models)):
        for k, (kind, opts) in enumerate(m.hooks):
            try:
                inst.hooks.append(make_hook(kind, inst, opts))
            except UnknownKind as e:
                raise ScenarioError(f"{spec.source}: models[{i}].hooks[{k}].kind: {e}") from None
            except (TypeError, ValueError) as e:
                raise ScenarioError(f"{spec.source}: models[{i}].hooks[{k}].options: {e}") from None
    wl = generate(
        spec.workloads,
        {m.name: i for i, m in enumerate(spec.models)},
        spec.duration_s,
        spec.seed if seed is None else seed,
        rate_scale,
    )
    sim = Simulator(
        gpus,
        instances,
        wl.requests,
        wl.initial,
        spec.duration_s,
        horizon_s=spec.duration_s + spec.drain_s,
        sample_period_s=spec.sample_period_s,
    )
    if spec.arbiter is not None:
        try:
            attach_arbiter(sim, spec)
        except ValueError as e:
            raise ScenarioError(f"{spec.source}: arbiter: {e}") from None
    for gi in range(spec.node.count):
        sim.links.add(f"h2d:{gi}", g.host_gbps * 1e9)
        sim.links.add(f"d2h:{gi}", g.host_gbps * 1e9)
        if g.nvlink_gbps:
            sim.links.add(f"nvlink:{gi}", g.nvlink_gbps * 1e9)
    return sim


@dataclass
class RunResult:
    summary: dict[str, Any]
    timeline: dict[str, Any]
    sim: Simulator


def run_spec(spec: ScenarioSpec, seed: int | None = None, rate_scale: float = 1.0) -> RunResult:
    sim = build_simulation(spec, seed, rate_scale).run()
    sim.check()
    return RunResult(summarize(sim), timeline(sim), sim)


def _total_rate(spec: ScenarioSpec) -> float:
    return sum(w.arrival.rate for w in spec.workloads if w.arrival.kind != "batch")


def _clean(x: Any) -> Any:
    """JSON-safe copy: NaN/inf become None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=1, sort_keys=False) + "\n")


def run_scenario(
    sc: Scenario, out: Path, command: str, seed: int | None = None, duration_s: float | None = None
) -> dict[str, Any]:
    """Run a loaded file: the base alone, or every variant at every rate
    scale. Writes ``out.json`` and ``out.png``; returns the JSON object."""
    from dataclasses import replace

    from . import plots

    configs = sc.variants or [(sc.base.name, sc.base)]
    if duration_s is not None:
        configs = [(n, replace(s, duration_s=duration_s)) for n, s in configs]
    scales = sc.rate_scales or [1.0]
    results: dict[str, Any] = {}
    timelines: dict[str, Any] = {}
    for name, spec in configs:
        per = []
        for s in scales:
            r = run_spec(spec, seed, s)
            per.append({"rate_scale": s, "total_rate_rps": _total_rate(spec) * s, **r.summary})
            print(
                f"  {name:>16} x{s:<5g} ttft p99 {r.summary['overall']['ttft_s']['p99']:.3f}s  "
                f"tbt p99 {r.summary['overall']['tbt_s']['p99']:.4f}s  "
                f"slo {r.summary['overall']['slo']['attainment']:.3f}  "
                f"tok/s {r.summary['overall']['throughput_tokens_per_s']:.0f}  "
                f"preempt {r.summary['overall']['preemptions']}  (wall {r.sim.wall_s:.1f}s)"
            )
        results[name] = per
        timelines[name] = r.timeline  # timeline of the last (largest) rate
    goodput = {}
    for name, per in results.items():
        ok = [p["total_rate_rps"] for p in per if (p["overall"]["slo"]["attainment"] or 0) >= 0.9]
        goodput[name] = max(ok) if ok else 0.0
    obj = {
        "scenario": sc.base.name,
        "description": sc.base.description,
        "source": sc.source,
        "command": command,
        "seed": sc.base.seed if seed is None else seed,
        "where": f"simulated {sc.base.node.gpu} x{sc.base.node.count} (run on {platform.machine()}, "
        f"python {platform.python_version()})",
        "paper": sc.paper,
        "goodput_rate_rps_at_90pct_slo": goodput,
        "results": results,
        "timeline": timelines,
    }
    write_json(out.with_suffix(".json"), obj)
    plots.plot_result(obj, out.with_suffix(".png"))
    return obj


def command_line() -> str:
    return "python -m benchmark.sim " + " ".join(sys.argv[1:])
