"""Select-N decision logic (S1-S3): offloading interval, performance record, link coordinator.

Numbers in, decisions out. Standard library only: no torch, no sglang, nothing
here touches memory. Units are the caller's, used consistently: seconds for
times, bytes for sizes, bytes/second for bandwidth.

Modules: ``interval_model`` (S1: the latency model and the optimal interval), ``record`` (S2: the
performance record and its conservative lookup), ``link`` (S3: the link coordinator); this
package re-exports their public names.
"""

from .interval_model import (
    LayerTiming,
    SloKind,
    iteration_latency,
    meets_slo,
    no_offload_interval,
    offloaded_layers,
    optimal_interval,
)
from .link import CoordinatorDecision, GpuDemand, LinkCoordinator, Rejection, max_interval_for_capacity
from .record import PerformanceRecord, Phase, PhaseRecords, analyze, analyze_phases

__all__ = [
    "Phase",
    "SloKind",
    "LayerTiming",
    "offloaded_layers",
    "no_offload_interval",
    "iteration_latency",
    "meets_slo",
    "optimal_interval",
    "PerformanceRecord",
    "PhaseRecords",
    "analyze",
    "analyze_phases",
    "max_interval_for_capacity",
    "GpuDemand",
    "Rejection",
    "CoordinatorDecision",
    "LinkCoordinator",
]
