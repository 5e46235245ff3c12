"""The router's address while the engines start: claimed at once, answered with 503.

``sglang-memx serve`` binds the router's address before it starts any engine, so nothing
else (an engine's ports, a client's ephemeral port, another server) can take it during the
minute the engines load, and a taken port fails the command at once. Until the router
serves, this responder answers every connection: ``/health`` with ``{"status": "starting"}``,
any other path with the router's OpenAI-style error (``code: "starting"``), both 503 with
``Retry-After``, so a readiness probe or a client sees why instead of a refused connection.

Invariants: the socket listens from ``start`` on (a listening socket cannot be bound by
anyone else, ``SO_REUSEADDR`` or not); after ``stop`` returns no connection is touched by
the responder, and the socket is left open for the router; the socket is not inherited by
child processes (PEP 446).
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

from .router_errors import error_body

__all__ = ["claim_address", "StartingResponder"]

RETRY_AFTER_S = 5
CONN_BUDGET_S = 2.0  # at most this long on one connection
_HEAD_LIMIT = 65536  # read at most this much of a request (its head) before answering


def claim_address(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), port 0 meaning a free one. Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart despite TIME_WAIT
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _response(path: str) -> bytes:
    if path == "/health":
        body = {"status": "starting"}
    else:
        body = error_body(503, "sglang-memx serve is starting its engines; retry shortly", code="starting")
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Retry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + data


def _request_path(head: bytes) -> str:
    parts = head.split(b"\r\n", 1)[0].split()
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) >= 2 else ""


class StartingResponder:
    """Answers the claimed socket with 503 from ``start`` until ``stop`` (one thread)."""

    def __init__(self, sock: socket.socket, poll_s: float = 0.2):
        self.sock = sock
        self.poll_s = poll_s
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memx-serve-starting", daemon=True)

    def start(self) -> StartingResponder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:  # not select(): it refuses a descriptor above 1023
            sel.register(self.sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                if sel.select(self.poll_s) and not self._stop.is_set():
                    self._accept_one()

    def _accept_one(self) -> None:
        """Accept one waiting connection (none: another took it first) and answer it."""
        self.sock.setblocking(False)
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        finally:
            self.sock.setblocking(True)
        with conn:
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        """Read the request's head, answer, drain what else the client sends; ``CONN_BUDGET_S`` in all
        (a client that trickles or uploads cannot hold the responder, nor ``stop``, longer)."""
        deadline = time.monotonic() + CONN_BUDGET_S

        def recv() -> bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            return conn.recv(4096)

        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < _HEAD_LIMIT:
                chunk = recv()
                if not chunk:
                    break
                head += chunk
            conn.sendall(_response(_request_path(head)))
            self.answered += 1
            conn.shutdown(socket.SHUT_WR)
            while recv():  # drain the rest (a POST's body) so the close does not reset the answer
                pass
        except OSError:
            pass  # the client went away or ran out of its budget: nothing more owed to it
