"""eLLM's admission under the governor in the simulator (kind ``governed_ellm``): the composed
variant's scheduler, the way the server runs it.

The server runs upstream's iterations (chunked prefill, decodes every iteration) and asks, for
each request upstream offers, the governor's batch decision, then eLLM's question
(``judge_prefill``), then acts (``sglang_memx.elastic.admission``). This scheduler is the same
on the stock structure (``core.batching.ContinuousBatchingScheduler``: decodes, continuing
prefill chunks, then FCFS admission under the token budget and ``max_running``), with each
admission passed through ``memory_ext.policy.no_harm.judge_with_governor``:

* the governor's TPOT batch decision (``BatchGovernor.may_grow``, learned from the decode
  iterations as ``governed`` learns);
* eLLM Alg. 1's verdict for the request (``judge_prefill``, as ``ellm`` asks it: budget = free +
  evictable KV + idle activation, reserved = the running decodes' reserve at ``new_token_ratio``
  plus the blocks the prompts under way still take, the prompt's KV, the activation of this
  iteration's tokens with it);
* the harm prediction: ``peak_shortfall`` of the running requests (their KV tokens, their
  remaining output, the blocks they free) and the request's prompt against the free + evictable
  KV blocks (not the idle activation: every later iteration needs its activation back):
  admitting it would preempt a running request later.

The verdict's action: ``ON_GPU`` admits, inflating the KV pool from idle activation when stock's
own check (the prompt's blocks beside the watermark) needs it (eLLM's ballooning, through the node
arbiter when there is one); ``STOCK`` leaves the decision to stock's check; ``DEFER`` stops the
scan (FCFS, nothing dropped). Running decodes' new blocks may take idle activation beside the
decode batch's own before stock's step would preempt one (Alg. 1's decode side); lent
activation comes back lazily (eLLM R6): when an iteration's activation exceeds the idle
activation, the shortfall is deflated from free KV. There is no host buffer here (``OFFLOAD``
never arises: the requests ask with nothing to park); the parking rules are the server's and the
policy's tests cover them. ``gate: false`` (ablation): eLLM's own verdict stands (``ON_GPU``
admits, ``DEFER`` defers) behind the batch decision, which isolates what eLLM's admission does on
the stock iteration structure.

``admission_reserve_blocks`` (what the node arbiter counts as this model's need and keeps as its
headroom): the running requests' predicted peak growth beyond what they hold
(``peak_shortfall`` with nothing free), not eLLM's ratio reserve, which is only an input of
eLLM's verdict here (with ``gate: false`` eLLM's ratio reserve, which then decides). Options:
``new_token_ratio`` (eLLM's), ``threshold_chunks`` (θ), the governor's ``min_samples``,
``decay``, ``use_kv``, ``watermark``, and ``gate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory_ext.policy.no_harm import REASONS, GovernedVerdict, Running, govern_prefill, peak_shortfall
from memory_ext.policy.prefill_admission import DEFER, ON_GPU, PrefillAsk

from ..core.batching import ContinuousBatchingScheduler, OptionError
from ..core.plan import BatchPlan, InstanceView
from ..core.request import Request
from ..core.stats import mechanism_stats
from .ellm import DEFAULT_NEW_TOKEN_RATIO, EllmScheduler, decode_reserve_blocks
from .governor import GovernedScheduler, kv_tokens, pace_numbers

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import InstanceConfig

__all__ = ["GovernedEllmScheduler", "candidate_growth", "running_growth"]


def _growth(r: Request, tokens: int, held: int, bs: int) -> Running:
    """``r`` holding ``tokens`` tokens (``held`` blocks it gives back when it finishes: its private
    ones, its prompt's still to come and its published blocks nobody else references): the
    tokens its decode steps still add (its prefill yields its next token, so a request not yet
    decoding adds one fewer) and the blocks it frees when it finishes."""
    remaining = max(r.output_len - r.generated - (0 if r.decoding else 1), 0)
    grow = -(-(tokens + remaining) // bs) - (-(-tokens // bs))
    return Running(tokens, remaining, held + grow)


def running_growth(inst: InstanceView) -> tuple[list[Running], int]:
    """The running requests as ``peak_shortfall`` sees them, and the blocks their unfinished
    prompts still take (prefills under way)."""
    bs, refs = inst.kv.block_size, inst.kv.refs
    out, pending = [], 0
    for r in inst.running:
        need = 0 if r.decoding else max(inst.blocks_needed(r, r.target - r.ctx), 0)
        pending += need
        own = sum(1 for k in r.cached_keys if refs.get(k) == 1)  # published, referenced by it alone
        out.append(_growth(r, r.ctx if r.decoding else r.target, r.private_blocks + own + need, bs))
    return out, pending


def candidate_growth(inst: InstanceView, r: Request) -> tuple[Running, int]:
    """An admitted request (its prefix hit taken) as ``peak_shortfall`` sees it, and the blocks
    its whole prompt still takes."""
    need = max(inst.blocks_needed(r, r.target - r.ctx), 0)
    return _growth(r, r.target, need, inst.kv.block_size), need


class GovernedEllmScheduler(GovernedScheduler):
    """Kind ``governed_ellm`` (module docstring)."""

    kind = "governed_ellm"

    def __init__(self, cfg: InstanceConfig, new_token_ratio: float = DEFAULT_NEW_TOKEN_RATIO,
                 threshold_chunks: int = 0, watermark: float = 0.01, min_samples: int = 8,
                 decay: float = 0.98, use_kv: bool = True, gate: bool = True) -> None:  # fmt: skip
        super().__init__(cfg, watermark, min_samples, decay, use_kv)
        if not isinstance(gate, bool):
            raise OptionError("gate", "true or false", gate)
        self.gate = gate
        self.ellm = EllmScheduler(cfg, threshold_chunks=threshold_chunks, new_token_ratio=new_token_ratio)
        self.verdicts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.ellm_refusals_overridden = 0  # eLLM deferred, stock's own admission then admitted
        self.inflated = self.deflated = 0

    # ---- eLLM's ballooning, as ``EllmScheduler`` applies it ----------------------------
    def _idle_act(self, inst: InstanceView) -> int:
        arb = getattr(inst.sim, "arbiter", None)
        e = self.ellm
        return arb.act_idle_blocks(inst) if arb is not None else e.act_total - e.lent

    def _move(self, inst: InstanceView, blocks: int) -> None:
        """``blocks`` > 0: idle activation -> KV; < 0: free KV -> activation."""
        arb, e, kv = getattr(inst.sim, "arbiter", None), self.ellm, inst.kv
        if blocks > 0:
            if arb is not None:
                arb.inflate(inst, blocks)
            else:
                kv.resize(kv.capacity + blocks)
            self.inflated += blocks
        elif blocks < 0:
            if arb is not None:
                arb.deflate(inst, -blocks)
            else:
                kv.resize(kv.capacity + blocks)
            self.deflated += -blocks
        e.lent = e.act_total - self._idle_act(inst) if arb is not None else e.lent + blocks
        e.max_lent = max(e.max_lent, e.lent)

    def admission_reserve_blocks(self, inst: InstanceView) -> int:
        if not self.gate:  # eLLM's own verdict decides: its ratio reserve is what admission keeps back
            return self.ellm.admission_reserve_blocks(inst)
        running, pending = running_growth(inst)
        return max(0, peak_shortfall(0, running, inst.kv.block_size, pending))

    # ---- one iteration -------------------------------------------------------------------
    def plan(self, inst: InstanceView, now: float) -> BatchPlan:
        self.observe(inst)
        self._inflate_for_decodes(inst)
        waiting = inst.waiting
        saved = list(waiting)
        waiting.clear()  # stock's decodes and continuing chunks first, no admission
        try:
            plan = ContinuousBatchingScheduler.plan(self, inst, now)
        finally:
            waiting.extend(saved)
        self._admit(inst, now, plan)
        self.note_plan(inst, plan)
        return plan

    def _inflate_for_decodes(self, inst: InstanceView) -> None:
        """Alg. 1's decode side: the running decodes' new blocks may take idle activation (beside
        the decode batch's own) before stock's step would preempt one."""
        bs, e = inst.kv.block_size, self.ellm
        decodes = [r for r in inst.running if r.decoding]
        short = sum(1 for r in decodes if r.ctx % bs == 0) - inst.kv.available
        if short > 0:
            spare = self._idle_act(inst) - e.act_chunks(len(decodes))
            if spare > 0:
                self._move(inst, min(short, spare))

    def _admit(self, inst: InstanceView, now: float, plan: BatchPlan) -> None:
        kv, cfg, e = inst.kv, inst.cfg, self.ellm
        bs = kv.block_size
        budget = cfg.max_batched_tokens - plan.tokens
        reserve_free = int(self.watermark * kv.capacity)
        running, pending = running_growth(inst)
        resident = [r for r in inst.running if r.decoding]
        ratio_reserve = decode_reserve_blocks(resident, e.new_token_ratio, bs)
        e.max_reserved = max(e.max_reserved, ratio_reserve)
        while budget > 0 and inst.waiting and len(inst.running) < cfg.max_running:
            r = inst.waiting[0]
            batch = self.governor.may_grow(len(inst.running), kv_tokens(inst.running), r.prompt_len + r.generated,
                                           **pace_numbers(self.governor, inst.running, r, now, plan))  # fmt: skip
            inst.waiting.popleft()
            inst.admit(r, now)  # its prefix hit decides what its prompt takes (``unadmit`` undoes it)
            chunk = min(r.target - r.ctx, budget)
            act = e.act_chunks(plan.tokens + chunk)
            idle = self._idle_act(inst)
            if act > idle and e.lent > 0:  # R6: lent activation comes back, only the shortfall
                self._move(inst, -min(act - idle, e.lent, kv.available))
                idle = self._idle_act(inst)
            kv_blocks = -(-r.target // bs)
            ask = PrefillAsk(budget=kv.available + idle - e.threshold_chunks, reserved=ratio_reserve + pending,
                             reserved_now=0, kv=kv_blocks, kv_now=0, act=act)  # fmt: skip
            cand, need = candidate_growth(inst, r)
            mech, v = govern_prefill(ask, [*running, cand], bs, pending + need, batch.admit, ask_unit=bs,
                                     room=kv.available)  # fmt: skip
            if not self.gate:  # ablation: eLLM's own verdict, only the batch decision in front
                v = GovernedVerdict(mech.action if batch.admit else DEFER, v.reason)
            self.verdicts[v.reason] += 1
            if v.action == DEFER:
                inst.unadmit(r)
                break
            first = inst.blocks_needed(r, chunk)
            short = first - (kv.available - reserve_free)
            if v.action == ON_GPU and short > 0 and idle > act:
                self._move(inst, min(short, idle - act))
            if first > kv.available - reserve_free or not inst.reserve(r, chunk):
                inst.unadmit(r)
                break
            if mech.action == DEFER:
                self.ellm_refusals_overridden += 1
            running.append(cand)
            pending += need - max(first, 0)
            plan.prefills.append((r, chunk))
            budget -= chunk

    def stats(self) -> dict:
        """The governor's counters and gauges (``governed``) plus the verdicts by reason and eLLM's."""
        base, e = super().stats(), self.ellm
        counters = (
            base["counters"]
            | {f"verdict_{k}": v for k, v in self.verdicts.items()}
            | {
                "ellm_refusals_overridden": self.ellm_refusals_overridden,
                "inflated_blocks": self.inflated,
                "deflated_blocks": self.deflated,
            }
        )
        gauges = base["gauges"] | {"max_lent_blocks": e.max_lent, "max_decode_reserve_blocks": e.max_reserved,
                                   "new_token_ratio": e.new_token_ratio}  # fmt: skip
        return mechanism_stats("governor", self.kind, self.instance_name, counters, gauges, base["details"])
