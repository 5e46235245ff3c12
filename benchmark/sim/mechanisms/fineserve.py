"""FineServe (F1-F4) in the simulator: KV slab sharing between co-located
models of different precisions, placement (Alg. 1, Eq. 3), EDF adaptive
batching (Alg. 2), and the Prism-like / static baselines of FineServe §7.1.

* ``SlabPool`` -- one per GPU, over the KV memory the runner planned for the
  GPU's instances (GPU memory - weights - activation reserves).
  Mode ``shared`` (FineServe, Prism*): the memory is cut into uniform slabs of
  ``core.fineserve_policy.slab_bytes`` (smallest multiple of the LCM of
  the co-located models' KV block sizes that is >= ``min_slab_mb``) and
  managed by ``memory_ext.policy.slab_table.SlabTable`` (the paper's slab
  table, §5.2), keyed by instance: every block a request holds is placed in a
  slab formatted for its model (lowest partly used slab first), a slab goes
  back to FREE as soon as its last block is freed, and an instance's KV
  capacity is the slabs it holds. So a model keeps the free blocks of its
  partly used slabs (slab-internal fragmentation, ``stranded_bytes_*``) and
  no co-located model can use them; external fragmentation cannot arise (any
  FREE slab fits any block size). Each instance keeps enough slabs pinned for
  its longest possible request (the simulator rejects at arrival a request
  larger than the current capacity). Blocks are placed after every
  iteration; within one plan the instance's slab count is what bounds it.
  Mode ``static`` (Static*, FineServe §7.1): GPU memory is split once in
  proportion to each model's F_M (``footprint_gb``;
  ``core.fineserve_policy.static_partition``); each model's weights and
  activations come out of its share and the rest is a private pool of its
  own block size (no slabs; the free blocks of a partition are stranded
  too). ``block_tail_bytes_mean``: the unused tail of every running
  request's last block (block-internal fragmentation), in both modes.
* ``FineServeScheduler`` (kind ``fineserve``) -- stock iteration structure
  (decodes, continuing prefill chunks, then admission) whose admission is
  ``batching``: ``edf`` = ``core.fineserve_policy.adaptive_batch`` (Alg. 2) with a
  ``ChunkedPrefillModel`` fitted to this instance's roofline, N_max = free
  running slots, T_max = free KV tokens, and ``now`` shifted by the pending
  prefill work of admitted requests; dropped requests are rejected (they
  count as SLO misses). ``prism`` = deadline-ordered admission of every
  request that can still meet its deadline alone, not batch-aware (Prism*).
  ``fcfs`` = stock FCFS (Static*). Preempted requests (already past their
  first token) are re-admitted first, FCFS.
* Placement: ``fineserve_placement`` (Alg. 1 through
  ``core.fineserve_policy.place_with_pins`` -- with no pins exactly
  ``memory_ext.policy.placement.place_models`` -- on demands from ``model_demand``, the functions the
  router's placement shares: F_M = weights + activation reserve + KV at the
  smallest batch whose profiled throughput meets the rate (§6.2;
  ``smallest_batch_for_rate`` over ``profiled_throughput``), mu = 1 / KV
  bytes per token, the slope of FineServe Fig. 3) and ``prism_placement``
  (order by SLO-weighted rate ``rate / ttft_slo``, descending; each model
  goes to the GPU maximising remaining memory after weights+activations per
  unit of SLO-weighted rate, precision-agnostic).
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
from ..core.request import FINISHED, RUNNING, Request
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
    """The KV memory of one GPU's FineServe instances (see module docstring)."""

    def __init__(
        self, insts: list[Instance], mode: str, min_slab_mb: float, footprints: dict[int, float] | None = None
    ) -> None:
        from memory_ext.policy.slab_table import SlabTable

        from ..core.fineserve_policy import slab_bytes, static_partition

        if mode not in _KV_MODES:
            raise ValueError(f"kv must be one of {', '.join(_KV_MODES)}, got {mode!r}")
        self.mode = mode
        self.insts = insts
        self.block_bytes = {i.idx: int(round(i.cfg.kv_block_bytes)) for i in insts}
        sizes = [self.block_bytes[i.idx] for i in insts]
        self.slab = slab_bytes(sizes, int(min_slab_mb * (1 << 20)))
        self.bps = {i.idx: self.slab // self.block_bytes[i.idx] for i in insts}
        # the KV memory the runner planned for these instances (= GPU memory - weights - activations)
        self.total_bytes = sum(i.kv.capacity * self.block_bytes[i.idx] for i in insts)
        self.floor = {}
        for i in insts:
            longest = max((r.prompt_len + r.output_len for r in i.sim.requests if r.model == i.idx), default=1)
            self.floor[i.idx] = -(-longest // i.kv.block_size)
        self.table: SlabTable | None = None
        self.partition: dict[int, float] = {}
        self.blocks: dict[int, dict[int, tuple[Request, list[int]]]] = {i.idx: {} for i in insts}
        self.cache_blocks: dict[int, list[int]] = {i.idx: [] for i in insts}
        if mode == "static":
            # Static* (FineServe 7.1): GPU memory split in proportion to F_M; each
            # model's weights and activations come out of its own share, the rest
            # is a private pool of its own block size.
            fixed = {i.idx: i.cfg.model.weight_bytes(i.cfg.weight_dtype) + i.cfg.act_blocks * self.block_bytes[i.idx]
                     for i in insts}  # fmt: skip
            gpu_bytes = self.total_bytes + sum(fixed.values())
            fm = {str(i.idx): (footprints or {}).get(i.idx, 1.0) for i in insts}
            share = static_partition(gpu_bytes, fm)
            for i in insts:
                kv = share[str(i.idx)] - fixed[i.idx]
                blocks = int(kv // self.block_bytes[i.idx]) if kv > 0 else 0
                if blocks < self.floor[i.idx]:
                    raise ValueError(
                        f"static partition: {i.cfg.name} gets {kv / 1e9:.2f} GB of KV, less than its longest "
                        f"request ({self.floor[i.idx]} blocks)"
                    )
                self.partition[i.idx] = kv
                i.kv.resize(blocks)
            self.total_slabs = 0
            self.tail_bytes = sum(self.partition[i.idx] - i.kv.capacity * self.block_bytes[i.idx] for i in insts)
        else:
            self.total_slabs = int(self.total_bytes // self.slab)
            self.tail_bytes = self.total_bytes - self.total_slabs * self.slab
            self.table = SlabTable(self.total_slabs, self.slab)
            for i in insts:  # floor: slabs for the longest request, kept formatted
                pin = -(-self.floor[i.idx] // self.bps[i.idx])
                if pin > self.table.free_slabs:
                    raise ValueError("KV pool smaller than the co-located models' longest requests")
                self.table.pin(i.idx, self.block_bytes[i.idx], pin)
            for i in insts:
                i.kv.resize(self.table.held_slabs(i.idx) * self.bps[i.idx])
        self.max_held = {i.idx: self.held(i.idx) for i in insts}

    def held(self, idx: int) -> int:
        """Slabs formatted for instance ``idx`` (0 in static mode)."""
        return self.table.held_slabs(idx) if self.table is not None else 0

    @property
    def free_slabs(self) -> int:
        return self.table.free_slabs if self.table is not None else 0

    def ensure(self, inst: Instance, blocks: int) -> None:
        """Format whole slabs for ``inst`` until ``blocks`` are available (or no slab is FREE)."""
        if self.table is None:
            return
        short = blocks - inst.kv.available
        if short <= 0:
            return
        bps = self.bps[inst.idx]
        k = self.table.carve(inst.idx, self.block_bytes[inst.idx], -(-short // bps))
        if k > 0:
            inst.kv.resize(inst.kv.capacity + k * bps)
            self.max_held[inst.idx] = max(self.max_held[inst.idx], self.held(inst.idx))

    def sync(self, inst: Instance) -> int:
        """Place the blocks ``inst`` reserved since the last call in its slabs,
        take back those of finished / preempted requests (newest blocks first),
        return emptied slabs to FREE and shrink the instance to what it holds.
        Returns the tokens of the running requests' last, partly filled blocks
        (internal fragmentation of blocks; computed on the way)."""
        bs = inst.kv.block_size
        t = self.table
        if t is None:
            return sum((r.private_blocks + len(r.cached_keys)) * bs - r.ctx for r in inst.running)
        idx, size = inst.idx, self.block_bytes[inst.idx]
        recs = self.blocks[idx]
        cache = self.cache_blocks[idx]
        grow = []
        tail = 0
        for r in inst.running:
            want = r.private_blocks
            tail += (want + len(r.cached_keys)) * bs - r.ctx
            rec = recs.get(r.rid)
            if rec is None:
                rec = recs[r.rid] = (r, [])
            ids = rec[1]
            have = len(ids)
            if want > have:
                grow.append((ids, want - have))
            elif want < have:  # published into the prefix cache (still held), or dropped and re-admitted
                cache.extend(ids[want:])
                del ids[want:]
        if len(recs) > len(inst.running):
            for rid, (r, ids) in list(recs.items()):
                if r.state != RUNNING:  # finished or preempted: all its private blocks are free
                    if ids:
                        t.free(idx, ids, keep_empty=True)
                    del recs[rid]
        n_cached = len(inst.kv.refs)
        if len(cache) > n_cached:  # evicted or deduplicated cache blocks (oldest first)
            t.free(idx, cache[: len(cache) - n_cached], keep_empty=True)
            del cache[: len(cache) - n_cached]
        for ids, n in grow:
            # capacity only grows through ``ensure``, so the instance's slabs hold
            # these; another hook resizing the pool may need FREE slabs (or leave
            # blocks unplaced until a later call)
            got = t.alloc(idx, size, n, carve=False) or t.alloc(idx, size, n)
            if got is not None:
                ids.extend(got)
        t.release_empty(idx)
        inst.kv.resize(t.held_slabs(idx) * self.bps[idx])
        return tail

    def stranded_bytes(self, inst: Instance) -> int:
        """Free KV inside the slabs (shared) or the partition (static) of ``inst``:
        memory this model holds that no co-located model can use."""
        return (inst.kv.capacity - inst.kv.used) * self.block_bytes[inst.idx]

    def check(self) -> None:
        used = sum(i.kv.capacity * self.block_bytes[i.idx] for i in self.insts)
        assert used <= self.total_bytes + 1e-6, (used, self.total_bytes)
        if self.table is not None:
            self.table.check()
            assert self.table.num_slabs == self.total_slabs
            for i in self.insts:
                assert i.kv.capacity == self.table.held_slabs(i.idx) * self.bps[i.idx]
                placed = sum(len(ids) for _, ids in self.blocks[i.idx].values()) + len(self.cache_blocks[i.idx])
                assert placed == self.table.used_blocks(i.idx) <= i.kv.capacity


def slab_pool(inst: Instance) -> SlabPool | None:
    """The pool of ``inst``'s GPU (created on first use; None if not a FineServe instance)."""
    pools = getattr(inst.sim, "_fineserve_pools", None)
    if pools is None:
        pools = inst.sim._fineserve_pools = {}
    g = inst.cfg.gpu
    if g not in pools:
        insts = [i for i in inst.sim.instances if i.cfg.gpu == g and isinstance(i.scheduler, FineServeScheduler)]
        s = inst.scheduler
        pools[g] = SlabPool(insts, s.kv_mode, s.min_slab_mb, {i.idx: i.scheduler.footprint for i in insts})
    return pools[g]


# --------------------------------------------------------------------------- local scheduler


def _prefill_model(inst: Instance):
    """ChunkedPrefillModel fitted to the roofline: TTFT of T tokens in chunks of C."""
    from ..core.fineserve_policy import ChunkedPrefillModel

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
    (shared | static), ``min_slab_mb`` (2), ``footprint_gb`` (F_M in GB; the
    Static* partition needs it for every model of the GPU)."""

    def __init__(
        self,
        cfg: InstanceConfig,
        batching: str = "edf",
        kv: str = "shared",
        min_slab_mb: float = 2.0,
        footprint_gb: float | None = None,
    ) -> None:
        if batching not in _BATCHING:
            raise ValueError(f"batching must be one of {', '.join(_BATCHING)}, got {batching!r}")
        if kv not in _KV_MODES:
            raise ValueError(f"kv must be one of {', '.join(_KV_MODES)}, got {kv!r}")
        if batching != "fcfs" and not math.isfinite(cfg.ttft_slo_s):
            raise ValueError("edf/prism batching needs slo.ttft_s")
        self.name = cfg.name
        self.batching, self.kv_mode, self.min_slab_mb = batching, kv, float(min_slab_mb)
        if kv == "static" and footprint_gb is None:
            raise ValueError("kv: static needs footprint_gb (F_M, python -m benchmark.sim placement prints it)")
        if footprint_gb is not None and not (math.isfinite(footprint_gb) and footprint_gb > 0):
            raise ValueError(f"footprint_gb must be > 0, got {footprint_gb!r}")
        self.footprint = float(footprint_gb) * 1e9 if footprint_gb is not None else 1.0
        self.footprint_gb = footprint_gb
        # fragmentation accounting, weighted by iteration time
        self._t = 0.0
        self._stranded = 0.0
        self._stranded_max = 0
        self._tail = 0.0
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
        pool = self.pool
        tail = pool.sync(inst)
        stranded = pool.stranded_bytes(inst)
        bs = inst.kv.block_size
        self._t += duration
        self._stranded += stranded * duration
        self._stranded_max = max(self._stranded_max, stranded)
        self._tail += tail * inst.cfg.kv_block_bytes / bs * duration

    def _drop(self, inst: Instance, r: Request) -> None:
        inst.waiting.remove(r)
        r.state = FINISHED
        r.finish_t = None
        inst.sim.rejected.append(r.rid)
        self.dropped += 1

    def _candidates(self, inst: Instance, now: float, n_max: int, t_max: int) -> list[Request]:
        """Waiting requests to admit this iteration, in order."""
        from ..core.fineserve_policy import Request as FReq
        from ..core.fineserve_policy import adaptive_batch

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
        gauges: dict = {"footprint_gb": self.footprint_gb or 0.0, "min_slab_mb": self.min_slab_mb}
        pool = self.pool
        if pool is not None:
            i = self.idx
            t = max(self._t, 1e-12)
            gauges.update(
                {
                    "block_bytes": pool.block_bytes[i],
                    "slab_bytes": pool.slab if pool.mode == "shared" else 0,
                    "blocks_per_slab": pool.bps[i] if pool.mode == "shared" else 0,
                    "floor_blocks": pool.floor[i],
                    "slabs_held_final": pool.held(i),
                    "slabs_held_max": pool.max_held[i],
                    "gpu_slabs_total": pool.total_slabs,
                    "static_kv_bytes": pool.partition.get(i, 0.0),
                    # KV this model holds but does not use (no co-located model can):
                    # free blocks in its slabs (shared) or in its partition (static)
                    "stranded_bytes_mean": self._stranded / t,
                    "stranded_bytes_max": self._stranded_max,
                    # tokens of the last, partly filled block of each running request
                    "block_tail_bytes_mean": self._tail / t,
                    "gpu_tail_bytes": pool.tail_bytes,
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
    mu: float  # tokens per byte of KV (core.fineserve_policy.model_demand)
    slo_rate: float  # rate / ttft_slo (Prism's SLO-weighted rate)
    batch: int = 0  # profiled batch size the KV part of F_M is taken at
    rate_met: bool = True  # False: no batch <= max_running meets the rate (the paper would add DP replicas)
    kv_bytes_per_token: float = 0.0
    kv_tokens: float = 0.0

    @property
    def footprint(self) -> float:
        from ..core.fineserve_policy import base_footprint

        return base_footprint(self.weights, self.kv_bytes_per_token, self.kv_tokens, self.activations)

    def model_demand(self):
        """The ``ModelDemand`` Alg. 1 gets (the shared sizes -> demand function)."""
        from ..core.fineserve_policy import model_demand

        return model_demand(self.name, self.weights, self.kv_bytes_per_token, self.kv_tokens, self.activations)


def profiled_throughput(ms, gpu, m, mean_in: float, mean_out: float):
    """Requests/s a batch of b running requests completes, from the roofline
    (the simulator's "profile"): every iteration decodes b requests at the mean
    context (prompt + half the output) and carries the prompts of the requests
    that replace finished ones (b x mean_in / mean_out tokens per iteration,
    one chunked-prefill chunk); a request lives mean_out iterations."""
    rf = Roofline(ms, gpu, m.weight_dtype, m.kv_dtype, m.overhead_s)
    ctx = int(mean_in + mean_out / 2)
    out = max(mean_out, 1.0)

    def thr(b: int) -> float:
        s = BatchShape()
        s.tokens += b
        s.attn_pairs += b * (ctx + 1)
        s.kv_tokens += b * (ctx + 1)
        s.sampled += b
        pre = int(round(b * mean_in / out))
        if pre:
            s.add_prefill(0, pre, False)
        return b / (out * rf.iteration_time(s))

    return thr, ctx


def model_demands(spec: ScenarioSpec, rate_scale: float = 1.0) -> list[Demand]:
    """F_M parts, mu and SLO-weighted rate of every model of ``spec``.

    F_M (FineServe 6.2) = weights + activation reserve (what the runner
    charges) + KV at "the smallest batch size whose profiled throughput meets
    M's expected request rate" (``smallest_batch_for_rate`` over
    ``profiled_throughput``, at most ``max_running``): that batch x the mean
    context (prompt + output / 2) x KV bytes per token."""
    from ..core.fineserve_policy import smallest_batch_for_rate

    g = gpu_spec(spec.node.gpu)
    out = []
    for m in spec.models:
        ms = model_spec(m.model)
        wls = [w for w in spec.workloads if w.model == m.name]
        rate = sum(w.arrival.rate for w in wls) * rate_scale
        mean_in = sum(w.input.expected_mean() for w in wls) / max(len(wls), 1) if wls else 0.0
        mean_out = sum(w.output.expected_mean() for w in wls) / max(len(wls), 1) if wls else 0.0
        thr, ctx = profiled_throughput(ms, g, m, mean_in, mean_out)
        batch, met = smallest_batch_for_rate(rate, thr, m.max_running)
        per_tok = ms.kv_bytes_per_token(m.kv_dtype)
        tokens = batch * ctx if rate > 0 else 0.0
        act = ms.activation_bytes(
            m.max_batched_tokens if m.activation_tokens is None else m.activation_tokens, m.weight_dtype
        )
        out.append(
            Demand(
                m.name,
                ms.weight_bytes(m.weight_dtype),
                act,
                tokens * per_tok,
                1.0 / per_tok,
                rate / m.ttft_slo_s if math.isfinite(m.ttft_slo_s) else rate,
                batch,
                met,
                per_tok,
                tokens,
            )
        )
    return out


def _budget(spec: ScenarioSpec) -> float:
    return gpu_spec(spec.node.gpu).mem_bytes * spec.node.memory_fraction


def fineserve_placement(spec: ScenarioSpec, rate_scale: float = 1.0) -> dict[str, int]:
    """FineServe Alg. 1: model -> gpu. Goes through
    ``core.fineserve_policy.place_with_pins`` (no pins: exactly the router's
    ``place_models``) with demands from ``model_demand`` -- the functions the
    router's placement is to share (docs/simulation.md, FineServe)."""
    from memory_ext.policy.placement import GpuCandidate, PlacementInfeasible

    from ..core.fineserve_policy import place_with_pins

    ds = model_demands(spec, rate_scale)
    res = place_with_pins(
        [d.model_demand() for d in ds], [GpuCandidate(str(g), _budget(spec)) for g in range(spec.node.count)]
    )
    res.alg1.raise_if_infeasible()
    if res.overflow:  # pragma: no cover - no pins here
        raise PlacementInfeasible([o[0] for o in res.overflow])
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
