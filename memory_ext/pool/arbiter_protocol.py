"""Wire format of the per-device arbiter (see ``arbiter`` and ``arbiter_client``).

Transport: one ``SOCK_SEQPACKET`` Unix socket per client (``vmm.ipc.listen_unix``,
file mode 0600). Every message is one packet:

* **control message**: a UTF-8 JSON object (first byte ``{``), no fds;
* **GRANT**: a ``vmm.ipc.send_chunks`` packet (4-byte length prefix, so its
  first byte is never ``{``) whose ``meta`` is the GRANT object and whose fds
  are the granted chunks, in the order of ``meta["chunks"]``.

Client -> arbiter::

    {"type": "HELLO",  "req_id": R, "version": 1, "name": str, "pid": int}
    {"type": "BORROW", "req_id": R, "n": 1..253, "owner": "kv"|"activation"|...}
    {"type": "RETURN", "req_id": R, "chunks": [arbiter chunk id, ...]}
    {"type": "STATUS", "req_id": R}
    {"type": "REPORT", "req_id": R, "idle": int, "headroom": int, "busy": bool}   (no reply)
    {"type": "LINK",   "req_id": R, "active": bool, "num_layers": int, "layer_bytes": int,
     "link_bytes_per_s": number, "min_interval": int|null, "iter_times": [number, ...]}
    {"type": "ADOPT",  "req_id": R, "n": 1..2^40}
    {"type": "RELEASE", "req_id": R, "n": 1..2^40}

``ADOPT`` rebuilds the books after an arbiter died: the client still holds ``n`` chunks
of memory no live arbiter lent it (it kept them privately, ``lent_pool``). The arbiter
books as many as its budget allows (``budget`` minus every chunk held, FREE chunks
destroyed to make room) as held by that client, without fds (they never become FREE);
``ADOPTED`` says how many. ``RELEASE`` says the client destroyed ``n`` adopted chunks
(ERROR ``n`` if it has fewer adopted): they leave ``created``, so the budget can be
created anew. A client's adopted chunks leave the books the same way when it disconnects.

``REPORT`` is the client's numbers for the arbiter's policy (chunks it could give back
now, chunks of those its own queue wants to keep, whether it has work); the arbiter
answers only a malformed one (ERROR).

``LINK`` is the client's Select-N demand on the host link the pool's processes share
(``policy.select_n.GpuDemand``: ``iter_times[i - 1]`` is the modelled iteration time at
interval ``i``, ``num_layers + 1`` entries; ``active`` false withdraws it). The arbiter
answers ``LINKED`` with the interval ``LinkCoordinator`` picks jointly for every active
demand (``null``: none fits, stream nothing more).

Arbiter -> client::

    {"type": "WELCOME", "req_id": R, "client_id": int, "granularity": int,
     "budget": int, "floor": int}
    {"type": "GRANT",   "req_id": R, "owner": str, "chunks": [ids]}      (+ fds)
    {"type": "DENY",    "req_id": R, "reason": str, "available": int}
    {"type": "ACK",     "req_id": R, "returned": int}
    {"type": "ADOPTED", "req_id": R, "adopted": int}
    {"type": "STATUS",  "req_id": R, "budget": int, "created": int, "free": int, "adopted": int,
     "floor": int, "pending": int, "reclaim_by_tier": {tier: chunks}, "clients": [{...}, ...]}
    {"type": "LINKED",  "req_id": R, "interval": int|null, "sharing": int, "reason": str}
    {"type": "RECLAIM", "n": int}                       (unsolicited)
    {"type": "ERROR",   "req_id": R|null, "field": str, "message": str}

Every message is validated strictly: the ``type`` must be known, the set of
fields must be exactly the schema's (a missing or extra field is an error
naming it), ints are real ints (not bools) inside their range. A violation
raises ``ProtocolError(field, message)``; the arbiter answers it with ERROR.
``decode`` raises nothing else, whatever the bytes (invalid UTF-8 or JSON, an
int literal too long for Python to convert, nesting too deep to parse: field
``message``); ``test/unit/test_arbiter_fuzz.py`` checks this against a live
arbiter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from .ownership import Owner

PROTOCOL_VERSION = 4  # 3: LINK / LINKED (the shared host link); 4: ADOPT / ADOPTED / RELEASE
MAX_ADOPT = 1 << 40  # chunks one ADOPT / RELEASE may name
MAX_MESSAGE_BYTES = 1 << 16
MAX_CHUNKS_PER_MESSAGE = 253  # SCM_MAX_FD: one GRANT carries at most this many fds
MAX_RETURN_IDS = 4096
MAX_NAME_LEN = 128
MAX_LINK_LAYERS = 1024  # decoder layers a LINK demand may describe
OWNERS = tuple(o.value for o in Owner if o is not Owner.FREE)


class ProtocolError(ValueError):
    """A message that does not follow the schema; ``field`` names the culprit."""

    def __init__(self, field: str, message: str, req_id: int | None = None):
        self.field, self.req_id = field, req_id
        super().__init__(f"{field}: {message}")
        self.detail = message


Validator = Callable[[str, Any], None]


def _int(lo: int | None = None, hi: int | None = None) -> Validator:
    def check(field: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(field, f"expected an int, got {type(v).__name__}")
        if lo is not None and v < lo:
            raise ProtocolError(field, f"expected >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ProtocolError(field, f"expected <= {hi}, got {v}")

    return check


def _str(max_len: int = 1024, min_len: int = 0) -> Validator:
    def check(field: str, v: Any) -> None:
        if not isinstance(v, str):
            raise ProtocolError(field, f"expected a string, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise ProtocolError(field, f"expected {min_len}..{max_len} characters, got {len(v)}")

    return check


def _owner(field: str, v: Any) -> None:
    if not isinstance(v, str) or v not in OWNERS:
        raise ProtocolError(field, f"expected one of {list(OWNERS)}, got {v!r:.40}")


def _ids(max_len: int, min_len: int = 1) -> Validator:
    def check(field: str, v: Any) -> None:
        if not isinstance(v, list):
            raise ProtocolError(field, f"expected a list of chunk ids, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise ProtocolError(field, f"expected {min_len}..{max_len} ids, got {len(v)}")
        for i, x in enumerate(v):
            _int(0)(f"{field}[{i}]", x)
        if len(set(v)) != len(v):
            raise ProtocolError(field, "duplicate chunk ids")

    return check


def _version(field: str, v: Any) -> None:
    _int()(field, v)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(field, f"unsupported protocol version {v}, expected {PROTOCOL_VERSION}")


def _counts(field: str, v: Any) -> None:
    if not isinstance(v, dict) or not all(isinstance(k, str) and _is_count(n) for k, n in v.items()):
        raise ProtocolError(field, "expected an object of non-negative ints")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bool(field: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ProtocolError(field, f"expected true or false, got {type(v).__name__}")


def _opt_req_id(field: str, v: Any) -> None:
    if v is not None:
        _int(0)(field, v)


def _clients(field: str, v: Any) -> None:
    if not isinstance(v, list) or not all(isinstance(c, dict) for c in v):
        raise ProtocolError(field, "expected a list of objects")


def _positive_number(field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ProtocolError(field, f"expected a finite number > 0, got {v!r:.40}")


def _opt_interval(field: str, v: Any) -> None:
    if v is not None:
        _int(1, MAX_LINK_LAYERS + 1)(field, v)


def _iter_times(field: str, v: Any) -> None:
    if not isinstance(v, list) or not 2 <= len(v) <= MAX_LINK_LAYERS + 1:
        raise ProtocolError(field, f"expected a list of 2..{MAX_LINK_LAYERS + 1} iteration times")
    for i, t in enumerate(v):
        _positive_number(f"{field}[{i}]", t)


_REQ = _int(0)
_COUNT = _int(0)

CLIENT_SCHEMAS: dict[str, dict[str, Validator]] = {
    "HELLO": {"req_id": _REQ, "version": _version, "name": _str(MAX_NAME_LEN, 1), "pid": _int(1)},
    "BORROW": {"req_id": _REQ, "n": _int(1, MAX_CHUNKS_PER_MESSAGE), "owner": _owner},
    "RETURN": {"req_id": _REQ, "chunks": _ids(MAX_RETURN_IDS)},
    "STATUS": {"req_id": _REQ},
    "REPORT": {"req_id": _REQ, "idle": _COUNT, "headroom": _COUNT, "busy": _bool},
    "LINK": {
        "req_id": _REQ,
        "active": _bool,
        "num_layers": _int(1, MAX_LINK_LAYERS),
        "layer_bytes": _int(1),
        "link_bytes_per_s": _positive_number,
        "min_interval": _opt_interval,
        "iter_times": _iter_times,
    },
    "ADOPT": {"req_id": _REQ, "n": _int(1, MAX_ADOPT)},
    "RELEASE": {"req_id": _REQ, "n": _int(1, MAX_ADOPT)},
}

SERVER_SCHEMAS: dict[str, dict[str, Validator]] = {
    "WELCOME": {"req_id": _REQ, "client_id": _int(1), "granularity": _int(1), "budget": _COUNT, "floor": _COUNT},
    "GRANT": {"req_id": _REQ, "owner": _owner, "chunks": _ids(MAX_CHUNKS_PER_MESSAGE)},
    "DENY": {"req_id": _REQ, "reason": _str(), "available": _COUNT},
    "ACK": {"req_id": _REQ, "returned": _COUNT},
    "ADOPTED": {"req_id": _REQ, "adopted": _COUNT},
    "STATUS": {
        "req_id": _REQ,
        "budget": _COUNT,
        "created": _COUNT,
        "free": _COUNT,
        "adopted": _COUNT,
        "floor": _COUNT,
        "pending": _COUNT,
        "reclaim_by_tier": _counts,
        "clients": _clients,
    },
    "LINKED": {"req_id": _REQ, "interval": _opt_interval, "sharing": _COUNT, "reason": _str(4096)},
    "RECLAIM": {"n": _int(1)},
    "ERROR": {"req_id": _opt_req_id, "field": _str(), "message": _str(4096)},
}


def _best_req_id(obj: Any) -> int | None:
    if isinstance(obj, dict):
        r = obj.get("req_id")
        if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
            return r
    return None


def validate(obj: Any, schemas: Mapping[str, Mapping[str, Validator]]) -> dict:
    """Check a decoded message against ``schemas``; return it or raise ProtocolError."""
    req_id = _best_req_id(obj)
    if not isinstance(obj, dict):
        raise ProtocolError("message", f"expected a JSON object, got {type(obj).__name__}")
    if "type" not in obj:
        raise ProtocolError("type", "missing field", req_id)
    kind = obj["type"]
    if not isinstance(kind, str) or kind not in schemas:
        raise ProtocolError("type", f"unknown message type {kind!r:.40}; expected one of {sorted(schemas)}", req_id)
    schema = schemas[kind]
    for name in schema:
        if name not in obj:
            raise ProtocolError(name, f"missing field in {kind}", req_id)
    for name in obj:
        if name != "type" and name not in schema:
            raise ProtocolError(str(name)[:64], f"unexpected field in {kind}", req_id)
    for name, check in schema.items():
        try:
            check(name, obj[name])
        except ProtocolError as exc:
            exc.req_id = req_id
            raise
    return obj


def decode(data: bytes, schemas: Mapping[str, Mapping[str, Validator]]) -> dict:
    """Parse one control packet (bytes) and validate it."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message", f"{len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an int of > 4300 digits, deep nesting
        raise ProtocolError("message", f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    return validate(obj, schemas)


def decode_client(data: bytes) -> dict:
    return decode(data, CLIENT_SCHEMAS)


def decode_server(data: bytes) -> dict:
    return decode(data, SERVER_SCHEMAS)


def encode(msg: Mapping[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message", f"{len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return body
