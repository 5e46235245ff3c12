"""Router-level admission (FineServe F3's second level): EDF over per-model TTFT deadlines.

A front router holds requests for several engines. Each request gets a deadline
``arrival + ttft_slo`` of its model. Requests start in deadline order (earliest first;
equal deadlines: higher ``priority`` first, then arrival order) as long as their engine
has an in-flight slot (``max_inflight``: what the engine can batch within its SLO) and
their group (the device the engine shares with others, optional cap) has one too.
Engines keep their own schedulers; this only decides *when* a request is handed over.

Overload never waits forever:

* a full queue (per model ``max_queued`` or the router's total) sheds the least valuable
  of the queue and the newcomer: lowest priority, then latest deadline, then latest
  arrival (``queue_full``; HTTP 429);
* a queued request ``hopeless_after_slo_x`` SLOs past its deadline is shed (``deadline``;
  429): waiting longer cannot save its TTFT;
* a model whose engine is down refuses new requests and sheds its queue (``engine_down``;
  HTTP 503);
* a model whose engine is restarting keeps queueing (nothing starts until ``engine_up``);
  a queued request that reaches the hopeless horizon meanwhile is shed as
  ``engine_restarting`` (HTTP 503) with ``retry_after_s`` = the restart's expected rest.

Every refusal comes with ``retry_after_s``: the expected time until a slot frees, from
the measured service time of the model's requests.

Invariants: numbers in, decisions out (time is passed in, nothing sleeps or does I/O);
a request is in exactly one of {queued, in flight, gone}; in-flight counts never exceed
the caps; ``dispatch`` only ever starts queued requests in EDF order per model.
The router (``sglang_memx.serve.router``) and a simulator drive the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ._checks import check_int as _int

__all__ = ["ModelLimits", "Ticket", "Shed", "Offer", "EdfAdmission", "QUEUE_FULL", "DEADLINE", "ENGINE_DOWN",
           "ENGINE_RESTARTING"]  # fmt: skip

QUEUE_FULL = "queue_full"
DEADLINE = "deadline"
ENGINE_DOWN = "engine_down"
ENGINE_RESTARTING = "engine_restarting"

ADMIT = "admit"
QUEUE = "queue"
REJECT = "reject"


def _pos(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class ModelLimits:
    """One engine's admission parameters. ``group``: the device its engine shares (caps in
    ``EdfAdmission(group_inflight=...)``); None: no shared cap."""

    ttft_slo_s: float
    priority: int = 0
    max_inflight: int = 8
    max_queued: int = 64
    group: str | None = None

    def __post_init__(self):
        _pos("ttft_slo_s", self.ttft_slo_s)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        _int("max_inflight", self.max_inflight, 1)
        _int("max_queued", self.max_queued, 0)


@dataclass(frozen=True)
class Ticket:
    rid: str
    model: str
    arrival: float
    deadline: float
    priority: int
    seq: int

    def edf_key(self) -> tuple:
        return (self.deadline, -self.priority, self.seq)

    def shed_key(self) -> tuple:
        """Larger = shed first: lowest priority, then latest deadline, then latest arrival."""
        return (-self.priority, self.deadline, self.seq)


@dataclass(frozen=True)
class Shed:
    ticket: Ticket
    reason: str  # QUEUE_FULL | DEADLINE | ENGINE_DOWN | ENGINE_RESTARTING
    retry_after_s: float


@dataclass(frozen=True)
class Offer:
    verdict: str  # "admit" (start now) | "queue" (wait for dispatch) | "reject"
    ticket: Ticket
    reason: str | None = None  # why rejected
    retry_after_s: float | None = None  # with a rejection
    shed: tuple[Shed, ...] = ()  # queued requests this offer displaced or found hopeless
    started: tuple[Ticket, ...] = ()  # requests that start now (the offer's own ticket when admitted)


class EdfAdmission:
    """EDF admission over several engines; see the module docstring."""

    def __init__(
        self,
        models: dict[str, ModelLimits],
        max_queued_total: int = 256,
        hopeless_after_slo_x: float | None = 4.0,
        group_inflight: dict[str, int] | None = None,
        service_ewma: float = 0.2,
    ):
        if not models:
            raise ValueError("models must name at least one model")
        for name, lim in models.items():
            if not isinstance(lim, ModelLimits):
                raise ValueError(f"models[{name!r}] must be ModelLimits, got {lim!r}")
        self.models = dict(models)
        self.max_queued_total = _int("max_queued_total", max_queued_total, 0)
        self.hopeless_after_slo_x = None if hopeless_after_slo_x is None else _pos("hopeless_after_slo_x",
                                                                                  hopeless_after_slo_x)  # fmt: skip
        self.group_inflight = {g: _int(f"group_inflight[{g!r}]", c, 1) for g, c in (group_inflight or {}).items()}
        self._alpha = _pos("service_ewma", service_ewma)
        self._seq = 0
        self._queued: dict[str, Ticket] = {}
        self._inflight: dict[str, tuple[Ticket, float]] = {}  # rid -> (ticket, start time)
        self._down: set[str] = set()
        self._restarting: dict[str, float] = {}  # model -> expected time it is back
        self._now = 0.0  # the latest time passed in (for Retry-After of a restarting engine)
        self._service_s: dict[str, float] = {}
        self.counters = {m: {"accepted": 0, "started": 0, "finished": 0, QUEUE_FULL: 0, DEADLINE: 0,
                             ENGINE_DOWN: 0, ENGINE_RESTARTING: 0, "cancelled": 0} for m in self.models}  # fmt: skip

    # ------------------------------------------------------------------ queries
    def queued(self, model: str | None = None) -> list[Ticket]:
        """Queued tickets in EDF order (of one model, or all)."""
        ts = [t for t in self._queued.values() if model is None or t.model == model]
        return sorted(ts, key=Ticket.edf_key)

    def inflight(self, model: str) -> int:
        return sum(1 for t, _ in self._inflight.values() if t.model == model)

    def _group_inflight(self, group: str | None) -> int:
        return sum(1 for t, _ in self._inflight.values() if self.models[t.model].group == group)

    def _competitors(self, model: str) -> list[Ticket]:
        """Queued tickets that compete with a new one of ``model`` for a slot (same model or group)."""
        g = self.models[model].group
        same = lambda t: t.model == model or (g is not None and self.models[t.model].group == g)
        return [t for t in self._queued.values() if same(t)]

    def is_down(self, model: str) -> bool:
        return model in self._down

    def is_restarting(self, model: str) -> bool:
        return model in self._restarting

    def _tick(self, now: float) -> float:
        self._now = max(self._now, now)
        return now

    def _has_slot(self, model: str) -> bool:
        lim = self.models[model]
        if model in self._down or model in self._restarting or self.inflight(model) >= lim.max_inflight:
            return False
        cap = self.group_inflight.get(lim.group) if lim.group is not None else None
        return cap is None or self._group_inflight(lim.group) < cap

    def retry_after_s(self, model: str) -> float:
        """Expected seconds until ``model`` could take one more request (at least 1)."""
        if model in self._down:
            return 5.0
        if model in self._restarting:
            return float(max(1, min(600, math.ceil(self._restarting[model] - self._now))))
        lim = self.models[model]
        waves = 1 + len(self.queued(model)) // lim.max_inflight
        return float(max(1, min(60, math.ceil(self._service_s.get(model, 1.0) * waves))))

    def snapshot(self) -> dict:
        return {
            m: {
                "queued": len(self.queued(m)),
                "inflight": self.inflight(m),
                "down": m in self._down,
                "state": "down" if m in self._down else "restarting" if m in self._restarting else "up",
                "service_s": self._service_s.get(m),
                **self.counters[m],
            }
            for m in self.models
        }

    # ------------------------------------------------------------------ changes
    def _start(self, t: Ticket, now: float) -> None:
        self._inflight[t.rid] = (t, now)
        self.counters[t.model]["started"] += 1

    def _shed(self, t: Ticket, reason: str) -> Shed:
        self._queued.pop(t.rid, None)
        self.counters[t.model][reason] += 1
        return Shed(t, reason, self.retry_after_s(t.model))

    def offer(self, rid: str, model: str, now: float, priority: int | None = None) -> Offer:
        """A new request. Runs ``expire(now)`` first; the returned ``started`` tickets (the new
        one included when admitted) must be handed to their engines, ``shed`` ones refused."""
        if model not in self.models:
            raise KeyError(model)
        if rid in self._queued or rid in self._inflight:
            raise ValueError(f"rid {rid!r} is already known")
        lim = self.models[model]
        self._tick(now)
        self._seq += 1
        t = Ticket(rid, model, now, now + lim.ttft_slo_s, lim.priority if priority is None else priority, self._seq)
        shed = list(self.expire(now))
        if model in self._down:
            self.counters[model][ENGINE_DOWN] += 1
            return Offer(REJECT, t, ENGINE_DOWN, self.retry_after_s(model), tuple(shed))
        if not self._competitors(model) and self._has_slot(model):
            self._start(t, now)
            self.counters[model]["accepted"] += 1
            return Offer(ADMIT, t, shed=tuple(shed), started=(t,))
        pool = None
        if len(self.queued(model)) >= lim.max_queued:
            pool = self.queued(model)
        elif len(self._queued) >= self.max_queued_total:
            pool = self.queued()
        if pool is not None:
            victim = max(pool + [t], key=Ticket.shed_key)
            if victim is t:
                self.counters[model][QUEUE_FULL] += 1
                return Offer(REJECT, t, QUEUE_FULL, self.retry_after_s(model), tuple(shed))
            shed.append(self._shed(victim, QUEUE_FULL))
        self._queued[rid] = t
        self.counters[model]["accepted"] += 1
        started = self.dispatch(now)
        verdict = ADMIT if any(s.rid == rid for s in started) else QUEUE
        return Offer(verdict, t, shed=tuple(shed), started=started)

    def dispatch(self, now: float) -> tuple[Ticket, ...]:
        """Start every queued request that has a slot, in EDF order; returns them."""
        started = []
        for t in self.queued():
            if self._has_slot(t.model):  # no slot for t: none for a later ticket of its model or group either
                self._queued.pop(t.rid)
                self._start(t, now)
                started.append(t)
        return tuple(started)

    def finish(self, rid: str, now: float) -> tuple[Ticket, ...]:
        """An in-flight request ended (any outcome); returns the requests that start in its place."""
        self._tick(now)
        entry = self._inflight.pop(rid, None)
        if entry is not None:
            t, start = entry
            took = max(0.0, now - start)
            prev = self._service_s.get(t.model)
            self._service_s[t.model] = took if prev is None else (1 - self._alpha) * prev + self._alpha * took
            self.counters[t.model]["finished"] += 1
        return self.dispatch(now)

    def cancel(self, rid: str) -> bool:
        """A queued request withdrawn (its client left); False if it was not queued."""
        t = self._queued.pop(rid, None)
        if t is not None:
            self.counters[t.model]["cancelled"] += 1
        return t is not None

    def expire(self, now: float) -> tuple[Shed, ...]:
        """Shed queued requests that are ``hopeless_after_slo_x`` SLOs past their deadline (as
        ``engine_restarting`` when their engine is restarting: it, not the load, kept them)."""
        self._tick(now)
        if self.hopeless_after_slo_x is None:
            return ()
        late = [t for t in self._queued.values()
                if now > t.deadline + self.hopeless_after_slo_x * self.models[t.model].ttft_slo_s]  # fmt: skip
        return tuple(self._shed(t, ENGINE_RESTARTING if t.model in self._restarting else DEADLINE) for t in late)

    def engine_down(self, model: str) -> tuple[Shed, ...]:
        """``model``'s engine is gone for good: refuse it until ``engine_up``; its queue is shed."""
        self._restarting.pop(model, None)
        self._down.add(model)
        return tuple(self._shed(t, ENGINE_DOWN) for t in self.queued(model))

    def engine_restarting(self, model: str, now: float, expected_s: float = 5.0) -> None:
        """``model``'s engine is being restarted, back in about ``expected_s``: its requests queue
        (within the caps) and nothing of it starts until ``engine_up``; ``expire`` sheds the hopeless."""
        self._tick(now)
        self._down.discard(model)
        self._restarting[model] = now + max(0.0, float(expected_s))

    def set_max_inflight(self, model: str, max_inflight: int, now: float) -> tuple[Ticket, ...]:
        """Change ``model``'s in-flight cap (e.g. its awake replicas x the per-engine cap); returns
        the requests that start now that the cap grew. A lower cap starts nothing until the
        model's in-flight count is below it; nothing in flight is taken back. EDF order of the
        waiting requests is unchanged."""
        self._tick(now)
        self.models[model] = replace(self.models[model], max_inflight=max_inflight)  # validated by ModelLimits
        return self.dispatch(now)

    def engine_up(self, model: str, now: float) -> tuple[Ticket, ...]:
        self._tick(now)
        self._down.discard(model)
        self._restarting.pop(model, None)
        return self.dispatch(now)
