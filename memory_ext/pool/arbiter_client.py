"""Client side of the per-device arbiter (see ``arbiter`` and ``arbiter_protocol``).

    client = ArbiterClient("/run/memx/gpu0.sock", "server-a", backend, on_reclaim=give_some)
    chunks = client.borrow(8)          # PhysicalChunks imported into ``backend``
    backend.map(vrange, 0, chunks[0])
    ...
    backend.unmap(vrange, 0)
    client.give_back(chunks)
    client.close()

A reader thread receives every message; requests are matched to replies by
``req_id``. ``RECLAIM(n)`` messages are handed to a second thread that calls
``on_reclaim(n) -> list[PhysicalChunk]``: the callback (the engine's policy)
must unmap the chunks it picks (it may return fewer than ``n``, or none); the
client then gives them back with an ordinary RETURN. The callback may call
``borrow``/``give_back``/``status`` itself.

One lock protects the client's state (request ids, waiters, held chunks).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence

from ..vmm.base import PhysicalChunk, VmmBackend
from ..vmm.ipc import MAX_FDS, connect_unix, recv_chunks
from . import arbiter_protocol as proto
from .arbiter_status import ArbiterDenied, ArbiterError, query_arbiter_status

__all__ = ["ArbiterClient", "ArbiterDenied", "ArbiterError", "query_arbiter_status"]  # the last three re-exported

log = logging.getLogger(__name__)


DELIVERY_GRACE_S = 5.0  # the reader sets a waiter's event right after taking it from the table


class _Waiter:
    __slots__ = ("event", "reply", "chunks")

    def __init__(self):
        self.event = threading.Event()
        self.reply: dict | None = None
        self.chunks: list[PhysicalChunk] = []


class ArbiterClient:
    """A connection to an ``Arbiter``. See the module docstring."""

    def __init__(
        self,
        socket_path,
        name: str,
        backend: VmmBackend,
        on_reclaim: Callable[[int], Sequence[PhysicalChunk]] | None = None,
        *,
        timeout: float = 30.0,
        on_late_reply: Callable[[dict, list[PhysicalChunk]], bool] | None = None,
        on_lost: Callable[[], None] | None = None,
    ):
        if not isinstance(backend, VmmBackend):
            raise TypeError(f"backend must be a VmmBackend, got {type(backend).__name__}")
        self.backend = backend
        self.on_reclaim = on_reclaim
        self.on_late_reply = on_late_reply  # (reply, chunks) -> True if it kept the chunks
        self.on_lost = on_lost  # () -> None, from the reader thread when the connection ends unasked
        self.timeout = timeout
        self._lock = threading.Lock()
        self._next_req = 1
        self._waiters: dict[int, _Waiter] = {}
        self._held: dict[int, PhysicalChunk] = {}  # arbiter chunk id -> local import
        self._returning: dict[int, list[PhysicalChunk]] = {}  # req_id -> chunks of a RETURN not waited for
        self._closed = False
        self._dead: str | None = None
        self._refused: dict | None = None  # an ERROR answering no request (e.g. peer_uid), then EOF
        self.reclaim_requests: list[int] = []
        self._reclaims: queue.Queue[int | None] = queue.Queue()
        self._sock = connect_unix(socket_path)
        self._reader = threading.Thread(target=self._read_loop, name=f"memx-arbiter-client-{name}", daemon=True)
        self._worker = threading.Thread(target=self._reclaim_loop, name=f"memx-arbiter-reclaim-{name}", daemon=True)
        self._reader.start()
        self._worker.start()
        try:
            welcome = self._request(
                {"type": "HELLO", "version": proto.PROTOCOL_VERSION, "name": name, "pid": os.getpid()}
            ).reply
            if welcome["type"] != "WELCOME":
                raise ArbiterError(f"expected WELCOME, got {welcome['type']}")
            if welcome["granularity"] != backend.granularity:
                raise ArbiterError(
                    f"arbiter granularity {welcome['granularity']} differs from the backend's {backend.granularity}",
                    "granularity",
                )
        except BaseException:
            self._shutdown()
            raise
        self.client_id: int = welcome["client_id"]
        self.granularity: int = welcome["granularity"]
        self.budget: int = welcome["budget"]
        self.floor: int = welcome["floor"]

    # ------------------------------------------------------------------- API
    def borrow(self, n: int, owner: str = "kv", timeout: float | None = None) -> list[PhysicalChunk]:
        """Borrow ``n`` chunks (all or nothing); raises ArbiterDenied if refused.

        ``timeout`` (default: the client's) bounds the wait for each reply; on expiry
        ArbiterError is raised and the reply, when it comes, goes to ``on_late_reply``
        (or, if that does not keep them, the granted chunks go straight back).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"n must be a positive int, got {n!r}")
        got: list[PhysicalChunk] = []
        try:
            while len(got) < n:
                k = min(n - len(got), proto.MAX_CHUNKS_PER_MESSAGE)
                w = self._request(
                    {"type": "BORROW", "n": k, "owner": owner}, timeout=self.timeout if timeout is None else timeout
                )
                if w.reply["type"] == "DENY":
                    raise ArbiterDenied(w.reply["reason"], w.reply["available"])
                if w.reply["type"] != "GRANT":
                    raise ArbiterError(f"expected GRANT or DENY, got {w.reply['type']}")
                got.extend(w.chunks)
        except BaseException:
            if got:
                try:
                    self.give_back(got)
                except Exception:
                    log.exception("arbiter client: giving back a partial borrow failed")
            raise
        return got

    def give_back(self, chunks: Sequence[PhysicalChunk], *, wait: bool = True) -> int:
        """Return borrowed chunks (they must be mapped nowhere); returns how many.

        ``wait=False`` does not wait for the arbiter's ACK (a scheduler giving back spare chunks
        between steps: the round trip costs it the arbiter's scheduling latency, on a loaded host
        milliseconds): the chunks leave this client's books at once and are destroyed when the
        ACK comes (or the connection ends). The arbiter reads one connection in order, so a
        later BORROW or STATUS from this client sees them returned. A refusal (an ERROR naming a
        field) puts them back on the books and is logged, as ``wait=True`` would raise it."""
        chunks = list(chunks)
        if not chunks:
            return 0
        with self._lock:
            ids = []
            for c in chunks:
                sid = c.source_id
                if sid is None or self._held.get(sid) is not c:
                    raise ValueError(f"chunks: {c} was not borrowed through this client (or was given back)")
                if self.backend.mappings_of(c):
                    raise ValueError(f"chunks: {c} is still mapped; unmap it before giving it back")
                ids.append(sid)
            if len(set(ids)) != len(ids):
                raise ValueError("chunks: the same chunk is listed twice")
            for sid in ids:
                del self._held[sid]
        if not wait:
            for start in range(0, len(ids), proto.MAX_RETURN_IDS):
                stop = start + proto.MAX_RETURN_IDS
                self._send_return(ids[start:stop], chunks[start:stop])
            return len(chunks)
        try:
            for start in range(0, len(ids), proto.MAX_RETURN_IDS):
                self._request({"type": "RETURN", "chunks": ids[start : start + proto.MAX_RETURN_IDS]})
        except ArbiterError as exc:
            if exc.field is not None:  # the arbiter refused: we still hold them
                self._rehold(chunks)
                raise
        self._destroy(chunks)  # gone from the arbiter's view (ACKed, or the connection died)
        return len(chunks)

    def _send_return(self, ids: list[int], chunks: list[PhysicalChunk]) -> None:
        """Send one RETURN without waiting; ``_deliver`` settles it when the ACK comes. Not sent
        (the connection is gone): the arbiter's books went with it, the chunks are destroyed."""
        with self._lock:
            sent = self._dead is None and not self._closed
            if sent:
                req_id = self._next_req
                self._next_req += 1
                self._returning[req_id] = chunks
                try:
                    self._sock.send(proto.encode({"type": "RETURN", "chunks": ids, "req_id": req_id}))
                except OSError as exc:
                    del self._returning[req_id]
                    sent = False
                    log.debug("arbiter client: RETURN not sent: %s", exc)
        if not sent:
            self._destroy(chunks)

    def _settle_return(self, msg: dict, chunks: list[PhysicalChunk]) -> None:
        """The arbiter's answer to a RETURN not waited for: ACK destroys the chunks; an ERROR
        naming a field puts them back on the books (the arbiter still counts them ours)."""
        if msg["type"] == "ERROR" and msg.get("field") is not None:
            log.error("arbiter client: RETURN refused: %s: %s", msg["field"], msg.get("message"))
            self._rehold(chunks)
            return
        self._destroy(chunks)

    def _rehold(self, chunks: list[PhysicalChunk]) -> None:
        """Put returned chunks back on the books (the arbiter refused their RETURN)."""
        with self._lock:
            for c in chunks:
                self._held[c.source_id] = c

    def _destroy(self, chunks: list[PhysicalChunk]) -> None:
        """Close the local imports of chunks the arbiter no longer counts ours (mapped nowhere)."""
        for c in chunks:
            self.backend.destroy_chunk(c)

    @property
    def returns_in_flight(self) -> int:
        """Chunks given back without waiting whose ACK has not come yet."""
        with self._lock:
            return sum(len(c) for c in self._returning.values())

    def report(self, idle: int, headroom: int, busy: bool) -> None:
        """Tell the arbiter's policy what this client could give back (no reply; a malformed
        report comes back as an ERROR, logged as a late reply)."""
        with self._lock:
            if self._dead is not None or self._closed:
                field = self._refused["field"] if self._refused else None
                raise ArbiterError(f"not connected to the arbiter ({self._dead or 'closed'})", field)
            req_id = self._next_req
            self._next_req += 1
            msg = {"type": "REPORT", "req_id": req_id, "idle": idle, "headroom": headroom, "busy": busy}
            try:
                self._sock.send(proto.encode(msg))
            except OSError as exc:
                raise ArbiterError(f"sending REPORT failed: {exc}") from None

    def link(self, *, active: bool, num_layers: int, layer_bytes: int, link_bytes_per_s: float,
             min_interval: int | None, iter_times: Sequence[float], timeout: float | None = None) -> dict:  # fmt: skip
        """Send this process's demand on the shared host link (``arbiter_protocol``: LINK);
        returns the LINKED reply: ``interval`` (None: stream nothing more), ``sharing``,
        ``reason``. Raises ``ArbiterError`` on a refusal or no reply."""
        msg = {"type": "LINK", "active": active, "num_layers": num_layers, "layer_bytes": layer_bytes,
               "link_bytes_per_s": float(link_bytes_per_s), "min_interval": min_interval,
               "iter_times": [float(t) for t in iter_times]}  # fmt: skip
        reply = self._request(msg, timeout).reply
        return {k: reply[k] for k in ("interval", "sharing", "reason")}

    def adopt(self, n: int) -> int:
        """Ask the arbiter to book ``n`` chunks this process holds without it having lent them
        (kept from an arbiter that died); returns how many it booked (``arbiter_protocol``)."""
        return int(self._request({"type": "ADOPT", "n": int(n)}).reply["adopted"])

    def release(self, n: int) -> None:
        """Tell the arbiter ``n`` adopted chunks were destroyed here (they leave its books)."""
        self._request({"type": "RELEASE", "n": int(n)})

    def detach_held(self) -> list[PhysicalChunk]:
        """Take every held chunk out of this client (the caller owns them now: ``close`` and
        ``give_back`` no longer see them). For a client whose arbiter is gone."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
            return held

    @property
    def lost_reason(self) -> str | None:
        """Why the connection ended, if it ended without ``close`` (else None)."""
        return None if self._closed else self._dead

    def status(self) -> dict:
        reply = self._request({"type": "STATUS"}).reply
        return {k: v for k, v in reply.items() if k not in ("type", "req_id")}

    def held(self) -> list[PhysicalChunk]:
        with self._lock:
            return list(self._held.values())

    @property
    def connected(self) -> bool:
        return self._dead is None and not self._closed

    def close(self, *, force: bool = False) -> None:
        """Disconnect (the arbiter frees everything this client held). Unmapped borrowed
        chunks are destroyed locally; mapped ones make this raise unless ``force``."""
        if self._closed:
            return
        # The held chunks become close's in one step, so a concurrent give_back (a late grant's
        # return) either took them before or finds them gone; never both destroy one chunk.
        with self._lock:
            mapped = [c for c in self._held.values() if self.backend.mappings_of(c)]
            if mapped and not force:
                raise ValueError(
                    f"chunks {', '.join(map(str, mapped))} are still mapped; unmap them "
                    f"(the arbiter will lend them to others) or close(force=True)"
                )
            held = list(self._held.values())
            self._held.clear()
        self._shutdown()
        with self._lock:  # a grant delivered before the reader stopped
            held += self._held.values()
            self._held.clear()
        for c in held:
            if not self.backend.mappings_of(c):
                self.backend.destroy_chunk(c)

    def __enter__(self) -> ArbiterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- plumbing
    def _shutdown(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(10)
        self._reclaims.put(None)
        if threading.current_thread() is not self._worker:
            self._worker.join(10)
        self._sock.close()

    def _request(self, msg: dict, timeout: float | None = None) -> _Waiter:
        w = _Waiter()
        with self._lock:
            if self._dead is not None or self._closed:
                field = self._refused["field"] if self._refused else None
                raise ArbiterError(f"not connected to the arbiter ({self._dead or 'closed'})", field)
            req_id = self._next_req
            self._next_req += 1
            self._waiters[req_id] = w
            try:
                self._sock.send(proto.encode(dict(msg, req_id=req_id)))
                failed = None
            except OSError as exc:
                del self._waiters[req_id]
                failed = exc
        if failed is not None:
            # the arbiter may have refused this connection (ERROR, then close) before the send:
            # the reader still gets that ERROR, so the refusal's field is the error's
            if threading.current_thread() is not self._reader:
                self._reader.join(2.0)
            if self._refused:
                why = f"{self._refused['field']}: {self._refused['message']}"
                raise ArbiterError(f"sending {msg['type']} failed ({failed}): the arbiter refused: {why}",
                                   self._refused["field"])  # fmt: skip
            raise ArbiterError(f"sending {msg['type']} failed: {failed}")
        if not w.event.wait(self.timeout if timeout is None else timeout):
            with self._lock:
                gave_up = self._waiters.pop(req_id, None) is not None
            if gave_up:  # the reply, when it comes, goes to on_late_reply
                raise ArbiterError(f"no reply to {msg['type']} within {timeout or self.timeout:g} s")
            # the reader took the waiter between our wait and our lock (the reply, or the connection's
            # end, landed at the deadline): it is ours, never a late reply nobody would count or adopt
            w.event.wait(DELIVERY_GRACE_S)
        if w.reply is None:
            field = self._refused["field"] if self._refused else None
            raise ArbiterError(f"connection lost while waiting for {msg['type']} ({self._dead})", field)
        if w.reply["type"] == "ERROR":
            raise ArbiterError(
                f"arbiter rejected {msg['type']}: {w.reply['field']}: {w.reply['message']}", w.reply["field"]
            )
        return w

    def _read_message(self, head: bytes) -> None:
        """Read and deliver the message at the head of the queue (``head``: its first byte)."""
        if head == b"{":
            data, fds, _, _ = socket.recv_fds(self._sock, proto.MAX_MESSAGE_BYTES + 1, MAX_FDS)
            for fd in fds:
                os.close(fd)
            try:
                msg = proto.decode_server(data)
            except proto.ProtocolError as exc:
                log.error("arbiter client: malformed message from the arbiter: %s", exc)
                return
            if msg["type"] == "RECLAIM":
                self.reclaim_requests.append(msg["n"])
                self._reclaims.put(msg["n"])
                return
            self._deliver(msg, [])
        else:
            try:
                chunks, meta = recv_chunks(self._sock, self.backend, with_meta=True)
            except ValueError as exc:  # fds already closed by recv_chunks
                log.error("arbiter client: bad chunk message from the arbiter: %s", exc)
                return
            try:
                msg = proto.validate(meta, {"GRANT": proto.SERVER_SCHEMAS["GRANT"]})
                if msg["chunks"] != [c.source_id for c in chunks]:
                    raise proto.ProtocolError("chunks", "ids differ from the fds' header")
            except proto.ProtocolError as exc:
                log.error("arbiter client: bad GRANT: %s", exc)
                self._destroy(chunks)
                return
            self._deliver(msg, chunks)

    def _read_loop(self) -> None:
        why, reset = "closed", False
        try:
            while True:
                try:
                    head = self._sock.recv(1, socket.MSG_PEEK)  # no ancillary buffer: no fds installed
                    if head:
                        self._read_message(head)
                except ConnectionResetError as exc:
                    why = f"recv failed: {exc}"
                    if reset:
                        return
                    # the arbiter closed with a message of ours unread (it refused us): Linux reports
                    # the reset before the packets still queued for us, the refusal among them
                    reset = True
                    continue
                except ConnectionError:
                    raise
                except OSError as exc:
                    why = f"recv failed: {exc}"
                    return
                if not head:
                    why = why if reset else "arbiter closed the connection"
                    return
        except ConnectionError as exc:
            why = str(exc)
        finally:
            with self._lock:
                if self._refused is not None:
                    why = f"{why} after ERROR {self._refused['field']}: {self._refused['message']}"
                self._dead = why
                waiters, self._waiters = self._waiters, {}
                returning, self._returning = self._returning, {}
            for w in waiters.values():
                w.event.set()  # reply None: connection lost
            for chunks in returning.values():  # the arbiter's books went with the connection
                self._destroy(chunks)
            if self.on_lost is not None and not self._closed:
                try:
                    self.on_lost()
                except Exception:
                    log.exception("arbiter client: on_lost failed")

    def _deliver(self, msg: dict, chunks: list[PhysicalChunk]) -> None:
        with self._lock:
            returned = self._returning.pop(msg["req_id"], None)
        if returned is not None:
            self._settle_return(msg, returned)
            return
        with self._lock:
            w = self._waiters.pop(msg["req_id"], None)
            for c in chunks:
                self._held[c.source_id] = c
        if w is None:
            if msg["type"] == "ERROR":
                log.error("arbiter client: the arbiter rejected a message: %s: %s", msg["field"], msg["message"])
                if msg["req_id"] is None:
                    self._refused = msg
                return
            kept = False
            if self.on_late_reply is not None:
                try:
                    kept = bool(self.on_late_reply(msg, chunks))
                except Exception:
                    log.exception("arbiter client: on_late_reply failed")
            if chunks and not kept:  # the borrower gave up waiting: hand the grant straight back
                log.warning("arbiter client: late GRANT for request %d; returning it", msg["req_id"])
                threading.Thread(target=self._give_back_quietly, args=(chunks,), daemon=True).start()
            return
        w.reply, w.chunks = msg, chunks
        w.event.set()

    def _give_back_quietly(self, chunks) -> None:
        try:
            self.give_back(chunks)
        except Exception:
            log.exception("arbiter client: returning chunks failed")

    def _reclaim_loop(self) -> None:
        while True:
            n = self._reclaims.get()
            if n is None:
                return
            if self.on_reclaim is None or self._closed:
                continue
            try:
                picked = list(self.on_reclaim(n) or [])
                if picked:
                    self.give_back(picked)
            except Exception:
                log.exception("arbiter client: on_reclaim(%d) failed", n)
