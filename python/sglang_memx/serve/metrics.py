"""Prometheus text of the router (``GET /metrics`` on ``sglang-memx serve``'s router).

Measured at the router, per model: requests by HTTP status, TTFT (arrival at the router
-> first byte of the engine's response passed on; for a non-streamed answer that is the
whole answer), TPOT (from SSE events: time between the first and the last event over the
events after the first), SLO attainment against the model's ``ttft_slo_ms`` /
``tpot_slo_ms``, sheds by reason, in-flight requests whose engine failed, retries.
Admission (queue length, in flight) and engine health (state, restarts) are read at
render time from the admission snapshot and the launcher.

Conventions of ``sglang_memx.metrics``, in the same text format (``sglang_memx.prometheus``):
names ``memx_router_*``, ``_total`` counters, ``_seconds`` histograms (``_bucket`` / ``_sum`` /
``_count``), one HELP / TYPE block per name, a ``model`` label on every sample, and a
``replica`` label (0, 1, ...) on the per-engine ones (engine state, restarts, info, the
router's load per replica). Engine state is one gauge per state (1 for the current one) so
dashboards can plot it without knowing the state names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from sglang_memx.prometheus import CONTENT_TYPE, Histogram, Samples, number, render

__all__ = ["RouterMetrics", "Histogram", "CONTENT_TYPE", "TTFT_BUCKETS", "TPOT_BUCKETS"]

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_HELP = {
    "memx_router_queue_length": ("gauge", "Requests waiting in the router for the model's engine."),
    "memx_router_inflight": ("gauge", "Requests handed to the model's engine and not finished."),
    "memx_router_requests_total": ("counter", "Requests answered by the router, by HTTP status."),
    "memx_router_ttft_seconds": ("histogram", "Arrival at the router to the first byte of the response."),
    "memx_router_tpot_seconds": ("histogram", "Time per output event of streamed responses (after the first)."),
    "memx_router_slo_total": ("counter", "Answered requests that met or missed the model's TTFT / TPOT SLO."),
    "memx_router_shed_total": ("counter", "Requests refused or ended by the router, by reason."),
    "memx_router_engine_failures_total": ("counter", "In-flight requests whose engine failed (streamed: bytes sent)."),
    "memx_router_retries_total": ("counter", "Requests retried once after their engine failed before any byte."),
    "memx_router_engine_state": ("gauge", "1 for the engine's current state."),
    "memx_router_engine_up": ("gauge", "1 when the engine serves (awake)."),
    "memx_router_engine_restarts_total": ("counter", "Successful engine restarts."),
    "memx_router_engine_hangs_total": ("counter", "Times the engine was found hung (alive, no health answer), killed."),
    "memx_router_engine_restart_failures_total": ("counter", "Restart attempts that exited or were not healthy."),
    "memx_router_engine_restart_seconds_total": ("counter", "Time from an engine's death to healthy again, summed."),
    "memx_router_engine_last_restart_seconds": ("gauge", "Duration of the engine's last restart."),
    "memx_router_model_info": ("gauge", "Served model: its device and engine URL (value 1), one per replica."),
    "memx_router_replica_inflight": ("gauge", "Requests the router handed to this replica's engine, not finished."),
}


class RouterMetrics:
    """What the router measures itself; ``render`` adds admission and engine health."""

    def __init__(self, models: Iterable[str]):
        self.models = list(models)
        self.ttft = {m: Histogram(TTFT_BUCKETS) for m in self.models}
        self.tpot = {m: Histogram(TPOT_BUCKETS) for m in self.models}
        self.requests = {m: Counter() for m in self.models}  # HTTP status -> n
        self.slo = {m: Counter() for m in self.models}  # (slo, result) -> n
        self.shed = {m: Counter() for m in self.models}  # reason -> n
        self.failures = {m: Counter() for m in self.models}  # streamed ("true" / "false") -> n
        self.retries = {m: Counter() for m in self.models}  # result -> n

    def response(self, model: str, status: int) -> None:
        self.requests[model][int(status)] += 1

    def shed_one(self, model: str, reason: str) -> None:
        self.shed[model][reason] += 1

    def engine_failure(self, model: str, streamed: bool) -> None:
        self.failures[model]["true" if streamed else "false"] += 1

    def retry(self, model: str, result: str) -> None:
        self.retries[model][result] += 1

    def observe_ttft(self, model: str, seconds: float, slo_s: float | None) -> None:
        self.ttft[model].observe(seconds)
        if slo_s is not None:
            self.slo[model][("ttft", "met" if seconds <= slo_s else "missed")] += 1

    def observe_tpot(self, model: str, seconds: float, slo_s: float | None) -> None:
        self.tpot[model].observe(seconds)
        if slo_s is not None:
            self.slo[model][("tpot", "met" if seconds <= slo_s else "missed")] += 1

    def snapshot(self) -> dict:
        """The router-side numbers per model (for /memx/serve and ``sglang-memx top``)."""
        out = {}
        for m in self.models:
            t = self.ttft[m]
            met = self.slo[m][("ttft", "met")]
            judged = met + self.slo[m][("ttft", "missed")]
            out[m] = {
                "requests": {str(k): v for k, v in sorted(self.requests[m].items())},
                "ttft_mean_s": t.sum / t.count if t.count else None,
                "tpot_mean_s": self.tpot[m].sum / self.tpot[m].count if self.tpot[m].count else None,
                "ttft_slo_attainment": met / judged if judged else None,
                "shed": dict(sorted(self.shed[m].items())),
                "engine_failures": dict(self.failures[m]),
                "retries": dict(self.retries[m]),
            }
        return out

    def render(self, admission: dict[str, dict], engines: dict[str, dict], states: Iterable[str]) -> str:
        """Prometheus text format 0.0.4. ``admission``: ``EdfAdmission.snapshot()``;
        ``engines``: model -> the launcher's info of each replica engine (a list, replica 0 first;
        state, restarts, device, url, ``router_inflight``; a dict: one replica; may be empty)."""
        states = list(states)
        out = Samples()
        for m in self.models:
            lab = {"model": m}
            adm = admission.get(m, {})
            out.add("memx_router_queue_length", lab, adm.get("queued", 0))
            out.add("memx_router_inflight", lab, adm.get("inflight", 0))
            for code, n in sorted(self.requests[m].items()):
                out.add("memx_router_requests_total", {**lab, "code": code}, n)
            out.extend("memx_router_ttft_seconds", self.ttft[m].lines("memx_router_ttft_seconds", lab))
            out.extend("memx_router_tpot_seconds", self.tpot[m].lines("memx_router_tpot_seconds", lab))
            for slo in ("ttft", "tpot"):
                for result in ("met", "missed"):
                    n = self.slo[m][(slo, result)]
                    if n or slo == "ttft":
                        out.add("memx_router_slo_total", {**lab, "slo": slo, "result": result}, n)
            for reason, n in sorted(self.shed[m].items()):
                out.add("memx_router_shed_total", {**lab, "reason": reason}, n)
            for streamed in ("false", "true"):
                out.add("memx_router_engine_failures_total", {**lab, "streamed": streamed}, self.failures[m][streamed])
            for result, n in sorted(self.retries[m].items()):
                out.add("memx_router_retries_total", {**lab, "result": result}, n)
            replicas = engines.get(m) or []
            for i, eng in enumerate([replicas] if isinstance(replicas, dict) else replicas):
                self._engine_samples(out, {**lab, "replica": str(i)}, eng, states)
        return render(_HELP, out)

    @staticmethod
    def _engine_samples(out: Samples, lab: dict, eng: dict, states: list[str]) -> None:
        """The per-engine samples of one replica (``lab``: model and replica)."""
        state = eng.get("state")
        if state is not None:
            for s in states:
                out.add("memx_router_engine_state", {**lab, "state": s}, int(s == state))
            out.add("memx_router_engine_up", lab, int(state == "awake"))
        for key, name in (("restarts", "memx_router_engine_restarts_total"),
                          ("hangs", "memx_router_engine_hangs_total"),
                          ("restart_failures", "memx_router_engine_restart_failures_total"),
                          ("restart_seconds_total", "memx_router_engine_restart_seconds_total"),
                          ("last_restart_s", "memx_router_engine_last_restart_seconds"),
                          ("router_inflight", "memx_router_replica_inflight")):  # fmt: skip
            if eng.get(key) is not None:
                out.add(name, lab, number(eng[key]))
        if eng.get("device") is not None or eng.get("url") is not None:
            info = {**lab, "device": eng.get("device") or "", "url": eng.get("url") or ""}
            out.add("memx_router_model_info", info, 1)
