"""Select-N S3: the per-link bandwidth coordinator, Fig. 8 generalised from two GPUs to any number
sharing one link, and the GPU-capacity bound on the interval (§4.5).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ._inputs import EPS as _EPS
from ._inputs import positive_int as _pos_int
from ._inputs import positive_number as _pos_num
from .interval_model import no_offload_interval, offloaded_layers


def max_interval_for_capacity(num_layers: int, layer_bytes: int, gpu_weight_budget_bytes: int) -> int | None:
    """Largest interval whose GPU-resident weights fit the budget (§4.5).

    ``None`` means unbounded (the whole model fits). ``0`` means nothing fits,
    not even interval 1. An offloaded layer needs one staging buffer on the GPU
    while it computes (our reading of Fig. 7), counted when ``L // i > 0``.
    """
    _pos_int("num_layers", num_layers)
    _pos_int("layer_bytes", layer_bytes)
    _pos_num("gpu_weight_budget_bytes", gpu_weight_budget_bytes, allow_zero=True)
    if num_layers * layer_bytes <= gpu_weight_budget_bytes:
        return None
    best = 0
    for i in range(1, num_layers + 1):
        n = num_layers // i
        resident = (num_layers - n + (1 if n else 0)) * layer_bytes
        if resident <= gpu_weight_budget_bytes:
            best = i
    return best


@dataclass(frozen=True)
class GpuDemand:
    """One GPU on the link, with the request it currently serves.

    ``min_interval``: from the performance record (``None`` = record says no
    interval meets the SLO). ``max_interval``: from GPU capacity (``None`` =
    unbounded). ``iter_time_s``: iteration time used to turn bytes per
    iteration into a rate, as in Fig. 8 lines 4-13. ``iter_times``: optional
    iteration time per interval (an interval's rate is then its bytes over its
    own iteration time; intervals not listed use ``iter_time_s``).
    """

    name: str
    num_layers: int
    layer_bytes: int
    iter_time_s: float
    min_interval: int | None
    max_interval: int | None = None
    iter_times: Mapping[int, float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        _pos_int("num_layers", self.num_layers)
        _pos_int("layer_bytes", self.layer_bytes)
        _pos_num("iter_time_s", self.iter_time_s)
        if self.min_interval is not None:
            _pos_int("min_interval", self.min_interval)
        if self.max_interval is not None:
            if isinstance(self.max_interval, bool) or not isinstance(self.max_interval, int) or self.max_interval < 0:
                raise ValueError(f"max_interval must be a non-negative int or None, got {self.max_interval!r}")
        if self.iter_times is not None:
            if not isinstance(self.iter_times, Mapping):
                raise ValueError(f"iter_times must be a mapping interval -> seconds, got {self.iter_times!r}")
            for i, t in self.iter_times.items():
                _pos_int("iter_times", i)
                _pos_num("iter_times", t)

    def offloaded_bytes(self, interval: int) -> int:
        return offloaded_layers(self.num_layers, interval) * self.layer_bytes

    def transfer_rate(self, interval: int) -> float:
        """Bytes/second this GPU pulls over the link at this interval.

        Fig. 8 divides ``layers * mem_per_layer`` by the interval; we use the
        whole number of offloaded layers ``L // i`` (what actually moves).
        """
        t = self.iter_time_s if self.iter_times is None else self.iter_times.get(interval, self.iter_time_s)
        return self.offloaded_bytes(interval) / t

    def candidate_intervals(self) -> list[int]:
        """Valid intervals, one per distinct offloaded-layer count.

        Among intervals with equal ``L // i`` (same bytes, same rate), the
        largest is kept: it has the longest overlap, hence the lowest latency.
        """
        if self.min_interval is None:
            return []
        cap = no_offload_interval(self.num_layers)
        hi = cap if self.max_interval is None else min(self.max_interval, cap)
        by_count: dict[int, int] = {}
        for i in range(self.min_interval, hi + 1):
            by_count[self.num_layers // i] = i
        return sorted(by_count.values())


class Rejection(str, enum.Enum):
    SLO_UNATTAINABLE = "slo_unattainable"  # no interval meets the SLO (record says None)
    EXCEEDS_GPU_CAPACITY = "exceeds_gpu_capacity"  # min interval > max interval (Fig. 8 l.34)
    LINK_BANDWIDTH = "link_bandwidth"  # no joint choice fits under the link bandwidth


@dataclass(frozen=True)
class CoordinatorDecision:
    accepted: bool
    intervals: Mapping[str, int]  # per GPU; empty when rejected (nothing changes)
    host_bytes: int
    total_rate: float
    rejection: Rejection | None = None
    reason: str = ""


class LinkCoordinator:
    """Per-link bandwidth coordinator (§4.5, Fig. 8) for any number of GPUs.

    ``decide(new, others)`` admits ``new`` (the GPU the request is scheduled
    on) together with the busy GPUs ``others`` sharing the link, choosing every
    interval jointly to maximise offloaded (host) bytes subject to
    ``sum(rate) <= bandwidth``. Idle GPUs are simply not passed; alone, the new
    request gets its minimum interval whenever that fits the link (the paper's
    special case). Ties: lower total rate, then smaller intervals in input order.
    Paper uses a strict ``<`` against bandwidth; we allow equality ("never exceeds").
    """

    def __init__(self, bandwidth_bytes_per_s: float) -> None:
        self.bandwidth = _pos_num("bandwidth_bytes_per_s", bandwidth_bytes_per_s)

    def decide(self, new: GpuDemand, others: Sequence[GpuDemand] = ()) -> CoordinatorDecision:
        if not isinstance(new, GpuDemand):
            raise ValueError("new must be a GpuDemand")
        others = tuple(others)
        for o in others:
            if not isinstance(o, GpuDemand):
                raise ValueError("others must hold GpuDemand")
        names = [new.name] + [o.name for o in others]
        if len(set(names)) != len(names):
            raise ValueError(f"name must be unique per link, got {names!r}")

        if new.min_interval is None:
            return _reject(Rejection.SLO_UNATTAINABLE, f"{new.name}: no offloading interval meets the SLO")
        if new.max_interval is not None and new.min_interval > new.max_interval:
            return _reject(
                Rejection.EXCEEDS_GPU_CAPACITY,
                f"{new.name}: SLO needs interval >= {new.min_interval} but GPU "
                f"capacity allows at most {new.max_interval}",
            )
        demands = (new,) + others
        cands = [d.candidate_intervals() for d in demands]
        for d, c in zip(demands, cands):
            if not c:
                return _reject(
                    Rejection.SLO_UNATTAINABLE if d.min_interval is None else Rejection.EXCEEDS_GPU_CAPACITY,
                    f"{d.name}: has no valid interval",
                )

        best = None
        best_key = None
        limit = self.bandwidth * (1 + _EPS)
        for combo in itertools.product(*cands):
            rate = sum(d.transfer_rate(i) for d, i in zip(demands, combo))
            if rate > limit:
                continue
            host = sum(d.offloaded_bytes(i) for d, i in zip(demands, combo))
            key = (-host, rate, combo)
            if best_key is None or key < best_key:
                best, best_key = (combo, host, rate), key
        if best is None:
            return _reject(
                Rejection.LINK_BANDWIDTH,
                f"no combination of valid intervals keeps the link under {self.bandwidth:g} B/s",
            )
        combo, host, rate = best
        return CoordinatorDecision(True, {d.name: i for d, i in zip(demands, combo)}, host, rate)


def _reject(kind: Rejection, reason: str) -> CoordinatorDecision:
    return CoordinatorDecision(False, {}, 0, 0.0, kind, reason)
