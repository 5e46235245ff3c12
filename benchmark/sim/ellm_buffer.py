"""eLLM with its CPU elastic buffer (E3) and Alg. 2 logical buffer scaling.

Scheduler kind ``ellm_elastic`` (registered on import; ``benchmark.sim``
imports this module). It extends ``EllmScheduler`` (Alg. 1 with intra-GPU
inflation) with the GPU-CPU elasticity of eLLM §4.3.2 / §4.4.2:

* **Offload.** When Alg. 1 admits a prefill whose KV does not fit on the GPU
  but fits in the available CPU buffer ``P_B``, the prefill runs with no GPU KV
  reserved and its whole KV (``prompt tokens x kv_bytes_per_token``) is moved
  over ``d2h:<gpu>`` during the same iteration (layer-wise pipelining: the
  transfer overlaps the prefill compute, iteration = max(compute, transfer)).
  The request then decodes only after a fetch.
* **Fetch.** In a decode iteration, an offloaded request that Alg. 1 admits
  gets all its KV blocks reserved on the GPU and its KV is moved back over
  ``h2d:<gpu>`` in that iteration; its CPU-buffer chunks are released.
* **Alg. 2.** ``memory_ext.policy.ellm.LogicalBufferScaler`` (α = 2, a
  violation = 3 misses in the last 5 iterations, logical size initialised to
  1 chunk) sets ``P_B = logical - used`` each iteration. It observes, after
  every iteration, one TTFT sample and one TPOT sample (readings below).

Readings (documented in docs/simulation.md):

* One eLLM chunk = one KV block of the instance (as in ``EllmScheduler``).
* TTFT sample of an iteration = the largest of (a) TTFT of requests that got
  their first token in it and (b) the age of the oldest waiting request (its
  TTFT is already at least that). None when both are absent.
* TPOT sample = the largest *projected* TPOT among requests that decoded in
  the iteration and the request parked longest in the CPU buffer: ``(now - first token +
  remaining tokens x last decode iteration time) / (output - 1)`` -- the SLO is
  on per-request average TPOT (eLLM §6.1), so parking time counts in full.
* Decode queue order for Alg. 1: requests whose KV is on the GPU first
  (admission order), then parked requests (admission order). FCFS over the
  raw admission order would let one parked request that does not fit block
  every resident decode behind it (Alg. 1's ``break``).
* The escape hatch when nothing fits preempts the latest request that holds
  GPU KV (a parked request frees no GPU memory).
* Requires ``prefix_caching: false`` when the buffer is on (an offloaded
  request holds no GPU blocks to publish); eLLM is built on vLLM 0.5.5,
  whose prefix caching is off by default.

Host memory capacity is ``cpu_buffer_gb`` (B_max); link latency is not
modelled (``links.py``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from .plan import BatchPlan
from .request import RUNNING, Request
from .schedulers import SCHEDULERS, EllmScheduler, register_scheduler

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Instance, InstanceConfig

__all__ = ["EllmElasticScheduler"]


class EllmElasticScheduler(EllmScheduler):
    """Alg. 1 + CPU elastic buffer + Alg. 2 (see module docstring).

    Options: ``cpu_buffer_gb`` (B_max, 0 = no buffer), ``buffer_scaling``
    (Alg. 2 on; off = the whole physical buffer is always usable),
    ``alpha``, ``window``, ``misses`` (Alg. 2), ``initial_buffer_blocks``
    (paper: 1), ``threshold_chunks`` (θ of Alg. 1)."""

    def __init__(
        self,
        cfg: InstanceConfig,
        threshold_chunks: int = 0,
        cpu_buffer_gb: float = 0.0,
        buffer_scaling: bool = True,
        alpha: float = 2.0,
        window: int = 5,
        misses: int = 3,
        initial_buffer_blocks: int = 1,
    ) -> None:
        from memory_ext.policy.ellm import LogicalBufferScaler

        if isinstance(cpu_buffer_gb, bool) or not isinstance(cpu_buffer_gb, (int, float)) or cpu_buffer_gb < 0:
            raise ValueError(f"cpu_buffer_gb must be a number >= 0, got {cpu_buffer_gb!r}")
        if not isinstance(buffer_scaling, bool):
            raise ValueError(f"buffer_scaling must be true or false, got {buffer_scaling!r}")
        b_max = int(cpu_buffer_gb * 1e9 // cfg.kv_block_bytes)
        if b_max > 0 and cfg.prefix_caching:
            raise ValueError("the CPU buffer needs prefix_caching: false (offloaded requests hold no GPU blocks)")
        super().__init__(cfg, threshold_chunks=threshold_chunks, cpu_buffer_blocks=b_max)
        # same policy, memoised activation function (pure in the token count)
        self.policy = type(self.policy)(functools.lru_cache(maxsize=None)(self.act_chunks), threshold_chunks)
        self._dreq: dict[int, tuple] = {}  # rid -> (new, parked, DecodeRequest): frozen, reused
        self.b_max = b_max
        self.scaler: LogicalBufferScaler | None = None
        if b_max > 0 and buffer_scaling:
            self.scaler = LogicalBufferScaler(
                max_chunks=b_max,
                alpha=alpha,
                window=window,
                misses_to_violate=misses,
                initial_chunks=min(max(int(initial_buffer_blocks), 1), b_max),
                ttft_slo=cfg.ttft_slo_s if math.isfinite(cfg.ttft_slo_s) else None,
                tpot_slo=cfg.tpot_slo_s if math.isfinite(cfg.tpot_slo_s) else None,
            )
        self.block_bytes = cfg.kv_block_bytes
        self.token_bytes = cfg.model.kv_bytes_per_token(cfg.kv_dtype)
        self.parked: dict[int, Request] = {}  # rid -> request whose KV is in the CPU buffer
        self.parked_blocks: dict[int, int] = {}
        self.cpu_used = 0
        self._hooked = False
        self._last_decode_s = 0.0
        # statistics
        self.offloads = self.fetches = 0
        self.offload_bytes = self.fetch_bytes = 0.0
        self.max_cpu_used = 0
        self.events = {"ttft": 0, "tpot": 0}
        self.logical_trace = []  # (time, logical blocks) whenever it changes

    # ---- bookkeeping --------------------------------------------------------
    def _sync(self) -> None:
        """Release buffer space of parked requests that left (finished at
        prefill with one output token, or were preempted)."""
        for rid in [rid for rid, r in self.parked.items() if r.state != RUNNING or not r.decoding]:
            self.cpu_used -= self.parked_blocks.pop(rid)
            del self.parked[rid]

    def buffer_free(self) -> int:
        """Alg. 1's ``P_B``."""
        if self.b_max <= 0:
            return 0
        if self.scaler is not None:
            return self.scaler.available(self.cpu_used)
        return max(self.b_max - self.cpu_used, 0)

    # ---- Alg. 1 with offload / fetch ----------------------------------------
    def plan(self, inst: Instance, now: float) -> BatchPlan:
        if not self._hooked:
            inst.hooks.append(self)  # Alg. 2 observes every iteration
            self._hooked = True
        self._sync()
        kv = inst.kv
        bs = kv.block_size
        gpu = inst.cfg.gpu
        resident = [r for r in inst.running if r.decoding and r.rid not in self.parked]
        # parked requests in admission order; Alg. 1 stops at the first that does not
        # fit, so only those within the GPU budget (plus one) can matter
        room = kv.available + self.act_total - self.lent
        parked = []
        for rid, r in self.parked.items():
            if room < 0:
                break
            if r.decoding:
                parked.append(r)
                room -= self.parked_blocks[rid]
        decodes = resident + parked
        prefills = list(inst.waiting)[:64]
        if not decodes and not prefills:
            return BatchPlan()
        p_reqs = [self._Prefill(str(r.rid), r.target, -(-r.target // bs)) for r in prefills]
        d_reqs = []
        cache, pb = self._dreq, self.parked_blocks
        for r in decodes:
            new, off = (1 if r.ctx % bs == 0 else 0), pb.get(r.rid, 0)
            c = cache.get(r.rid)
            if c is None or c[0] != new or c[1] != off:
                c = cache[r.rid] = (new, off, self._Decode(str(r.rid), new, off))
            d_reqs.append(c[2])
        if len(cache) > 4 * len(inst.running) + 1024:  # forget finished requests
            live = {r.rid for r in inst.running}
            self._dreq = {k: v for k, v in cache.items() if k in live}
        d = self._decide_and_inflate(kv, p_reqs, d_reqs, self.buffer_free(), inst)
        plan = BatchPlan()
        admitted = set(d.admitted)
        if d.phase == "prefill":
            offloaded = set(d.offloaded)
            for r in prefills:
                rid = str(r.rid)
                if rid not in admitted:
                    break
                inst.waiting.popleft()
                inst.admit(r, now)
                chunk = r.target - r.ctx
                if rid in offloaded:
                    blocks = -(-r.target // bs)
                    self.parked[r.rid] = r
                    self.parked_blocks[r.rid] = blocks
                    self.cpu_used += blocks
                    self.max_cpu_used = max(self.max_cpu_used, self.cpu_used)
                    nbytes = r.target * self.token_bytes
                    plan.transfers.append((f"d2h:{gpu}", nbytes))
                    self.offloads += 1
                    self.offload_bytes += nbytes
                elif not inst.reserve(r, chunk):
                    inst.unadmit(r)
                    break
                plan.prefills.append((r, chunk))
        else:
            for r in decodes:
                if str(r.rid) not in admitted or not inst.reserve(r, 1):
                    continue
                plan.decodes.append(r)
                if r.rid in self.parked:  # fetch back before its first decode
                    del self.parked[r.rid]
                    self.cpu_used -= self.parked_blocks.pop(r.rid)
                    nbytes = r.ctx * self.token_bytes
                    plan.transfers.append((f"h2d:{gpu}", nbytes))
                    self.fetches += 1
                    self.fetch_bytes += nbytes
            if not plan and decodes and not inst.in_iteration:
                holders = [r for r in inst.running if r.private_blocks or r.cached_keys]
                inst.preempt(holders[-1] if holders else inst.running[-1])
                return self.plan(inst, now)
        return plan

    # ---- Alg. 2: observe each iteration (InstanceHook) ------------------------
    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        pass

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        if self.scaler is None:
            return
        ttft: float | None = None
        for r, _ in plan.prefills:
            if r.first_token_t == now:
                ttft = max(ttft or 0.0, now - r.arrival)
        if inst.waiting:
            ttft = max(ttft or 0.0, now - inst.waiting[0].arrival)
        if plan.decodes:
            self._last_decode_s = duration
        step = self._last_decode_s
        tpot: float | None = None
        oldest = next(iter(self.parked.values()), None)  # parked longest (insertion order)
        for group in (plan.decodes, (oldest,) if oldest is not None else ()):
            for r in group:
                if r.output_len <= 1 or r.first_token_t is None or r.state != RUNNING:
                    continue
                proj = (now - r.first_token_t + (r.output_len - r.generated) * step) / (r.output_len - 1)
                tpot = proj if tpot is None else max(tpot, proj)
        if self.scaler.ttft_slo is None:
            ttft = None
        if self.scaler.tpot_slo is None:
            tpot = None
        dec = self.scaler.observe(ttft=ttft, tpot=tpot)
        if dec.event:
            self.events[dec.event] += 1
        if dec.changed:
            self.logical_trace.append((now, dec.logical_chunks))

    def stats(self) -> dict:
        return {
            "offloads": self.offloads,
            "fetches": self.fetches,
            "offload_gb": self.offload_bytes / 1e9,
            "fetch_gb": self.fetch_bytes / 1e9,
            "max_cpu_buffer_gb": self.max_cpu_used * self.block_bytes / 1e9,
            "buffer_events": dict(self.events),
            "max_lent_blocks": self.max_lent,
            "logical_blocks_final": self.scaler.logical_chunks if self.scaler else self.b_max,
        }


if "ellm_elastic" not in SCHEDULERS:
    register_scheduler("ellm_elastic", lambda cfg, **opts: EllmElasticScheduler(cfg, **opts))
