"""Discrete-event simulator of LLM serving on one multi-GPU node (issue 4).

Pure Python + numpy; never imports torch or sglang. Policies from
``memory_ext.policy`` are driven through schedulers and hooks.

Modules (one job each): ``hardware`` (GPU calibration table), ``models``
(architectures, derived sizes), ``roofline`` (iteration time), ``events``
(event loop), ``links`` (fair-share links), ``kvcache`` (paged KV + prefix
cache), ``request`` (request state), ``workload`` (seeded synthetic
workloads), ``plan`` (scheduler/hook contracts), ``schedulers``
(continuous batching baseline, eLLM), ``hooks`` (per-iteration hooks),
``engine`` (instances, GPUs, simulator), ``metrics``, ``scenario`` (strict
loader), ``runner`` (build/run/compare/write), ``plots``, ``speed``, ``cli``.

Scenario authors: see ``docs/simulation.md`` and ``benchmark/sim/scenarios/``.
"""

from . import (  # noqa: E402,F401  (registers hook kinds oneiros, select_n, flexgen_static)  # noqa: F401,E402  registers ellm_elastic and fineserve kinds
    combined,  # noqa: F401,E402  registers the swiftcache hook and the X1 combined kinds
    ellm_buffer,
    fineserve_placement,
    oneiros_hook,
    select_n_hook,
)
from .engine import Gpu, Instance, InstanceConfig, Simulator
from .hooks import register_hook
from .plan import BatchPlan, InstanceHook, Scheduler
from .runner import build_simulation, run_scenario, run_spec
from .scenario import ScenarioError, load_scenario, parse_scenario
from .schedulers import ContinuousBatchingScheduler, EllmScheduler, register_scheduler

__all__ = [
    "Gpu",
    "Instance",
    "InstanceConfig",
    "Simulator",
    "BatchPlan",
    "InstanceHook",
    "Scheduler",
    "build_simulation",
    "run_scenario",
    "run_spec",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "ContinuousBatchingScheduler",
    "EllmScheduler",
    "register_scheduler",
    "register_hook",
]
