"""Discrete-event simulator of LLM serving on one multi-GPU node (issue 4).

Pure Python + numpy; never imports torch or sglang. Policies from
``memory_ext.policy`` are driven through schedulers and hooks.

Layout (``docs/simulation.md``):

* ``core/`` -- engine-independent machinery: ``events`` (event loop),
  ``engine`` (instances, GPUs, simulator), ``links`` (fair-share links),
  ``kvcache`` (paged KV + prefix cache), ``request``, ``roofline``
  (iteration time), ``hardware`` (GPU calibration table), ``models``
  (architectures), ``workload`` (seeded synthetic workloads), ``stats``
  (metrics, and the common shape of mechanism statistics), ``plan``
  (scheduler / hook contracts), ``spec`` (parsed scenario), ``batching``
  (the stock continuous-batching baseline).
* ``mechanisms/`` -- one module per paper: ``oneiros``, ``select_n``,
  ``ellm``, ``fineserve``, ``swiftcache``; ``arbiter`` (the X1 node arbiter
  glue) and ``layer_streaming`` (generic weight streaming).
* ``registry`` -- the literal tables of scheduler and hook kinds.
* ``scenario`` (strict loader), ``runner`` (build / run / compare / write),
  ``cli``, ``plots``, ``speed``; ``scenarios/`` holds the shipped files.

The names below are re-exports for convenience; nothing is imported for a
side effect.
"""

from .core.engine import Gpu, Instance, InstanceConfig, Simulator
from .core.plan import BatchPlan, InstanceHook, InstanceView, Scheduler
from .registry import HOOKS, SCHEDULERS
from .runner import build_simulation, run_scenario, run_spec
from .scenario import ScenarioError, load_scenario, parse_scenario

__all__ = [
    "Gpu",
    "Instance",
    "InstanceConfig",
    "Simulator",
    "BatchPlan",
    "InstanceHook",
    "InstanceView",
    "Scheduler",
    "HOOKS",
    "SCHEDULERS",
    "build_simulation",
    "run_scenario",
    "run_spec",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
]
