"""An engine's side of router activity (``POST /memx/activity``, ``sglang-memx serve``'s router).

The HTTP process checks the message (``memory_ext.policy.router_activity.parse_activity``) and
hands it to the scheduler over upstream's own ``set_internal_state`` request (numbers only, keys
``memx_activity_*``; the scheduler hook answers them and passes every other key to upstream), so
no new IPC channel is needed. The scheduler keeps the latest message (one per process: one
scheduler per process), stamped with its own clock; the decisions are the policy module's, the
functions here only pass numbers to it:

* ``report_numbers``: the busy flag and headroom the shared pool reports to the arbiter;
* ``may_sleep`` / ``wake_ahead``: the weights sleep controller (``weights/sleep.py``);
* ``lend_fraction``: the share of its lendable layers an inactive model offers (``weights/lending.py``).

Invariant: a message older than its TTL changes nothing (the engine then decides as it does
without a router).
"""

from __future__ import annotations

import math
import time

from memory_ext.policy import router_activity as policy
from memory_ext.pool.kv_space import KVSpace

PREFIX = "memx_activity_"
_NONE = -1.0  # the wire's None (upstream's request carries numbers only)
_WIRE = ("queued", "inflight", "arrival_rate", "queued_tokens", "since_arrival_s", "ttl_s")

_latest: policy.Activity | None = None
received_total = 0


# ------------------------------------------------------------------ HTTP process
def to_wire(act: policy.Activity) -> dict[str, float | int]:
    """``act`` as the numeric ``server_args`` of upstream's ``SetInternalStateReq``."""
    out: dict[str, float | int] = {}
    for name in _WIRE:
        v = getattr(act, name)
        out[PREFIX + name] = _NONE if v is None else v
    return out


# ------------------------------------------------------------------ scheduler process
def is_activity(fields) -> bool:
    return isinstance(fields, dict) and bool(fields) and all(str(k).startswith(PREFIX) for k in fields)


def receive(fields: dict, now: float | None = None) -> policy.Activity:
    """Keep the activity carried by ``fields`` (``to_wire``'s output); raises ``ActivityError``."""
    global _latest, received_total
    doc = {}
    for name in _WIRE:
        v = fields.get(PREFIX + name)
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == _NONE):
            continue
        if name in ("queued", "inflight", "queued_tokens") and isinstance(v, float) and v.is_integer():
            v = int(v)
        doc[name] = v
    _latest = policy.parse_activity(doc, time.monotonic() if now is None else now)
    received_total += 1
    return _latest


def current() -> policy.Activity | None:
    """The latest message (live or not; the policy functions check the TTL)."""
    return _latest


def reset() -> None:
    global _latest, received_total
    _latest, received_total = None, 0


def status(now: float | None = None) -> dict | None:
    """The /memx/status section: the last message received (None: never), its age and whether it is live."""
    if _latest is None:
        return None
    return dict(_latest.as_dict(time.monotonic() if now is None else now), received_total=received_total)


def report_numbers(kv: KVSpace, idle: int, headroom: int, busy: bool) -> tuple[int, bool]:
    """The shared pool's report with the router's queued demand (tokens -> whole KV groups' chunks)."""
    now = time.monotonic()
    act = policy.live(_latest, now)
    if act is None:
        return headroom, busy
    rows, cpg = kv.buffers.group_rows, kv.buffers.chunks_per_group
    tokens = policy.queued_demand_tokens(act, now, tokens_per_request=rows)
    return policy.report_numbers(idle, headroom, busy, act, now, math.ceil(tokens / rows) * cpg)


def may_sleep(sleep_after_s: float) -> bool:
    return policy.may_sleep(_latest, time.monotonic(), sleep_after_s)


def wake_ahead() -> bool:
    return policy.wake_ahead(_latest, time.monotonic())


def holds_requests() -> bool:
    """Whether the router holds requests (queued or in flight) for this model now."""
    return policy.wake_ahead(_latest, time.monotonic())


def lend_fraction(idle_after_s: float) -> float:
    return policy.lend_fraction(_latest, time.monotonic(), idle_after_s)
