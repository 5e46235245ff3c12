"""FineServe (F1-F4) in the simulator: KV slab sharing between co-located
models of different precisions, placement (Alg. 1, Eq. 3), EDF adaptive
batching (Alg. 2), and the Prism-like / static baselines of FineServe §7.1.

* ``SlabPool`` -- one per GPU. The KV memory the runner planned for the
  GPU's instances is pooled and cut into uniform slabs of
  ``memory_ext.policy.fineserve.slab_bytes`` (smallest multiple of the LCM of
  the co-located models' KV block sizes that is >= ``min_slab_mb``). Each
  instance keeps a floor of blocks for its longest possible request (the
  simulator rejects at arrival a request larger than the current capacity)
  and grows by whole slabs on demand; fully free slabs beyond one of
  headroom go back after every iteration. Mode ``static`` (Static*) splits
  the same pool once, proportionally to the models' base footprints F_M.
  Approximation: blocks are counted, not placed, so a slab is returned as
  soon as a slab's worth of blocks is free (perfect compaction).
* ``FineServeScheduler`` (kind ``fineserve``) -- stock iteration structure
  (decodes, continuing prefill chunks, then admission) whose admission is
  ``batching``: ``edf`` = ``fineserve.adaptive_batch`` (Alg. 2) with a
  ``ChunkedPrefillModel`` fitted to this instance's roofline, N_max = free
  running slots, T_max = free KV tokens, and ``now`` shifted by the pending
  prefill work of admitted requests; dropped requests are rejected (they
  count as SLO misses). ``prism`` = deadline-ordered admission of every
  request that can still meet its deadline alone, not batch-aware (Prism*).
  ``fcfs`` = stock FCFS (Static*). Preempted requests (already past their
  first token) are re-admitted first, FCFS.
* Placement: ``fineserve_placement`` (``place_models`` with F_M = weights +
  activation reserve + Little's-law average KV, mu = tokens per GB of KV,
  i.e. 1 / KV bytes per token -- the slope of FineServe Fig. 3) and
  ``prism_placement`` (order by SLO-weighted rate ``rate / ttft_slo``,
  descending; each model goes to the GPU maximising remaining memory after
  weights+activations per unit of SLO-weighted rate, precision-agnostic).
  ``python -m benchmark.sim placement <scenario>`` prints both; the
  scenario file records them in its variants and ``test_sim_fineserve.py``
  checks that they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.hardware import gpu_spec
from ..core.models import model_spec
from ..core.plan import BatchPlan
from ..core.request import FINISHED, Request
from ..core.roofline import BatchShape, Roofline
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance, InstanceConfig
    from ..core.spec import ScenarioSpec

__all__ = [
    "SlabPool",
    "FineServeScheduler",
    "model_demands",
    "fineserve_placement",
    "prism_placement",
    "prefill_slo",
    "slab_pool",
]

_BATCHING = ("edf", "prism", "fcfs")
_KV_MODES = ("shared", "static")


# --------------------------------------------------------------------------- KV slab


class SlabPool:
    """Shared KV memory of one GPU, in slabs (see module docstring)."""

    def __init__(
        self, insts: list[Instance], mode: str, min_slab_mb: float, weights: dict[int, float] | None = None
    ) -> None:
        from memory_ext.policy.fineserve import blocks_per_slab, slab_bytes

        if mode not in _KV_MODES:
            raise ValueError(f"kv must be one of {', '.join(_KV_MODES)}, got {mode!r}")
        self.mode = mode
        self.insts = insts
        sizes = [int(round(i.cfg.kv_block_bytes)) for i in insts]
        self.slab = slab_bytes(sizes, int(min_slab_mb * (1 << 20)))
        self.bps = {i.idx: blocks_per_slab(self.slab, s) for i, s in zip(insts, sizes)}
        self.total_bytes = sum(i.kv.capacity * s for i, s in zip(insts, sizes))
        self.floor = {}
        for i in insts:
            longest = max((r.prompt_len + r.output_len for r in i.sim.requests if r.model == i.idx), default=1)
            self.floor[i.idx] = -(-longest // i.kv.block_size)
        floor_bytes = sum(self.floor[i.idx] * s for i, s in zip(insts, sizes))
        self.total_slabs = int((self.total_bytes - floor_bytes) // self.slab)
        if self.total_slabs < 0:
            raise ValueError("KV pool smaller than the co-located models' longest requests")
        self.held = {i.idx: 0 for i in insts}
        if mode == "static":
            w = weights or {i.idx: 1.0 for i in insts}
            tot = sum(w[i.idx] for i in insts)
            for i in insts:
                self.held[i.idx] = int(self.total_slabs * w[i.idx] / tot)
        for i in insts:
            i.kv.resize(self.floor[i.idx] + self.held[i.idx] * self.bps[i.idx])
        self.max_held = dict(self.held)

    @property
    def free_slabs(self) -> int:
        return self.total_slabs - sum(self.held.values())

    def ensure(self, inst: Instance, blocks: int) -> None:
        """Grow ``inst`` by whole slabs until ``blocks`` are available (or the pool is empty)."""
        if self.mode != "shared":
            return
        short = blocks - inst.kv.available
        if short <= 0:
            return
        bps = self.bps[inst.idx]
        k = min(-(-short // bps), self.free_slabs)
        if k > 0:
            self.held[inst.idx] += k
            self.max_held[inst.idx] = max(self.max_held[inst.idx], self.held[inst.idx])
            inst.kv.resize(inst.kv.capacity + k * bps)

    def trim(self, inst: Instance) -> None:
        """Return fully free slabs beyond one slab of headroom."""
        if self.mode != "shared":
            return
        bps = self.bps[inst.idx]
        k = min((inst.kv.available - bps) // bps, self.held[inst.idx])
        if k > 0:
            got = inst.kv.resize(inst.kv.capacity - k * bps)
            k = (self.floor[inst.idx] + self.held[inst.idx] * bps - got) // bps
            self.held[inst.idx] -= k

    def check(self) -> None:
        assert 0 <= sum(self.held.values()) <= self.total_slabs
        used = sum(i.kv.capacity * i.cfg.kv_block_bytes for i in self.insts)
        assert used <= self.total_bytes + 1e-6, (used, self.total_bytes)


def slab_pool(inst: Instance) -> SlabPool | None:
    """The pool of ``inst``'s GPU (created on first use; None if not a FineServe instance)."""
    pools = getattr(inst.sim, "_fineserve_pools", None)
    if pools is None:
        pools = inst.sim._fineserve_pools = {}
    g = inst.cfg.gpu
    if g not in pools:
        insts = [i for i in inst.sim.instances if i.cfg.gpu == g and isinstance(i.scheduler, FineServeScheduler)]
        s = inst.scheduler
        pools[g] = SlabPool(insts, s.kv_mode, s.min_slab_mb, {i.idx: i.scheduler.weight for i in insts})
    return pools[g]


# --------------------------------------------------------------------------- local scheduler


def _prefill_model(inst: Instance):
    """ChunkedPrefillModel fitted to the roofline: TTFT of T tokens in chunks of C."""
    from memory_ext.policy.fineserve import ChunkedPrefillModel

    c = inst.cfg.max_batched_tokens

    def t(n: int) -> float:
        s = BatchShape()
        s.add_prefill(0, n, True)
        return inst.roofline.iteration_time(s)

    half = max(c // 2, 1)
    per_tok = max((t(c) - t(half)) / max(c - half, 1), 0.0)
    return ChunkedPrefillModel(c, max(t(c) - per_tok * c, 0.0), per_tok)


class FineServeScheduler:
    """See module docstring. Options: ``batching`` (edf | prism | fcfs), ``kv``
    (shared | static), ``min_slab_mb`` (2), ``weight`` (F_M share for static)."""

    def __init__(
        self,
        cfg: InstanceConfig,
        batching: str = "edf",
        kv: str = "shared",
        min_slab_mb: float = 2.0,
        weight: float = 1.0,
    ) -> None:
        if batching not in _BATCHING:
            raise ValueError(f"batching must be one of {', '.join(_BATCHING)}, got {batching!r}")
        if kv not in _KV_MODES:
            raise ValueError(f"kv must be one of {', '.join(_KV_MODES)}, got {kv!r}")
        if batching != "fcfs" and not math.isfinite(cfg.ttft_slo_s):
            raise ValueError("edf/prism batching needs slo.ttft_s")
        self.name = cfg.name
        self.batching, self.kv_mode, self.min_slab_mb = batching, kv, float(min_slab_mb)
        self.weight = float(weight)
        self.slo = cfg.ttft_slo_s
        self.pool: SlabPool | None = None
        self.idx = -1
        self.predictor = None
        self.dropped = 0
        self._req: dict[int, object] = {}
        self._hooked = False

    # hook part: give back free slabs after every iteration
    def before_iteration(self, inst, plan, now) -> None:
        pass

    def after_iteration(self, inst, plan, now, duration) -> None:
        self.pool.trim(inst)

    def _drop(self, inst: Instance, r: Request) -> None:
        inst.waiting.remove(r)
        r.state = FINISHED
        r.finish_t = None
        inst.sim.rejected.append(r.rid)
        self.dropped += 1

    def _candidates(self, inst: Instance, now: float, n_max: int, t_max: int) -> list[Request]:
        """Waiting requests to admit this iteration, in order."""
        from memory_ext.policy.fineserve import Request as FReq
        from memory_ext.policy.fineserve import adaptive_batch

        fresh = [r for r in inst.waiting if r.first_token_t is None]
        again = [r for r in inst.waiting if r.first_token_t is not None]  # preempted: FCFS first
        if self.batching == "fcfs" or not fresh:
            return list(inst.waiting)
        # prefill work already admitted but not done delays everything new
        pending = sum(r.target - r.ctx for r in inst.running if not r.decoding)
        t0 = now + (self.predictor.ttft([FReq("p", 0.0, pending)]) if pending else 0.0)
        cache = self._req
        freqs = []
        for r in fresh:
            f = cache.get(r.rid)
            if f is None:
                f = cache[r.rid] = FReq(str(r.rid), r.arrival, r.target)
            freqs.append(f)
        by = {str(r.rid): r for r in fresh}
        if self.batching == "edf":
            d = adaptive_batch(freqs, t0, self.slo, max(n_max, 1), max(t_max, 1), self.predictor)
            drop, take = d.dropped, d.batch
        else:  # prism: per-request deadline check, EDF order, no batch-aware trimming
            ok = [f for f in freqs if t0 + self.predictor.ttft([f]) < f.arrival + self.slo]
            drop = [f for f in freqs if not t0 + self.predictor.ttft([f]) < f.arrival + self.slo]
            ok.sort(key=lambda f: f.arrival)
            take, tok = [], 0
            for f in ok:
                if len(take) >= n_max or tok + f.prompt_tokens > t_max:
                    break
                take.append(f)
                tok += f.prompt_tokens
        for f in drop:
            self._drop(inst, by[f.rid])
            cache.pop(by[f.rid].rid, None)
        return again + [by[f.rid] for f in take]

    def plan(self, inst: Instance, now: float) -> BatchPlan:
        if not self._hooked:
            self.idx = inst.idx
            self.pool = slab_pool(inst)
            self.predictor = _prefill_model(inst)
            inst.hooks.append(self)
            self._hooked = True
        pool, kv, cfg = self.pool, inst.kv, inst.cfg
        bs = kv.block_size
        budget = cfg.max_batched_tokens
        plan = BatchPlan()
        # 1. decodes (a new block when the last one is full), preempt latest if stuck
        while True:
            decodes = [r for r in inst.running if r.decoding]
            need = sum(1 for r in decodes if r.ctx % bs == 0)
            pool.ensure(inst, need)
            if need <= kv.available:
                break
            inst.preempt(inst.running[-1])
        decodes = decodes[:budget]
        for r in decodes:
            if r.ctx % bs == 0:
                inst.reserve(r, 1)
        plan.decodes = decodes
        budget -= len(decodes)
        # 2. continuing prefill chunks
        for r in inst.running:
            if budget <= 0:
                break
            if r.decoding:
                continue
            chunk = min(r.target - r.ctx, budget)
            pool.ensure(inst, inst.blocks_needed(r, chunk))
            if not inst.reserve(r, chunk):
                break
            plan.prefills.append((r, chunk))
            budget -= chunk
        # 3. admission
        slots = cfg.max_running - len(inst.running)
        if budget > 0 and inst.waiting and slots > 0:
            free_tokens = (kv.available + (pool.free_slabs * pool.bps[inst.idx] if pool.mode == "shared" else 0)) * bs
            for r in self._candidates(inst, now, slots, free_tokens):
                if budget <= 0 or len(inst.running) >= cfg.max_running:
                    break
                inst.waiting.remove(r)
                inst.admit(r, now)
                chunk = min(r.target - r.ctx, budget)
                pool.ensure(inst, inst.blocks_needed(r, chunk))
                if not inst.reserve(r, chunk):
                    inst.unadmit(r)  # back to the head; stop admitting this iteration
                    break
                plan.prefills.append((r, chunk))
                budget -= chunk
        return plan

    def stats(self) -> dict:
        """Common shape (``core.stats``); slab figures are this instance's share of its GPU's pool."""
        gauges: dict = {"weight": self.weight, "min_slab_mb": self.min_slab_mb}
        pool = self.pool
        if pool is not None:
            i = self.idx
            gauges.update(
                {
                    "slab_bytes": pool.slab,
                    "blocks_per_slab": pool.bps[i],
                    "floor_blocks": pool.floor[i],
                    "slabs_held_final": pool.held[i],
                    "slabs_held_max": pool.max_held[i],
                    "gpu_slabs_total": pool.total_slabs,
                }
            )
        return mechanism_stats(
            "fineserve",
            "fineserve",
            self.name,
            {"dropped_requests": self.dropped},
            gauges,
            {"batching": self.batching, "kv": self.kv_mode},
        )


# --------------------------------------------------------------------------- placement


def prefill_slo(
    model: str, gpu: str, weight_dtype: str, kv_dtype: str, tokens: int, scale: float, chunk: int = 2048
) -> float:
    """``scale`` x the uncontended prefill latency of ``tokens`` prompt tokens
    (FineServe §7.1: SLO = scale x P95 prefill latency of ShareGPT)."""
    rf = Roofline(model_spec(model), gpu_spec(gpu), weight_dtype, kv_dtype)
    t, done = 0.0, 0
    while done < tokens:
        c = min(chunk, tokens - done)
        s = BatchShape()
        s.add_prefill(done, c, done + c >= tokens)
        t += rf.iteration_time(s)
        done += c
    return scale * t


@dataclass
class Demand:
    name: str
    weights: float
    activations: float
    kv_base: float
    mu: float  # tokens per GB of KV
    slo_rate: float  # rate / ttft_slo (Prism's SLO-weighted rate)

    @property
    def footprint(self) -> float:
        return self.weights + self.activations + self.kv_base


def model_demands(spec: ScenarioSpec, rate_scale: float = 1.0) -> list[Demand]:
    """F_M parts, mu and SLO-weighted rate of every model of ``spec``.
    Average KV by Little's law: rate x (mean output x TPOT at batch 1) x
    (mean prompt + mean output / 2) tokens."""
    g = gpu_spec(spec.node.gpu)
    out = []
    for m in spec.models:
        ms = model_spec(m.model)
        wls = [w for w in spec.workloads if w.model == m.name]
        rate = sum(w.arrival.rate for w in wls) * rate_scale
        mean_in = sum(w.input.expected_mean() for w in wls) / max(len(wls), 1) if wls else 0.0
        mean_out = sum(w.output.expected_mean() for w in wls) / max(len(wls), 1) if wls else 0.0
        ctx = int(mean_in + mean_out / 2)
        s = BatchShape()
        s.add_decode(ctx)
        tpot = Roofline(ms, g, m.weight_dtype, m.kv_dtype, m.overhead_s).iteration_time(s)
        per_tok = ms.kv_bytes_per_token(m.kv_dtype)
        kv_base = rate * mean_out * tpot * (mean_in + mean_out / 2) * per_tok
        act = ms.activation_bytes(
            m.max_batched_tokens if m.activation_tokens is None else m.activation_tokens, m.weight_dtype
        )
        out.append(
            Demand(
                m.name,
                ms.weight_bytes(m.weight_dtype),
                act,
                kv_base,
                1e9 / per_tok,
                rate / m.ttft_slo_s if math.isfinite(m.ttft_slo_s) else rate,
            )
        )
    return out


def _budget(spec: ScenarioSpec) -> float:
    return gpu_spec(spec.node.gpu).mem_bytes * spec.node.memory_fraction


def fineserve_placement(spec: ScenarioSpec, rate_scale: float = 1.0) -> dict[str, int]:
    """FineServe Alg. 1 via ``memory_ext.policy.fineserve.place_models``: model -> gpu."""
    from memory_ext.policy.fineserve import GpuCandidate, ModelDemand, place_models

    ds = model_demands(spec, rate_scale)
    res = place_models(
        [ModelDemand(d.name, d.footprint, d.mu) for d in ds],
        [GpuCandidate(str(g), _budget(spec)) for g in range(spec.node.count)],
    )
    res.raise_if_infeasible()
    return {n: int(g) for n, g in res.assignment.items()}


def prism_placement(spec: ScenarioSpec, rate_scale: float = 1.0) -> dict[str, int]:
    """Prism-like heuristic (see module docstring): model -> gpu."""
    ds = model_demands(spec, rate_scale)
    budget = _budget(spec)
    residents: dict[int, list[Demand]] = {g: [] for g in range(spec.node.count)}
    out = {}
    for d in sorted(ds, key=lambda d: -d.slo_rate):
        best, best_score = None, -math.inf
        for g, res in residents.items():
            rem = budget - sum(x.weights + x.activations for x in res) - d.weights - d.activations
            if rem < 0:
                continue
            score = rem / (sum(x.slo_rate for x in res) + d.slo_rate)
            if score > best_score:
                best, best_score = g, score
        if best is None:
            raise ValueError(f"prism placement: {d.name} fits on no GPU")
        residents[best].append(d)
        out[d.name] = best
    return out
