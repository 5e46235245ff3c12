"""What the arbiter's clients raise, and a monitor's STATUS round trip without a client
(``query_arbiter_status``: no backend, nothing borrowed). ``arbiter_client`` re-exports them."""

from __future__ import annotations

import os
import socket

from . import arbiter_protocol as proto

__all__ = ["ArbiterDenied", "ArbiterError", "query_arbiter_status"]


class ArbiterError(RuntimeError):
    """The arbiter answered with ERROR (``field`` names the culprit) or went away."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class ArbiterDenied(ArbiterError):
    """A BORROW was refused; ``available`` is what the arbiter could have given."""

    def __init__(self, reason: str, available: int):
        self.reason, self.available = reason, available
        super().__init__(f"borrow denied: {reason} (available {available})")


def query_arbiter_status(socket_path, timeout: float = 2.0, name: str = "status-probe") -> dict:
    """One STATUS round trip without borrowing anything (no backend needed): for monitors.

    Returns the STATUS fields plus ``granularity`` from the WELCOME. Raises
    ``ArbiterError`` if the arbiter does not answer or answers out of protocol.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(os.fspath(socket_path))
            sock.send(
                proto.encode(
                    {"type": "HELLO", "version": proto.PROTOCOL_VERSION, "name": name, "pid": os.getpid(), "req_id": 1}
                )
            )
            welcome = proto.decode_server(sock.recv(proto.MAX_MESSAGE_BYTES + 1))
            sock.send(proto.encode({"type": "STATUS", "req_id": 2}))
            reply = proto.decode_server(sock.recv(proto.MAX_MESSAGE_BYTES + 1))
        except (OSError, proto.ProtocolError) as exc:
            raise ArbiterError(f"arbiter at {socket_path} did not answer STATUS: {exc}") from None
        if welcome["type"] != "WELCOME" or reply["type"] != "STATUS":
            raise ArbiterError(f"arbiter at {socket_path} answered {welcome['type']}/{reply['type']}")
        out = {k: v for k, v in reply.items() if k not in ("type", "req_id")}
        out["granularity"] = welcome["granularity"]
        return out
    finally:
        sock.close()
