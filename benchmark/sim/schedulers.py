"""Iteration schedulers: the policy that builds each batch of one instance.

* ``ContinuousBatchingScheduler`` -- the stock-engine baseline (vLLM / SGLang
  style): running decodes first (one token each), then continuing prefill
  chunks, then FCFS admission of waiting requests, all under a per-iteration
  token budget (chunked prefill) and ``max_running`` sequences. KV is
  reserved only for the tokens scheduled. When decodes cannot get their next
  block, the most recently admitted running request is preempted (all its KV
  dropped, recomputed later). New requests are admitted only while
  ``watermark`` of the pool stays free, which limits thrashing.
* ``EllmScheduler`` -- drives ``memory_ext.policy.ellm.ElasticAdmissionPolicy``
  (eLLM Alg. 1); see its docstring.

Register more with ``register_scheduler(kind, factory)``; a factory receives
the scheduler's options dict from the scenario file and the InstanceConfig.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .plan import BatchPlan
from .request import Request

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Instance, InstanceConfig

__all__ = ["ContinuousBatchingScheduler", "EllmScheduler", "SCHEDULERS", "register_scheduler", "make_scheduler"]


class ContinuousBatchingScheduler:
    """Stock baseline; see module docstring. ``watermark``: fraction of KV
    blocks that admission leaves free for decode growth."""

    def __init__(self, watermark: float = 0.01) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = watermark

    def plan(self, inst: Instance, now: float) -> BatchPlan:
        kv = inst.kv
        bs = kv.block_size
        cfg = inst.cfg
        budget = cfg.max_batched_tokens
        plan = BatchPlan()
        # 1. decodes: one token each, a new block when the last one is full
        while True:
            decodes: list[Request] = []
            need = 0
            for r in inst.running:
                if r.decoding:
                    decodes.append(r)
                    if r.ctx % bs == 0:
                        need += 1
            if need <= kv.available:
                break
            inst.preempt(inst.running[-1])  # latest admitted goes first
        if len(decodes) > budget:
            decodes = decodes[:budget]
        if need:
            kv.allocate(need)
            for r in decodes:
                if r.ctx % bs == 0:
                    r.private_blocks += 1
        plan.decodes = decodes
        budget -= len(decodes)
        # 2. continuing prefills, admission order
        if budget > 0 and len(decodes) < len(inst.running):
            for r in inst.running:
                if budget <= 0:
                    break
                if r.decoding:
                    continue
                chunk = min(r.target - r.ctx, budget)
                if not inst.reserve(r, chunk):
                    break
                plan.prefills.append((r, chunk))
                budget -= chunk
        # 3. admit waiting requests FCFS
        reserve_free = int(self.watermark * kv.capacity)
        waiting = inst.waiting
        while budget > 0 and waiting and len(inst.running) < cfg.max_running:
            r = waiting[0]
            waiting.popleft()
            inst.admit(r, now)
            chunk = min(r.target - r.ctx, budget)
            if inst.blocks_needed(r, chunk) > kv.available - reserve_free or not inst.reserve(r, chunk):
                inst.unadmit(r)
                break
            plan.prefills.append((r, chunk))
            budget -= chunk
        return plan


class EllmScheduler:
    """eLLM elastic scheduling (E4) driven through the policy object.

    Memory model: the instance's pool is ``kv_blocks + act_blocks`` blocks
    (one eLLM chunk = one KV block here). Activation need of a batch of ``n``
    tokens is ``ceil(model.activation_bytes(n) / block_bytes)``. Each
    iteration the engine reports ``free_kv_chunks`` (free + evictable KV
    blocks), ``idle_act_chunks`` (activation blocks not lent to KV) and the
    queues to ``ElasticAdmissionPolicy.decide`` and applies the decision:
    inflation grows the KV pool by borrowing activation blocks, deflation
    gives them back; admitted prefills run whole (no chunking: Alg. 1 admits
    whole requests); one iteration is either prefill or decode (R4 fallback).

    Not modelled yet (left for the eLLM scenario author): the CPU elastic
    buffer (offload of prefill KV over the host link, fetch-back before
    decode) and Alg. 2 buffer scaling; ``cpu_buffer_blocks`` defaults to 0, so
    the policy never offloads.
    """

    def __init__(self, cfg: InstanceConfig, threshold_chunks: int = 0, cpu_buffer_blocks: int = 0) -> None:
        from memory_ext.policy.ellm import DecodeRequest, ElasticAdmissionPolicy, PrefillRequest

        self._Prefill, self._Decode = PrefillRequest, DecodeRequest
        block_bytes = cfg.kv_block_bytes
        model, dtype = cfg.model, cfg.weight_dtype

        def act_chunks(tokens: int) -> int:
            return int(math.ceil(model.activation_bytes(tokens, dtype) / block_bytes))

        self.act_chunks = act_chunks
        self.policy = ElasticAdmissionPolicy(act_chunks, threshold_chunks)
        self.act_total = cfg.act_blocks
        self.lent = 0  # activation blocks currently lent to the KV pool
        self.cpu_buffer_blocks = cpu_buffer_blocks
        self.decisions = 0
        self.max_lent = 0
        self.deflated = 0  # blocks given back to activation (node arbiter only)

    def _decide_and_inflate(self, kv, p_reqs, d_reqs, cpu_buffer_free_chunks: int, inst=None):
        """Ask Alg. 1 for this iteration's decision and lend it the idle activation blocks it inflates into.

        Under the node arbiter (``inst.sim.arbiter``) the idle activation is
        the model's ``activation`` account and both inflation and deflation
        (Alg. 1's negative ``I``) are applied through the arbiter; without
        it, deflation is not applied (lent blocks stay with KV)."""
        arb = getattr(inst.sim, "arbiter", None) if inst is not None else None
        idle_act = arb.act_idle_blocks(inst) if arb is not None else self.act_total - self.lent
        d = self.policy.decide(
            free_kv_chunks=kv.available,
            idle_act_chunks=idle_act,
            prefills=p_reqs,
            decodes=d_reqs,
            cpu_buffer_free_chunks=cpu_buffer_free_chunks,
        )
        self.decisions += 1
        if arb is not None:
            if d.inflation > 0:
                arb.inflate(inst, d.inflation)
            elif d.inflation < 0:
                arb.deflate(inst, -d.inflation)
                self.deflated += -d.inflation
            self.lent = self.act_total - arb.act_idle_blocks(inst)
            self.max_lent = max(self.max_lent, self.lent)
        elif d.inflation > 0:
            before = kv.capacity
            self.lent += kv.resize(before + d.inflation) - before
            self.max_lent = max(self.max_lent, self.lent)
        return d

    def plan(self, inst: Instance, now: float) -> BatchPlan:
        kv = inst.kv
        bs = kv.block_size
        decodes = [r for r in inst.running if r.decoding]
        # a request the policy admitted stays at the head of ``waiting`` until planned
        prefills = list(inst.waiting)[:64]
        if not decodes and not prefills:
            return BatchPlan()
        p_reqs = [self._Prefill(str(r.rid), r.target, -(-r.target // bs)) for r in prefills]
        d_reqs = [self._Decode(str(r.rid), 1 if r.ctx % bs == 0 else 0) for r in decodes]
        d = self._decide_and_inflate(kv, p_reqs, d_reqs, self.cpu_buffer_blocks, inst)
        plan = BatchPlan()
        admitted = set(d.admitted)
        if d.phase == "prefill":
            for r in prefills:
                if str(r.rid) not in admitted:
                    break
                inst.waiting.popleft()
                inst.admit(r, now)
                chunk = r.target - r.ctx
                if not inst.reserve(r, chunk):  # prefix hit makes this cheaper, never dearer
                    inst.unadmit(r)
                    break
                plan.prefills.append((r, chunk))
        else:
            for r in decodes:
                if str(r.rid) in admitted and inst.reserve(r, 1):
                    plan.decodes.append(r)
            if not plan and decodes and not inst.in_iteration:
                # nothing fits at all: fall back to the stock escape hatch
                inst.preempt(inst.running[-1])
                return self.plan(inst, now)
        return plan


SCHEDULERS: dict[str, Callable[..., Any]] = {
    "continuous": lambda cfg, **opts: ContinuousBatchingScheduler(**opts),
    "ellm": lambda cfg, **opts: EllmScheduler(cfg, **opts),
}


def register_scheduler(kind: str, factory: Callable[..., Any]) -> None:
    """Make ``kind`` usable as ``scheduler.kind`` in scenario files.
    ``factory(cfg: InstanceConfig, **options) -> Scheduler``."""
    if kind in SCHEDULERS:
        raise ValueError(f"scheduler kind {kind!r} already registered")
    SCHEDULERS[kind] = factory


def make_scheduler(kind: str, cfg: InstanceConfig, options: dict[str, Any]):
    return SCHEDULERS[kind](cfg, **options)
