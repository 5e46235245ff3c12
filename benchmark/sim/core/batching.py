"""The stock-engine baseline scheduler (scheduler kind ``continuous``).

``ContinuousBatchingScheduler`` (vLLM / SGLang style): running decodes first
(one token each), then continuing prefill chunks, then FCFS admission of
waiting requests, all under a per-iteration token budget (chunked prefill) and
``max_running`` sequences. KV is reserved only for the tokens scheduled. When
decodes cannot get their next block, the most recently admitted running
request is preempted (all its KV dropped, recomputed later). New requests are
admitted only while ``watermark`` of the pool stays free, which limits
thrashing. Not a paper mechanism: every other scheduler is measured against it.
"""

from __future__ import annotations

from .plan import BatchPlan, InstanceView
from .request import Request

__all__ = ["ContinuousBatchingScheduler"]


class ContinuousBatchingScheduler:
    """Stock baseline; see module docstring. ``watermark``: fraction of KV
    blocks that admission leaves free for decode growth."""

    def __init__(self, watermark: float = 0.01) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = watermark

    def plan(self, inst: InstanceView, now: float) -> BatchPlan:
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
