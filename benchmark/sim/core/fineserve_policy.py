"""FineServe decisions only the simulator makes (the server runs none of them).

Source: the FineServe paper, sections 5, 6.2, 6.3 (Algorithm 2) and 7.1. Stdlib plus the
shared policy modules of ``memory_ext.policy``; no simulator state.

F1  slab size of one GPU:  ``slab_bytes`` (LCM of the co-located block sizes)
F3  sizes to demands:      ``base_footprint``, ``model_demand``,
                           ``smallest_batch_for_rate``; pinned models + Alg. 1:
                           ``place_with_pins`` (Alg. 1 itself is the router's
                           ``memory_ext.policy.placement.place_models``)
Static* baseline (§7.1):   ``static_partition``
F4  local batching:        ``Request``, ``ChunkedPrefillModel``,
                           ``adaptive_batch`` (Algorithm 2, EDF)

Invariants: with no pins ``place_with_pins`` is exactly ``place_models``; an
``adaptive_batch`` batch meets every member's deadline under its predictor.
Readings of the paper where it is not explicit are marked "READING:".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from memory_ext.policy import placement
from memory_ext.policy._checks import check_int as _int
from memory_ext.policy._checks import check_name as _name
from memory_ext.policy._checks import check_num as _num
from memory_ext.policy.placement import GpuCandidate, ModelDemand, PlacementResult

__all__ = [
    "slab_bytes",
    "base_footprint",
    "model_demand",
    "smallest_batch_for_rate",
    "PinnedPlacement",
    "place_with_pins",
    "static_partition",
    "Request",
    "ChunkedPrefillModel",
    "BatchDecision",
    "adaptive_batch",
]


# --------------------------------------------------------- F1: slab numbers


def slab_bytes(block_sizes: Iterable[int], min_slab_bytes: int = 0) -> int:
    """Uniform slab size for one GPU.

    The paper: a multiple of the LCM of the co-located models' KV block sizes.
    READING: we take the *smallest* such multiple that is >= ``min_slab_bytes``
    (and at least one LCM).
    """
    sizes = list(block_sizes) if block_sizes is not None else []
    if not sizes:
        raise ValueError("block_sizes must name at least one block size")
    for i, s in enumerate(sizes):
        _int(f"block_sizes[{i}]", s, 1)
    _int("min_slab_bytes", min_slab_bytes, 0)
    lcm = 1
    for s in sizes:
        lcm = lcm * s // math.gcd(lcm, s)
    k = max(1, -(-min_slab_bytes // lcm))
    return k * lcm


# ------------------------------------- F3: sizes to demands, pinned models


def base_footprint(
    weight_bytes: float, kv_bytes_per_token: float, kv_tokens: float = 0.0, activation_bytes: float = 0.0
) -> float:
    """F_M (§6.2): weights + activations + the KV of ``kv_tokens`` tokens."""
    _num("weight_bytes", weight_bytes, 0.0)
    _num("kv_bytes_per_token", kv_bytes_per_token, 0.0, strict=True)
    _num("kv_tokens", kv_tokens, 0.0)
    _num("activation_bytes", activation_bytes, 0.0)
    return weight_bytes + activation_bytes + kv_tokens * kv_bytes_per_token


def model_demand(
    name: str,
    weight_bytes: float,
    kv_bytes_per_token: float,
    kv_tokens: float = 0.0,
    activation_bytes: float = 0.0,
) -> ModelDemand:
    """The ``ModelDemand`` of a model from its sizes: F_M = ``base_footprint``;
    mu = 1 / KV bytes per token (tokens a byte of extra KV holds).

    READING: mu is the slope of Fig. 3 (cached tokens per unit of KV memory),
    taken as the inverse of the token size; only its ratios between models
    matter to Alg. 1 (Eq. 3 is scale-invariant in mu).
    """
    fm = base_footprint(weight_bytes, kv_bytes_per_token, kv_tokens, activation_bytes)
    return ModelDemand(name, fm, 1.0 / kv_bytes_per_token)


def smallest_batch_for_rate(rate: float, throughput: Callable[[int], float], max_batch: int) -> tuple[int, bool]:
    """§6.2: "F_M is measured at the smallest batch size whose profiled
    throughput meets M's expected request rate". ``throughput(b)`` is the
    profiled request rate at batch b (non-decreasing in b). Returns (b, met);
    when no b <= ``max_batch`` meets ``rate``, (max_batch, False) -- the paper
    then adds DP replicas, which is the caller's decision.
    """
    _num("rate", rate, 0.0)
    _int("max_batch", max_batch, 1)
    if rate == 0:
        return 1, True
    if throughput(max_batch) < rate:
        return max_batch, False
    lo, hi = 1, max_batch  # throughput(hi) >= rate
    while lo < hi:
        mid = (lo + hi) // 2
        if throughput(mid) >= rate:
            hi = mid
        else:
            lo = mid + 1
    return lo, True


@dataclass(frozen=True)
class PinnedPlacement:
    assignment: dict[str, str]  # every model that found a device -> its device
    alg1: PlacementResult  # Alg. 1 over the unpinned models and what the pins left
    left: dict[str, float]  # device -> memory after the pinned models' F_M
    candidates: tuple[GpuCandidate, ...]  # what Alg. 1 was offered (devices with memory left)
    overflow: tuple[tuple[str, str, float], ...]  # pinned (model, device, memory it had) that did not fit

    @property
    def feasible(self) -> bool:
        return not self.overflow and self.alg1.feasible


def place_with_pins(
    models: Sequence[ModelDemand], devices: Sequence[GpuCandidate], pinned: Mapping[str, str] | None = None
) -> PinnedPlacement:
    """Placement of ``models`` on ``devices``: each model named in ``pinned``
    (model -> device) is charged its F_M on that device first, in ``models``
    order (a model that does not fit is listed in ``overflow`` and not
    charged); the others go through ``place_models`` (Alg. 1) over the
    devices with memory left, in ``devices`` order. With no pins this is
    exactly ``place_models(models, devices)``.
    """
    models = list(models)
    devices = list(devices)
    pinned = dict(pinned or {})
    names = {d.name for d in devices}
    for m, d in pinned.items():
        if d not in names:
            raise ValueError(f"pinned[{m!r}] names unknown device {d!r}")
    left = {d.name: d.total_memory for d in devices}
    assignment: dict[str, str] = {}
    overflow = []
    for m in models:
        dev = pinned.get(m.name)
        if dev is None:
            continue
        if m.base_footprint > left[dev]:
            overflow.append((m.name, dev, left[dev]))
            continue
        left[dev] -= m.base_footprint
        assignment[m.name] = dev
    free = [m for m in models if m.name not in pinned]
    candidates = tuple(GpuCandidate(d.name, left[d.name]) for d in devices if left[d.name] > 0)
    if free and candidates:
        alg1 = placement.place_models(free, candidates)  # looked up per call: tests spy on it
    else:
        order = tuple(m.name for m in sorted(free, key=lambda m: -m.base_footprint))
        alg1 = PlacementResult(order, {}, {}, {}, order)
    assignment.update(alg1.assignment)
    return PinnedPlacement(assignment, alg1, left, candidates, tuple(overflow))


# ---------------------------------------------------- Static* (§7.1)


def static_partition(total_memory: float, footprints: Mapping[str, float]) -> dict[str, float]:
    """Static* of §7.1: "GPU memory is statically partitioned per model,
    proportional to its required footprint (weights, activations, KV cache)".
    Returns model -> bytes of ``total_memory`` (each model's weights and
    activations come out of its own share; the rest of the share is its KV).
    """
    _num("total_memory", total_memory, 0.0)
    fs = {_name("footprints key", k): _num(f"footprints[{k!r}]", v, 0.0) for k, v in footprints.items()}
    if not fs:
        raise ValueError("footprints must name at least one model")
    tot = sum(fs.values())
    if tot <= 0:
        return {k: total_memory / len(fs) for k in fs}
    return {k: total_memory * v / tot for k, v in fs.items()}


# ------------------------------------------------- F4: local adaptive batch


@dataclass(frozen=True)
class Request:
    """A waiting request: ``arrival`` in seconds, ``prompt_tokens`` its
    prefill length (tokens still to prefill)."""

    rid: str
    arrival: float
    prompt_tokens: int

    def __post_init__(self):
        _name("rid", self.rid)
        _num("arrival", self.arrival)
        _int("prompt_tokens", self.prompt_tokens, 1)


@dataclass(frozen=True)
class ChunkedPrefillModel:
    """Linear chunked-prefill latency model (coefficients are profiled inputs).

    A batch's prompts (T tokens in all) are prefilled in chunks of at most
    ``chunk_tokens`` tokens; one chunk holding c tokens costs
    ``per_chunk_s + per_token_s * c``. Hence for a set R:

        TTFT(R) = ceil(T / chunk_tokens) * per_chunk_s + per_token_s * T
                  + per_request_s * |R|

    (``per_request_s`` is an optional per-request overhead, default 0.)
    TTFT of the empty set is 0.
    """

    chunk_tokens: int
    per_chunk_s: float
    per_token_s: float
    per_request_s: float = 0.0

    def __post_init__(self):
        _int("chunk_tokens", self.chunk_tokens, 1)
        _num("per_chunk_s", self.per_chunk_s, 0.0)
        _num("per_token_s", self.per_token_s, 0.0)
        _num("per_request_s", self.per_request_s, 0.0)

    def ttft(self, requests: Sequence[Request]) -> float:
        total = sum(r.prompt_tokens for r in requests)
        if total == 0:
            return 0.0
        chunks = -(-total // self.chunk_tokens)
        return chunks * self.per_chunk_s + self.per_token_s * total + self.per_request_s * len(requests)


@dataclass(frozen=True)
class BatchDecision:
    batch: tuple[Request, ...]  # S, in EDF order
    dropped: tuple[Request, ...]  # D: cannot meet deadline even alone
    removed_longest: tuple[Request, ...]  # taken out by lines 12-15 (stay waiting)
    trimmed: tuple[Request, ...]  # cut by N_max / T_max (stay waiting)
    remaining: tuple[Request, ...]  # W after the call, original order
    predicted_finish: float  # t + TTFT(batch); t when batch empty
    deadlines: dict[str, float]  # rid -> d_r


def adaptive_batch(
    waiting: Sequence[Request], now: float, slo: float, n_max: int, t_max: int, predictor: ChunkedPrefillModel
) -> BatchDecision:
    """Algorithm 2 (SLO-aware adaptive batching) for one model's queue.

    1. d_r = arrival + slo; drop r unless now + TTFT({r}) < d_r (strict, as
       in the paper).
    2. Sort survivors by d_r (EDF; ties by arrival, then queue order).
    3. While now + TTFT(S) >= d of S's front, remove the longest request.
       READING: "longest" = most prompt tokens (largest prefill cost); ties
       go to the later one in EDF order. The anchor itself may be removed.
    4. trim(S, N_max, T_max). READING: keep the longest EDF prefix with at
       most N_max requests and at most T_max prompt tokens; the first request
       that does not fit ends the batch (no later request jumps ahead of it).
    Trimming only shrinks S, so TTFT(S) keeps meeting every member's deadline.
    """
    _num("now", now)
    _num("slo", slo, 0.0, strict=True)
    _int("n_max", n_max, 1)
    _int("t_max", t_max, 1)
    if not isinstance(predictor, ChunkedPrefillModel):
        raise ValueError(f"predictor must be a ChunkedPrefillModel, got {predictor!r}")
    waiting = list(waiting)
    for r in waiting:
        if not isinstance(r, Request):
            raise ValueError(f"waiting must hold Request, got {r!r}")
    if len({r.rid for r in waiting}) != len(waiting):
        raise ValueError("waiting rid values must be unique")

    deadline = {r.rid: r.arrival + slo for r in waiting}
    pos = {r.rid: i for i, r in enumerate(waiting)}

    kept, dropped = [], []
    for r in waiting:
        (kept if now + predictor.ttft([r]) < deadline[r.rid] else dropped).append(r)

    s = sorted(kept, key=lambda r: (deadline[r.rid], r.arrival, pos[r.rid]))

    removed = []
    while s and not now + predictor.ttft(s) < deadline[s[0].rid]:
        longest = max(range(len(s)), key=lambda i: (s[i].prompt_tokens, i))
        removed.append(s.pop(longest))

    batch, trimmed, tokens = [], [], 0
    for i, r in enumerate(s):
        if len(batch) < n_max and tokens + r.prompt_tokens <= t_max:
            batch.append(r)
            tokens += r.prompt_tokens
        else:
            trimmed = s[i:]
            break

    gone = {r.rid for r in dropped} | {r.rid for r in batch}
    return BatchDecision(
        batch=tuple(batch),
        dropped=tuple(dropped),
        removed_longest=tuple(removed),
        trimmed=tuple(trimmed),
        remaining=tuple(r for r in waiting if r.rid not in gone),
        predicted_finish=now + predictor.ttft(batch),
        deadlines=deadline,
    )
