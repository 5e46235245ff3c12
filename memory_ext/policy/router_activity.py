"""Router activity as an input to an engine's memory decisions.

A front router (``sglang-memx serve``) holds requests back (EDF admission, ``max_inflight``
per engine), so an engine whose model has a long router queue looks idle to itself. The
router therefore publishes, per model, what it holds for the model's engines: requests
queued in the router, requests in flight to the engines, the arrival rate (an exponentially
weighted rate, requests/s), the seconds since the last arrival, and an estimate of the KV
tokens the queued requests will need. The engine turns these numbers into its own decisions
with the functions below.

Numbers in, decisions out: nothing here sleeps, does I/O or reads a clock (time is passed
in). Invariants:

* an ``Activity`` is valid (every field checked by ``parse_activity``, errors name the field)
  and carries the receiver's own clock (``received_at``), so a sender's clock never matters;
* an activity older than its ``ttl_s`` is ``None`` for every decision (a dead router's last
  word expires; the engine then decides from its own queue alone, as without a router);
* the decisions only ever make an engine keep more (busy, more headroom, awake, lend less),
  never less than it would without a router.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Activity",
    "ActivityError",
    "ArrivalRate",
    "parse_activity",
    "live",
    "expected_arrival_s",
    "queued_demand_tokens",
    "report_numbers",
    "may_sleep",
    "wake_ahead",
    "lend_fraction",
    "DEFAULT_TTL_S",
    "MAX_TTL_S",
]

DEFAULT_TTL_S = 5.0  # a router pushes at least every ~1 s while anything is non-zero
MAX_TTL_S = 600.0


class ActivityError(ValueError):
    """A malformed activity message; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Activity:
    """One model's activity as its router last published it.

    queued          requests waiting for the model in the router (not yet at the engine)
    inflight        requests the router handed to the model's engines and not finished
    arrival_rate    requests/s arriving at the router for the model (exponentially weighted)
    queued_tokens   estimated KV tokens of the queued requests; None: the router did not say
    since_arrival_s seconds between the last arrival and the router's send; None: none yet
    ttl_s           how long this message stays true after it is received
    received_at     the receiver's monotonic clock when it arrived
    """

    queued: int
    inflight: int
    arrival_rate: float
    queued_tokens: int | None
    since_arrival_s: float | None
    ttl_s: float
    received_at: float

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.received_at)

    def as_dict(self, now: float) -> dict:
        return {"queued": self.queued, "inflight": self.inflight, "arrival_rate": round(self.arrival_rate, 6),
                "queued_tokens": self.queued_tokens,
                "since_arrival_s": None if self.since_arrival_s is None else round(self.since_arrival_s, 3),
                "ttl_s": self.ttl_s, "age_s": round(self.age_s(now), 3),
                "live": live(self, now) is not None}  # fmt: skip


def _count(doc: Mapping, name: str, optional: bool = False) -> int | None:
    v = doc.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ActivityError(name, f"must be a non-negative integer, got {v!r}")
    return v


def _seconds(doc: Mapping, name: str, optional: bool = False, positive: bool = False) -> float | None:
    v = doc.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        kind = "a positive" if positive else "a non-negative"
        raise ActivityError(name, f"must be {kind} finite number, got {v!r}")
    return float(v)


FIELDS = ("queued", "inflight", "arrival_rate", "queued_tokens", "since_arrival_s", "ttl_s", "model")


def parse_activity(doc, now: float) -> Activity:
    """Check a message (a JSON object) and stamp it with the receiver's ``now``. Required:
    ``queued``, ``inflight`` (integers >= 0), ``arrival_rate`` (>= 0); optional:
    ``queued_tokens`` (integer >= 0), ``since_arrival_s`` (>= 0), ``ttl_s`` (> 0, at most
    ``MAX_TTL_S``; default ``DEFAULT_TTL_S``), ``model`` (a string, informational). Unknown
    fields are refused (a misspelt field would otherwise be silently ignored)."""
    if not isinstance(doc, Mapping):
        raise ActivityError("body", f"must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(str(k) for k in doc if k not in FIELDS)
    if unknown:
        raise ActivityError(unknown[0], f"unknown field (known: {', '.join(FIELDS)})")
    if "model" in doc and not isinstance(doc["model"], str):
        raise ActivityError("model", f"must be a string, got {doc['model']!r}")
    ttl = _seconds(doc, "ttl_s", optional=True, positive=True)
    if ttl is not None and ttl > MAX_TTL_S:
        raise ActivityError("ttl_s", f"must be at most {MAX_TTL_S:g} s, got {ttl!r}")
    return Activity(
        queued=_count(doc, "queued"),
        inflight=_count(doc, "inflight"),
        arrival_rate=_seconds(doc, "arrival_rate"),
        queued_tokens=_count(doc, "queued_tokens", optional=True),
        since_arrival_s=_seconds(doc, "since_arrival_s", optional=True),
        ttl_s=DEFAULT_TTL_S if ttl is None else ttl,
        received_at=float(now),
    )


def live(act: Activity | None, now: float) -> Activity | None:
    """``act`` while younger than its TTL, else None."""
    if act is None or now - act.received_at > act.ttl_s:
        return None
    return act


def expected_arrival_s(act: Activity | None, now: float) -> float | None:
    """Seconds since the router's last arrival for the model, on the receiver's clock (None:
    no live activity or no arrival yet)."""
    act = live(act, now)
    if act is None or act.since_arrival_s is None:
        return None
    return act.since_arrival_s + act.age_s(now)


def _waiting(act: Activity | None) -> bool:
    return act is not None and (act.queued > 0 or act.inflight > 0)


def queued_demand_tokens(act: Activity | None, now: float, tokens_per_request: int) -> int:
    """KV tokens the router's queued requests will need: the router's estimate, else
    ``tokens_per_request`` per queued request."""
    act = live(act, now)
    if act is None or act.queued == 0:
        return 0
    if act.queued_tokens is not None:
        return act.queued_tokens
    return act.queued * max(0, int(tokens_per_request))


def report_numbers(idle: int, headroom: int, busy: bool, act: Activity | None, now: float,
                   queued_chunks: int) -> tuple[int, bool]:  # fmt: skip
    """The ``(headroom, busy)`` an engine reports to the arbiter, given its own numbers and the
    router's activity. ``queued_chunks``: the router-queued demand (``queued_demand_tokens``)
    in pool chunks. A model with requests queued or in flight at the router has work (so its
    idle memory is not taken as an idle peer's, IDLE_PEER) and keeps idle memory for the
    queued demand on top of its own queue's (SURPLUS leaves it), within what is idle."""
    act = live(act, now)
    if not _waiting(act):
        return headroom, busy
    return min(idle, headroom + max(0, queued_chunks)), True


def may_sleep(act: Activity | None, now: float, sleep_after_s: float) -> bool:
    """Whether the router lets an idle engine fall asleep: not while it holds requests for the
    model (queued or in flight), nor within ``sleep_after_s`` of the router's last arrival."""
    act = live(act, now)
    if act is None:
        return True
    if _waiting(act):
        return False
    since = expected_arrival_s(act, now)
    return since is None or since >= sleep_after_s


def wake_ahead(act: Activity | None, now: float) -> bool:
    """Whether a sleeping engine should start waking now: the router holds requests for it
    (they reach the engine only later, e.g. behind other models' in-flight requests)."""
    return _waiting(live(act, now))


def lend_fraction(act: Activity | None, now: float, idle_after_s: float) -> float:
    """The share of its lendable layers an inactive model offers its peers, by the router's
    arrival rate: all without router activity; none while the router holds requests for it or
    when it expects at least one arrival within ``idle_after_s``; else ``1 - rate *
    idle_after_s``. The arbiter takes from the donor with the most lendable first, so among
    idle models the one with the lowest arrival rate lends first."""
    act = live(act, now)
    if act is None:
        return 1.0
    if _waiting(act):
        return 0.0
    return max(0.0, 1.0 - act.arrival_rate * max(0.0, idle_after_s))


class ArrivalRate:
    """Arrivals per second, exponentially weighted with time constant ``window_s``: each
    arrival adds ``1 / window_s``, and the sum decays by ``exp(-dt / window_s)``. A steady
    stream of r requests/s reads r; with no arrivals the rate decays towards 0."""

    def __init__(self, window_s: float = 10.0):
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
            raise ValueError(f"window_s must be a positive number, got {window_s!r}")
        self.window_s = float(window_s)
        self._value = 0.0
        self._at: float | None = None
        self.last_arrival: float | None = None

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._at) / self.window_s)

    def arrive(self, now: float) -> None:
        self._value = self._decayed(now) + 1.0 / self.window_s
        self._at = now
        self.last_arrival = now

    def rate(self, now: float) -> float:
        return self._decayed(now)
