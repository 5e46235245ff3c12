"""The router's glue around ``memory_ext.policy.edf_admission.EdfAdmission``.

The policy decides; this module turns its decisions into awaitables on the router's
event loop: a request ``enter``s (returns when the policy starts it, raises ``Rejected``
when it is refused or shed) and ``leave``s when its response is done.

Invariants: every call into the policy happens on the event loop thread (no locks); a
started request is released exactly once (``leave`` is idempotent); a waiting request
whose client goes away is withdrawn from the queue, or released if it had just started;
nothing waits without bound (the policy sheds hopeless requests; ``expire`` runs on a
timer).
"""

from __future__ import annotations

import asyncio
import itertools
import time

from memory_ext.policy.edf_admission import ENGINE_DOWN, ENGINE_RESTARTING, EdfAdmission, ModelLimits
from memory_ext.policy.router_activity import ArrivalRate

from .config import ServeConfig

__all__ = ["Rejected", "AdmissionGate", "policy_from_config", "STATUS"]

# HTTP status of each refusal reason: a full queue or a hopeless deadline is "slow down"
# (429), a dead or restarting engine is "unavailable" (503). All carry Retry-After.
STATUS = {ENGINE_DOWN: 503, ENGINE_RESTARTING: 503}


class Rejected(Exception):
    def __init__(self, model: str, reason: str, retry_after_s: float):
        self.model = model
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.status = STATUS.get(reason, 429)
        super().__init__(f"{model}: {reason}")


def policy_from_config(config: ServeConfig, device_of: dict[str, str]) -> EdfAdmission:
    limits = {
        m.name: ModelLimits(
            ttft_slo_s=m.ttft_slo_ms / 1000.0,
            priority=m.priority,
            max_inflight=config.inflight_cap(m),
            max_queued=config.queue_cap(m),
            group=device_of.get(m.name),
        )
        for m in config.models
    }
    # devices[].max_inflight: one cap over the device's models, whose slots then go by deadline too
    group_inflight = {d.name: d.max_inflight for d in config.devices if d.max_inflight is not None}
    return EdfAdmission(limits, max_queued_total=config.total_queue_cap(),
                        hopeless_after_slo_x=config.router.hopeless_after_slo_x,
                        group_inflight=group_inflight)  # fmt: skip


class AdmissionGate:
    """``rate_window_s``: the time constant of each model's arrival rate (``activity``)."""

    def __init__(self, policy: EdfAdmission, clock=time.monotonic, rate_window_s: float = 10.0):
        self.policy = policy
        self.clock = clock
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future] = {}
        self._active: set[str] = set()
        self._rates = {m: ArrivalRate(rate_window_s) for m in policy.models}
        self._tokens: dict[str, int] = {}  # rid -> estimated KV tokens, while queued

    def activity(self, model: str) -> dict:
        """What the router holds for ``model`` now (``POST /memx/activity``'s numbers): requests
        queued and in flight, the arrival rate (requests/s), the queued requests' estimated KV
        tokens and the seconds since the last arrival (None: none yet)."""
        now = self.clock()
        queued = self.policy.queued(model)
        rate = self._rates[model]
        since = None if rate.last_arrival is None else max(0.0, now - rate.last_arrival)
        return {
            "queued": len(queued),
            "inflight": self.policy.inflight(model),
            "arrival_rate": rate.rate(now),
            "queued_tokens": sum(self._tokens.get(t.rid, 0) for t in queued),
            "since_arrival_s": since,
        }

    def _wake(self, started) -> None:
        for t in started:
            self._tokens.pop(t.rid, None)
            self._active.add(t.rid)
            fut = self._waiting.pop(t.rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _shed(self, sheds) -> None:
        for s in sheds:
            self._tokens.pop(s.ticket.rid, None)
            fut = self._waiting.pop(s.ticket.rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(Rejected(s.ticket.model, s.reason, s.retry_after_s))

    async def enter(self, model: str, priority: int | None = None, tokens: int = 0) -> str:
        """Wait for a slot of ``model``; returns the ticket id to pass to ``leave``. ``tokens``: the
        request's estimated KV tokens (counted in ``activity`` while it is queued)."""
        rid = f"r{next(self._ids)}"
        now = self.clock()
        self._rates[model].arrive(now)
        offer = self.policy.offer(rid, model, now, priority)
        self._shed(offer.shed)
        if offer.verdict == "reject":
            raise Rejected(model, offer.reason, offer.retry_after_s)
        fut = None
        if offer.verdict == "queue":
            fut = asyncio.get_running_loop().create_future()
            self._waiting[rid] = fut
            self._tokens[rid] = max(0, int(tokens))
        self._wake(offer.started)
        if fut is None:
            return rid
        try:
            await fut
        except asyncio.CancelledError:
            self._waiting.pop(rid, None)
            self._tokens.pop(rid, None)
            if not self.policy.cancel(rid):  # started meanwhile: give the slot back
                self.leave(rid)
            raise
        return rid

    def leave(self, rid: str) -> None:
        if rid not in self._active:
            return
        self._active.discard(rid)
        self._wake(self.policy.finish(rid, self.clock()))

    def expire(self) -> None:
        self._shed(self.policy.expire(self.clock()))

    def engine_down(self, model: str) -> None:
        self._shed(self.policy.engine_down(model))

    def engine_restarting(self, model: str, expected_s: float = 5.0) -> None:
        self.policy.engine_restarting(model, self.clock(), expected_s)

    def set_max_inflight(self, model: str, max_inflight: int) -> None:
        self._wake(self.policy.set_max_inflight(model, max_inflight, self.clock()))

    def engine_up(self, model: str) -> None:
        self._wake(self.policy.engine_up(model, self.clock()))

    def state(self, model: str) -> str:
        """``up`` / ``restarting`` / ``down`` as admission sees the model."""
        return "down" if self.policy.is_down(model) else "restarting" if self.policy.is_restarting(model) else "up"

    def retry_after_s(self, model: str) -> float:
        return self.policy.retry_after_s(model)
