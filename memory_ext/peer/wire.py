"""Donor <-> borrower messages: one JSON object per SOCK_SEQPACKET packet, fds by SCM_RIGHTS.

| direction | type | fields | fds |
|---|---|---|---|
| B->D | HELLO | version, name, pid, layout; optional pin_bytes (a pinned lease, W2) | - |
| D->B | WELCOME | version, lease, device, chunk_bytes, block_bytes, unit_chunks, max_units | gen. table |
| D->B | REFUSE | field, message (then the donor closes) | - |
| D->B | GROW | first_unit, units, chunks (donor chunk ids, slot order) | one per chunk |
| D->B | REVOKE | units (the region's new logical size) | - |
| B->D | WRITE_BEGIN | req_id, blocks | - |
| D->B | WRITE_OK | req_id, gens (one per block) | - |
| D->B | WRITE_DENIED | req_id, message | - |
| B->D | WRITE_END | req_id, blocks | - |
| either | ERROR | field, message | - |

``recv`` validates strictly (known type, exactly the listed fields, ints are ints and >= 0, the
number of fds) and raises ``ValueError`` naming the field; it closes every fd it received on any
error, so nothing leaks. ``None`` means the other end closed the socket.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence

from ..vmm.ipc import close_fds

VERSION = 1
MAX_PACKET = 1 << 16
MAX_FDS = 253

_INT, _STR, _INTS, _OBJ = "int", "str", "ints", "obj"
SCHEMA: dict[str, dict[str, str]] = {
    "HELLO": {"version": _INT, "name": _STR, "pid": _INT, "layout": _OBJ},
    "WELCOME": {
        "version": _INT,
        "lease": _INT,
        "device": _STR,
        "chunk_bytes": _INT,
        "block_bytes": _INT,
        "unit_chunks": _INT,
        "max_units": _INT,
    },
    "REFUSE": {"field": _STR, "message": _STR},
    "GROW": {"first_unit": _INT, "units": _INT, "chunks": _INTS},
    "REVOKE": {"units": _INT},
    "WRITE_BEGIN": {"req_id": _INT, "blocks": _INTS},
    "WRITE_OK": {"req_id": _INT, "gens": _INTS},
    "WRITE_DENIED": {"req_id": _INT, "message": _STR},
    "WRITE_END": {"req_id": _INT, "blocks": _INTS},
    "ERROR": {"field": _STR, "message": _STR},
}


#: fields a message may carry besides its SCHEMA fields
OPTIONAL: dict[str, dict[str, str]] = {"HELLO": {"pin_bytes": _INT}}


def _expected_fds(msg: dict) -> int:
    if msg["type"] == "WELCOME":
        return 1
    if msg["type"] == "GROW":
        return len(msg["chunks"])
    return 0


def validate(msg) -> dict:
    if not isinstance(msg, dict):
        raise ValueError(f"message: expected a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMA:  # a list or dict would be unhashable
        raise ValueError(f"type: unknown message type {kind!r}")
    optional = OPTIONAL.get(kind, {})
    got = set(msg) - {"type"}
    spec = {**SCHEMA[kind], **{k: v for k, v in optional.items() if k in got}}
    if got != set(spec):
        missing, extra = sorted(set(spec) - got), sorted(got - set(spec))
        raise ValueError(f"{(missing or extra)[0]}: {kind} fields wrong (missing {missing}, unexpected {extra})")
    for name, kind_of in spec.items():
        v = msg[name]
        if kind_of == _INT:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r:.40}")
        elif kind_of == _STR:
            if not isinstance(v, str):
                raise ValueError(f"{name}: expected a string, got {v!r:.40}")
        elif kind_of == _INTS:
            if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
                raise ValueError(f"{name}: expected a list of ints >= 0, got {v!r:.80}")
        elif not isinstance(v, dict):
            raise ValueError(f"{name}: expected a JSON object, got {v!r:.40}")
    return msg


def send(sock: socket.socket, msg: dict, fds: Sequence[int] = ()) -> None:
    """Send one message (validated first); ``fds`` stay the caller's."""
    validate(msg)
    if _expected_fds(msg) != len(fds):
        raise ValueError(f"fds: {msg['type']} needs {_expected_fds(msg)} fd(s), got {len(fds)}")
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_PACKET:
        raise ValueError(f"message: {len(body)} bytes exceed {MAX_PACKET}")
    if fds:
        socket.send_fds(sock, [body], list(fds))
    else:
        sock.send(body)


def recv(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """One message and the fds that came with it (the caller owns them), or None at EOF."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_PACKET, MAX_FDS)
    try:
        if not data and not fds:
            return None
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ValueError("message: truncated")
        try:
            msg = json.loads(data.decode())
        except (ValueError, RecursionError) as exc:  # bad UTF-8 / JSON, an int > 4300 digits, deep nesting
            raise ValueError(f"message: not valid JSON ({str(exc):.200})") from None
        validate(msg)
        if len(fds) != _expected_fds(msg):
            raise ValueError(f"fds: {msg['type']} came with {len(fds)} fd(s), expected {_expected_fds(msg)}")
    except BaseException:
        close_fds(fds)
        raise
    return msg, list(fds)
