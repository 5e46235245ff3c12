"""The router's view of each model's engines: their states, the requests it handed to each, which
replica takes the next request, and how they are shown (``/health``, ``/memx/serve``, ``/metrics``).

Replicas: a model with several engines (``EngineRoute.replicas``) sends each request to one
of its awake replicas, the least loaded (requests the router has handed to it and not
finished: in flight or queued at the engine), ties by round-robin; a replica that is
restarting, dead or sleeping is skipped while another is awake (a sleeping one is chosen
when none is awake: the request wakes it). The model is awake while any replica is,
``dead`` only when all are.

Invariants: ``load[key]`` is raised once per request handed to engine ``key`` and lowered
once when that request finishes (``router_admission.Slot``); states are read from the
supervisor at each call, never cached here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EngineRoute", "Engines", "ENGINE_STATES", "AWAKE", "DEAD", "SLEEPING"]

# The launcher's engine states (``launcher.ENGINE_STATES``; not imported: the router runs without it).
AWAKE, DEAD, SLEEPING = "awake", "dead", "sleeping"
ENGINE_STATES = ("starting", "awake", "sleeping", "waking", "restarting", "dead")


@dataclass(frozen=True)
class EngineRoute:
    name: str
    url: str  # the engine's base URL
    path: str  # the model's checkpoint directory (shown in /v1/models)
    device: str | None = None
    tpot_slo_s: float | None = None  # the model's TPOT SLO (metrics; admission uses the TTFT SLO)
    replicas: tuple[tuple[str, str], ...] = ()  # (engine key, base URL) of each replica; () = ((name, url),)

    @property
    def engines(self) -> tuple[tuple[str, str], ...]:
        """(engine key, URL) of every replica; ``engine_state`` / ``engine_info`` take the key."""
        return self.replicas or ((self.name, self.url),)


class Engines:
    """Every model's engines as the router sees them. ``state_of(key)``: one of ``ENGINE_STATES``
    (the supervisor's); ``info_of(key)``: the supervisor's numbers (restarts, sleep, ...)."""

    def __init__(self, routes: dict[str, EngineRoute], state_of: Callable[[str], str],
                 info_of: Callable[[str], dict]):  # fmt: skip
        self.routes = routes
        self.state_of = state_of
        self.info_of = info_of
        self.load = {key: 0 for r in routes.values() for key, _ in r.engines}  # handed to the engine, not finished
        self._turn = dict.fromkeys(routes, 0)  # round-robin start among equally loaded replicas

    # ------------------------------------------------------------------ states
    def sleeping(self, key: str) -> bool:
        return (self.info_of(key).get("sleep") or {}).get("state") == SLEEPING

    def model_state(self, name: str) -> str:
        """Awake while any replica is awake, dead when all are; else the first replica's other state."""
        states = [self.state_of(k) for k, _ in self.routes[name].engines]
        if AWAKE in states:
            return AWAKE
        return next((st for st in states if st != DEAD), DEAD)

    def awake_replicas(self, name: str) -> int:
        return sum(self.state_of(k) == AWAKE for k, _ in self.routes[name].engines)

    def live_urls(self, name: str) -> list[str]:
        """The base URLs of the model's engines that are not dead."""
        return [u for k, u in self.routes[name].engines if self.state_of(k) != DEAD]

    def expected_ready_s(self, name: str) -> float:
        """How long the model's engines expect a (re)start to take (5 s when none says)."""
        ready = [self.info_of(k).get("expected_ready_s") for k, _ in self.routes[name].engines
                 if self.state_of(k) != DEAD]  # fmt: skip
        return float(min([r for r in ready if r] or [5.0]))

    # ------------------------------------------------------------------ replica choice
    def pick(self, name: str) -> tuple[str, str] | None:
        """The replica for the next request: awake and not sleeping, else awake (a sleeping one
        wakes on the request); the least loaded of those, ties by round-robin. None: none awake."""
        engines = self.routes[name].engines
        awake = [(k, u) for k, u in engines if self.state_of(k) == AWAKE]
        pool = [(k, u) for k, u in awake if not self.sleeping(k)] or awake
        if not pool:
            return None
        start = self._turn[name] % len(engines)
        order = {k: (i - start) % len(engines) for i, (k, _) in enumerate(engines)}
        self._turn[name] += 1
        return min(pool, key=lambda ku: (self.load[ku[0]], order[ku[0]]))

    # ------------------------------------------------------------------ shown states
    def engine_shown_state(self, key: str) -> str:
        """The supervisor's state, with an awake engine's own sleep state (``--memx-sleep-after-s``):
        a sleeping engine still takes requests (the first one wakes it)."""
        state = self.state_of(key)
        return SLEEPING if state == AWAKE and self.sleeping(key) else state

    def shown_state(self, name: str) -> str:
        """The model's state: sleeping when it is awake only through sleeping replicas."""
        st = self.model_state(name)
        keys = [k for k, _ in self.routes[name].engines if self.state_of(k) == AWAKE]
        return SLEEPING if st == AWAKE and all(self.sleeping(k) for k in keys) else st

    def replicas_doc(self, name: str) -> list[dict]:
        r = self.routes[name]
        out = []
        for i, (k, url) in enumerate(r.engines):
            info = self.info_of(k)
            out.append({"device": info.get("device") or r.device, **info, "url": url, "engine": k, "replica": i,
                        "state": self.engine_shown_state(k), "router_inflight": self.load[k]})  # fmt: skip
        return out

    def engines_doc(self) -> dict:
        return {n: self.replicas_doc(n) for n in self.routes}
