"""The router's admission part: the gate kept told of each model's engines, and the slot a request holds.

The model's admission cap is the per-engine ``max_inflight`` x its awake replicas (at
least one). A model that is starting, restarting, sleeping or waking makes requests wait
(within the horizon the gate computes from the engines' expected ready time); a dead one
sheds them.

Invariants:

* The gate hears of a model's state only when it changed (``sync``), and ``sync`` runs
  before each request and every ``monitor_interval_s`` (so a request never waits on a dead
  engine longer than that).
* A ``Slot`` is released exactly once whatever path the request takes (refusal, retry,
  the body's end, the client gone): its admission slot is left and its replica's load lowered.
"""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse

from .admission import AdmissionGate
from .metrics import RouterMetrics
from .router_engines import AWAKE, DEAD, Engines
from .router_errors import error_response

__all__ = ["Admission", "Slot"]


class Slot:
    """The admission slot (``rid``) and the replica load (``key``) one request holds."""

    def __init__(self, gate: AdmissionGate, load: dict[str, int]):
        self._gate = gate
        self._load = load
        self.rid = None
        self.key: str | None = None

    async def enter(self, name: str, tokens: int) -> None:
        """Wait for an admission slot of ``name``; raises ``Rejected``."""
        self.rid = await self._gate.enter(name, tokens=tokens)

    def hold(self, key: str) -> None:
        """The request is handed to engine ``key``."""
        self.key = key
        self._load[key] += 1

    def release(self) -> None:
        if self.rid is not None:
            self._gate.leave(self.rid)
            self.rid = None
        if self.key is not None:
            self._load[self.key] -= 1
            self.key = None


class Admission:
    """Keeps ``gate`` told of each model's state and cap; refusals are counted in ``metrics``."""

    def __init__(self, gate: AdmissionGate, engines: Engines, metrics: RouterMetrics, failure_detect_s: float):
        self.gate = gate
        self.engines = engines
        self.metrics = metrics
        self.failure_detect_s = failure_detect_s
        self._known: dict[str, str] = {}  # the engine state the gate was last told
        routes = engines.routes
        self._per_engine_cap = {n: gate.policy.models[n].max_inflight for n in routes}  # the config's, per engine
        self._caps = dict(self._per_engine_cap)  # the model's cap the gate was last given

    def slot(self) -> Slot:
        return Slot(self.gate, self.engines.load)

    def sync(self, name: str) -> str:
        """Tell the gate the model's current state (when it changed) and its cap (awake
        replicas x the per-engine cap, when it has several); returns the state."""
        st = self.engines.model_state(name)
        if len(self.engines.routes[name].engines) > 1:
            cap = self._per_engine_cap[name] * max(1, self.engines.awake_replicas(name))
            if self._caps[name] != cap:
                self._caps[name] = cap
                self.gate.set_max_inflight(name, cap)
        if self._known.get(name) != st:
            self._known[name] = st
            if st == AWAKE:
                self.gate.engine_up(name)
            elif st == DEAD:
                self.gate.engine_down(name)
            else:  # starting / restarting / sleeping / waking: requests wait for it
                self.gate.engine_restarting(name, self.engines.expected_ready_s(name))
        return st

    async def monitor(self, interval_s: float) -> None:
        """Every ``interval_s``: every model synced, the gate's hopeless requests expired."""
        while True:
            for name in self.engines.routes:
                self.sync(name)
            self.gate.expire()
            await asyncio.sleep(interval_s)

    async def engine_failed(self, name: str, key: str) -> bool:
        """True when the engine ``key`` of ``name`` left ``awake`` (died) within ``failure_detect_s``."""
        deadline = time.monotonic() + self.failure_detect_s
        while True:
            self.sync(name)
            if self.engines.state_of(key) != AWAKE:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ refusals
    def refuse(self, name: str, resp: JSONResponse, reason: str) -> JSONResponse:
        """``resp``, counted as a shed request of ``name`` for ``reason`` and as a response."""
        self.metrics.shed_one(name, reason)
        self.metrics.response(name, resp.status_code)
        return resp

    def unavailable(self, name: str, st: str, message: str) -> JSONResponse:
        """503 for a model whose engines are in state ``st``: ``engine_down`` when dead, else
        ``engine_restarting``; with the gate's ``Retry-After``."""
        code = "engine_down" if st == DEAD else "engine_restarting"
        resp = error_response(503, message, code=code, retry_after_s=self.gate.retry_after_s(name))
        return self.refuse(name, resp, code)
