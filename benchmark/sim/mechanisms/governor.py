"""The governor's batch decision in the simulator (kind ``governed``): the stock continuous
batching scheduler (``core.batching.ContinuousBatchingScheduler``) with the same policy object
the server's governor asks (``memory_ext.policy.governor.BatchGovernor``) in front of each
admission: a waiting request joins the running batch only while the predicted decode step of
the running requests with it stays within the model's TPOT SLO (``slo.tpot_s``; none: stock).
A refused request stays at the head of the queue (FCFS: nothing overtakes it, nothing is dropped).

The step-time model learns from the simulated iterations as the server's learns from its
measured ones: each pure decode iteration is one sample (its batch size, the KV tokens its
requests hold after the step, its duration); an iteration with prefill chunks feeds the seconds
the running requests wait through prefills per decoded token (``memory_ext.policy.prefill_stalls``:
a mixed iteration's time beyond its predicted decode step, all of a prefill-only iteration that
decoding requests sat out), which the governor adds to the predicted TPOT. Options: ``watermark`` (as ``continuous``),
``min_samples``, ``decay``, ``use_kv`` (the model's, ``StepTimeModel``), ``default_slo_scale`` (0, none: a model
without a TPOT SLO then holds the server's measured default, that many times its first solo decode steps'
median, ``memory_ext.policy.default_slo``; the server's ``--memx-tpot-slo-scale``).
"""

from __future__ import annotations

import math

from memory_ext.policy.default_slo import SoloStepDefault, check_scale
from memory_ext.policy.governor import BatchGovernor, StepTimeModel
from memory_ext.policy.request_pace import RunningPace

from ..core.batching import ContinuousBatchingScheduler, OptionError
from ..core.plan import BatchPlan, InstanceView
from ..core.request import Request
from ..core.stats import mechanism_stats

__all__ = ["GovernedScheduler", "kv_tokens", "pace_numbers"]


def kv_tokens(reqs) -> int:
    """KV tokens the requests hold at their next step (prompt + generated), as the server counts them."""
    return sum(r.prompt_len + r.generated for r in reqs)


def pace_numbers(governor: BatchGovernor, running, r: Request, now: float, plan: BatchPlan) -> dict:
    """The per-request rule's numbers for ``r`` joining ``running`` at ``now`` (``BatchGovernor.decide``'s
    keywords), as the server counts them: each decoding request's time and tokens since its first
    token and its tokens left; the prompt tokens ``plan`` prefills already and ``r``'s own. None
    (an empty dict) when ``governor`` has no SLO to judge them by."""
    if not governor.judges_paces:
        return {}
    paces = [RunningPace(max(0.0, now - x.first_token_t), max(0, x.generated - 1), max(0, x.output_len - x.generated))
             for x in running if x.decoding and x.first_token_t is not None]  # fmt: skip
    return {"paces": paces, "pass_tokens": sum(chunk for _, chunk in plan.prefills),
            "add_tokens": max(1, r.target - r.ctx)}  # fmt: skip


class GovernedScheduler(ContinuousBatchingScheduler):
    """``continuous`` with the governor's batch decision (module docstring)."""

    def __init__(self, cfg: object = None, watermark: float = 0.01, min_samples: int = 8, decay: float = 0.98,
                 use_kv: bool = True, default_slo_scale: float = 0.0) -> None:  # fmt: skip
        super().__init__(watermark)
        if not isinstance(use_kv, bool):
            raise OptionError("use_kv", "true or false", use_kv)
        try:
            model = StepTimeModel(decay=decay, min_samples=min_samples, use_kv=use_kv)
        except ValueError as e:  # the policy's message starts with the field's name
            field, _, expected = str(e).partition(" ")
            raise OptionError(field, expected, {"decay": decay, "min_samples": min_samples}[field]) from None
        try:
            default = SoloStepDefault(check_scale("default_slo_scale", default_slo_scale))
        except ValueError:
            raise OptionError("default_slo_scale", "0 or a number > 1", default_slo_scale) from None
        slo = getattr(cfg, "tpot_slo_s", math.inf)
        self.governor = BatchGovernor(None if slo is None or math.isinf(slo) else slo, model,
                                      default=default if default.enabled else None)  # fmt: skip
        self.instance_name = str(getattr(cfg, "name", "") or "instance")
        # the last plan: (iteration count, decodes, whether it prefilled, decoding requests it left out,
        # prompt tokens it prefilled)
        self._pending: tuple[int, list[Request], bool, int, int] | None = None
        self.max_running_seen = 0

    def observe(self, inst: InstanceView) -> None:
        """Feed the last plan, once it ran, to the governor: a pure decode iteration is a sample of
        the step-time model, one with prefill chunks a measure of the stalls (module docstring)."""
        pending, self._pending = self._pending, None
        if pending is None or inst.iterations != pending[0] + 1:
            return
        _, decodes, prefilled, stalled, tokens = pending
        if decodes or stalled or tokens:
            self.governor.observe_iteration(inst.last_duration, len(decodes), kv_tokens(decodes), stalled, prefilled,
                                            prefill_tokens=tokens)  # fmt: skip

    def note_plan(self, inst: InstanceView, plan: BatchPlan) -> None:
        """Remember a plan that decodes or prefills: once it has run, ``observe`` feeds it to the governor."""
        if plan.prefills:
            chosen = {id(r) for r in plan.decodes}
            stalled = sum(1 for r in inst.running if r.decoding and id(r) not in chosen)
            tokens = sum(chunk for _, chunk in plan.prefills)
            self._pending = (inst.iterations, list(plan.decodes), True, stalled, tokens)
        elif plan.decodes:
            self._pending = (inst.iterations, list(plan.decodes), False, 0, 0)
        self.max_running_seen = max(self.max_running_seen, len(inst.running))

    def plan(self, inst: InstanceView, now: float) -> BatchPlan:
        self.observe(inst)
        plan = super().plan(inst, now)
        self.note_plan(inst, plan)
        return plan

    def may_admit(self, inst: InstanceView, r: Request, now: float, plan: BatchPlan) -> bool:
        return self.governor.may_grow(len(inst.running), kv_tokens(inst.running), kv_tokens((r,)),
                                      **pace_numbers(self.governor, inst.running, r, now, plan)).admit  # fmt: skip

    def stats(self) -> dict:
        g, m = self.governor, self.governor.model
        return mechanism_stats(
            "governor",
            "governed",
            self.instance_name,
            {f"decisions_{k}": v for k, v in g.counts.items()} | {"step_samples": m.samples},
            {"tpot_slo_s": -1.0 if g.tpot_slo_s is None else g.tpot_slo_s, "max_running": self.max_running_seen},
            {"model": None if m.coef is None else dict(zip(("a_s", "b_s", "c_s"), m.coef))},
        )
