"""Changing a running server's TPOT SLO: ``POST /memx/slo`` with ``{"tpot_slo_ms": <ms or null>}``.

An operator tightens or loosens the SLO the governor keeps without a restart (what the models
learned, the pool and the requests in flight stay). The HTTP process checks the body against the
server's configuration (``parse``: 400 naming the field for a bad body, 409 when this server cannot
hold the change) and hands the number to every scheduler over upstream's own ``set_internal_state``
request (key ``memx_slo_tpot_ms``, ``-1`` for null: the request carries numbers only); the scheduler
hook applies it between two iterations (``apply``), on every tensor-parallel rank in the same
iteration, as every request reaches them. Every consumer of the TPOT SLO takes it:

* the governor (``coordinator.governor.GovernorPart``): its batch cap and the parking rule; null
  leaves the governor without a given SLO, as ``--memx-governor`` alone does (its measured default
  SLO, ``memory_ext.policy.default_slo``, holds again);
* the remappable weights' step SLO when it was the TPOT SLO (an explicit ``--memx-tbt-slo-ms`` wins
  and stays);
* the host buffer's SLO rule (``--memx-ttft-slo-ms``), which needs a TPOT SLO: null is refused there.

The status then names ``POST /memx/slo`` as the SLO's source. Invariant: a refused update changes
nothing on any rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_memx.config import TPOT_SLO_FLAG, MemxConfig
from sglang_memx.coordinator.components import WeightLender
from sglang_memx.coordinator.device import Coordinator
from sglang_memx.coordinator.governor import GovernorPart

SLO_PATH = "/memx/slo"
SOURCE = f"POST {SLO_PATH}"
FIELD = "tpot_slo_ms"
WIRE_KEY = "memx_slo_tpot_ms"
_NONE = -1.0  # the wire's null
_TBT_FLAG = "--memx-tbt-slo-ms"


@dataclass(frozen=True)
class SloUpdateError(ValueError):
    """A body this server refuses: ``field`` names what is wrong, ``status`` is the HTTP code."""

    field: str
    message: str
    status: int = 400

    def __str__(self) -> str:
        return self.message


def parse(doc, config: MemxConfig) -> float | None:
    """The TPOT SLO in milliseconds (None: clear it) that ``doc`` asks of a server run with ``config``."""
    if not isinstance(doc, dict):
        raise SloUpdateError("body", f'body: must be a JSON object like {{"{FIELD}": 50}}, got {type(doc).__name__}')
    for key in doc:
        if key != FIELD:
            why = ("sizes the host buffer at start; not settable at run time" if key == "ttft_slo_ms"
                   else f"unknown field; the one settable field is {FIELD}")  # fmt: skip
            raise SloUpdateError(str(key), f"{key}: {why}")
    if FIELD not in doc:
        raise SloUpdateError(FIELD, f"{FIELD}: missing (a number of milliseconds > 0, or null to clear it)")
    value = doc[FIELD]
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):  # fmt: skip
        raise SloUpdateError(FIELD, f"{FIELD}: must be a finite number of milliseconds > 0, or null; got {value!r}")
    if not config.governed:
        raise SloUpdateError(FIELD, f"{FIELD}: this server runs without the governor; start it with "
                             f"{TPOT_SLO_FLAG} or --memx-governor (with --memx-elastic-kv)", 409)  # fmt: skip
    if value is None and config.ttft_slo_ms is not None:
        raise SloUpdateError(FIELD, f"{FIELD}: null refused: the host buffer's SLO rule (--memx-ttft-slo-ms) "
                             f"needs a TPOT SLO", 409)  # fmt: skip
    return None if value is None else float(value)


def to_wire(tpot_ms: float | None) -> dict[str, float]:
    """``tpot_ms`` as the numeric ``server_args`` of upstream's ``SetInternalStateReq``."""
    return {WIRE_KEY: _NONE if tpot_ms is None else float(tpot_ms)}


def is_update(fields) -> bool:
    return isinstance(fields, dict) and set(fields) == {WIRE_KEY}


def from_wire(fields: dict) -> float | None:
    value = fields[WIRE_KEY]
    return None if value == _NONE else float(value)


def apply(coordinator: Coordinator | None, tpot_ms: float | None) -> bool:
    """Give every consumer of the TPOT SLO on this rank ``tpot_ms``; False (nothing changed) when
    this rank has no governor or its host buffer's rule would be left without a TPOT SLO."""
    governor = None if coordinator is None else coordinator.part(GovernorPart)
    if governor is None:
        return False
    host = coordinator.host_buffer()
    rule = None if host is None else host.rule
    if rule is not None and tpot_ms is None:
        return False
    governor.governor.set_tpot_slo(None if tpot_ms is None else tpot_ms / 1e3)
    governor.tpot_source = SOURCE
    if rule is not None:
        rule.scaler.set_tpot_slo(tpot_ms / 1e3)
    lender = coordinator.part(WeightLender)
    if lender is not None and lender.weights.tbt_slo_source != _TBT_FLAG:
        lender.weights.tbt_slo_s = None if tpot_ms is None else tpot_ms / 1e3
        lender.weights.tbt_slo_source = None if tpot_ms is None else SOURCE
    return True
