"""The stock-engine baseline schedulers.

``ContinuousBatchingScheduler`` (kind ``continuous``, vLLM-with-chunked-prefill
/ SGLang style): running decodes first (one token each), then continuing
prefill chunks, then FCFS admission of waiting requests, all under a
per-iteration token budget (chunked prefill) and ``max_running`` sequences.
KV is reserved only for the tokens scheduled. When decodes cannot get their
next block, the most recently admitted running request is preempted (all its
KV dropped, recomputed later). New requests are admitted only while
``watermark`` of the pool stays free, which limits thrashing. Not a paper
mechanism: every other scheduler is measured against it.

``VllmV0Scheduler`` (kind ``vllm_v0``): vLLM v0's default policy (the engine
of vLLM up to 0.7.x, chunked prefill off), prefill-prioritised:

* an iteration first tries to start whole prompts from the head of the
  waiting queue (new requests, and requests preempted by recomputation,
  whose prompt is then their prompt plus every token generated so far), FCFS,
  while the token budget (``max_batched_tokens``), ``max_running`` sequences
  (running ones included) and the KV pool allow: a prompt's blocks must fit
  and leave ``watermark`` of the pool free; the first prompt that does not fit
  ends the scan (no overtaking);
* if at least one prompt was started, the iteration is *prefill only*: every
  running request's decode waits for the next iteration;
* otherwise every running request decodes one token, in admission order; when
  one cannot get its next KV block, the most recently admitted running
  request is preempted (recompute: all its KV is freed, it goes back to the
  head of the waiting queue), and so on until the block fits (a request that
  is itself the latest is preempted instead). Its recomputation is then a
  prefill-only iteration that stalls every other decode of the instance.

Departures, so that the simulator never drops a request: the first prompt of
an iteration may exceed the token budget (vLLM's default budget without
chunked prefill is at least the model's context, so every prompt that fits
the model fits it), and when nothing is running, the head of the queue may
use the watermark too (vLLM would refuse a prompt that cannot fit with it).
``chunked_prefill: true`` gives vLLM v0's chunked-prefill policy instead,
which is the stock scheduler's order (running decodes and chunks first, then
new chunks, mixed in one iteration).
"""

from __future__ import annotations

from .plan import BatchPlan, InstanceView
from .request import Request
from .stats import mechanism_stats

__all__ = ["ContinuousBatchingScheduler", "VllmV0Scheduler", "OptionError"]


class OptionError(ValueError):
    """A bad scheduler option; ``option`` names it (the scenario loader reports
    ``models[i].scheduler.options.<option>``)."""

    def __init__(self, option: str, expected: str, got: object) -> None:
        super().__init__(f"{option}: expected {expected}, got {got!r}")
        self.option = option


def _check_watermark(watermark: object) -> float:
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise OptionError("watermark", "a number in [0, 1)", watermark)
    return float(watermark)


class ContinuousBatchingScheduler:
    """Stock baseline; see module docstring. ``watermark``: fraction of KV
    blocks that admission leaves free for decode growth."""

    def __init__(self, watermark: float = 0.01) -> None:
        self.watermark = _check_watermark(watermark)

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
            if not self.may_admit(inst, r, now, plan):
                break
            waiting.popleft()
            inst.admit(r, now)
            chunk = min(r.target - r.ctx, budget)
            if inst.blocks_needed(r, chunk) > kv.available - reserve_free or not inst.reserve(r, chunk):
                inst.unadmit(r)
                break
            plan.prefills.append((r, chunk))
            budget -= chunk
        return plan

    def may_admit(self, inst: InstanceView, r: Request, now: float, plan: BatchPlan) -> bool:
        """Whether ``r`` may join the running batch at ``now`` (``plan``: the iteration so far) before
        its memory is checked (stock: always; ``mechanisms.governor.GovernedScheduler``: the
        governor's batch decision)."""
        return True


class VllmV0Scheduler:
    """vLLM v0's default scheduling (module docstring). Options:
    ``watermark`` (fraction of KV blocks a new prompt must leave free; vLLM's
    default 0.01), ``chunked_prefill`` (false: prefill-only iterations; true:
    the mixed chunked-prefill order of ``ContinuousBatchingScheduler``)."""

    def __init__(self, cfg: object = None, watermark: float = 0.01, chunked_prefill: bool = False) -> None:
        self.watermark = _check_watermark(watermark)
        if not isinstance(chunked_prefill, bool):
            raise OptionError("chunked_prefill", "true or false", chunked_prefill)
        self.chunked_prefill = chunked_prefill
        self.instance_name = str(getattr(cfg, "name", "") or "instance")
        self._mixed = ContinuousBatchingScheduler(self.watermark) if chunked_prefill else None
        self.prefill_iterations = 0
        self.decode_iterations = 0
        self.stalled_decodes = 0  # running requests that waited through a prefill-only iteration

    def plan(self, inst: InstanceView, now: float) -> BatchPlan:
        if self._mixed is not None:
            return self._mixed.plan(inst, now)
        plan = BatchPlan()
        n_running = len(inst.running)
        plan.prefills = self._prefills(inst, now)
        if plan.prefills:
            self.prefill_iterations += 1
            self.stalled_decodes += sum(1 for r in inst.running[:n_running] if r.decoding)
            return plan
        plan.decodes = self._decodes(inst)
        if plan.decodes:
            self.decode_iterations += 1
        return plan

    def _prefills(self, inst: InstanceView, now: float) -> list[tuple[Request, int]]:
        """Whole prompts, FCFS from the head of the queue, while they fit."""
        kv = inst.kv
        cfg = inst.cfg
        out: list[tuple[Request, int]] = []
        tokens = 0
        # a running request that is not decoding has a prompt left to finish
        # (never produced by this policy; kept so that a hand-built state runs)
        for r in inst.running:
            if not r.decoding:
                n = r.target - r.ctx
                if not inst.reserve(r, n):
                    break
                out.append((r, n))
                tokens += n
        reserve_free = int(self.watermark * kv.capacity)
        waiting = inst.waiting
        while waiting and len(inst.running) < cfg.max_running:
            r = waiting[0]
            alone = not inst.running  # nothing else could ever free blocks for it
            waiting.popleft()
            inst.admit(r, now)
            n = r.target - r.ctx
            keep = 0 if alone else reserve_free
            if (
                (out and tokens + n > cfg.max_batched_tokens)
                or inst.blocks_needed(r, n) > kv.available - keep
                or not inst.reserve(r, n)
            ):
                inst.unadmit(r)
                break
            out.append((r, n))
            tokens += n
        return out

    @staticmethod
    def _decodes(inst: InstanceView) -> list[Request]:
        """One token for every running request, preempting from the back."""
        kv = inst.kv
        bs = kv.block_size
        running = inst.running
        out: list[Request] = []
        i = 0
        while i < len(running):
            r = running[i]
            if r.ctx % bs == 0:  # its next token starts a new block
                while kv.available < 1:
                    victim = running[-1]
                    inst.preempt(victim)
                    if victim is r:
                        return out
                kv.allocate(1)
                r.private_blocks += 1
            out.append(r)
            i += 1
        return out

    def stats(self) -> dict:
        """Common shape (``core.stats``): iterations by kind and the decodes that
        waited through a prefill-only iteration (one per request and iteration)."""
        return mechanism_stats(
            "vllm_v0",
            "vllm_v0",
            self.instance_name,
            {
                "prefill_only_iterations": self.prefill_iterations,
                "decode_iterations": self.decode_iterations,
                "stalled_decodes": self.stalled_decodes,
            },
            {"watermark": self.watermark, "chunked_prefill": int(self.chunked_prefill)},
        )
