"""The arbiter's server: the socket event loop and the message handlers, over the chunk ledger
(``ledger``). The package docstring says what the ledger guarantees, how borrows are served and
what happens when a client or the arbiter dies."""

from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable

from ...vmm.base import PhysicalChunk, VmmBackend
from ...vmm.ipc import MAX_FDS, close_fds, listen_unix, send_chunks
from .. import arbiter_protocol as proto
from .ledger import ChunkLedger
from .link import join_link
from .reclaim import plan_reclaim, replan_short_answer
from .records import ClientRecord, PendingBorrow

log = logging.getLogger("memory_ext.pool.arbiter")


class Arbiter:
    """Lends a device's chunks to client processes. See the package docstring."""

    def __init__(
        self,
        socket_path,
        backend: VmmBackend,
        budget_chunks: int,
        *,
        floor_per_client: int = 0,
        reclaim_timeout: float = 2.0,
        send_timeout: float = 5.0,
        allowed_uids: Iterable[int] | None = None,
        max_clients: int = 64,
    ):
        if not isinstance(backend, VmmBackend):
            raise TypeError(f"backend must be a VmmBackend, got {type(backend).__name__}")
        if isinstance(max_clients, bool) or not isinstance(max_clients, int) or max_clients < 1:
            raise ValueError(f"max_clients must be a positive int, got {max_clients!r}")
        for name, v in (("budget_chunks", budget_chunks), ("floor_per_client", floor_per_client)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if reclaim_timeout <= 0 or send_timeout <= 0:
            raise ValueError("reclaim_timeout and send_timeout must be positive")
        self.socket_path = os.fspath(socket_path)
        self.backend = backend
        self.budget = budget_chunks
        self.floor = floor_per_client
        self.reclaim_timeout = float(reclaim_timeout)
        self.send_timeout = float(send_timeout)
        self.max_clients = max_clients
        self.allowed_uids = frozenset([os.geteuid()] if allowed_uids is None else allowed_uids)
        if not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in self.allowed_uids):
            raise ValueError(f"allowed_uids must be non-negative ints, got {sorted(self.allowed_uids, key=str)!r}")
        self._lock = threading.RLock()
        self._ledger = ChunkLedger(backend, budget_chunks)
        self._pending: list[PendingBorrow] = []
        self._next_cid = 1
        self._listen: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._started = False
        self.stats = dict.fromkeys(
            ("granted", "denied", "returned", "reclaim_sent", "errors", "clients_dropped", "chunks_freed_on_drop",
             "link_decisions", "refused", "adopted", "released", "adopted_freed_on_drop", "asks_withdrawn"), 0
        )  # fmt: skip
        self.reclaim_by_tier: dict[str, int] = {}  # chunks asked for, by policy tier

    # ------------------------------------------------------------ lifecycle
    def _open(self) -> None:
        if self._started:
            raise RuntimeError("arbiter already started")
        self._listen = listen_unix(self.socket_path)
        self._listen.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._started = True

    def start(self) -> Arbiter:
        """Listen and serve in a daemon thread."""
        self._open()
        self._thread = threading.Thread(target=self._run, name="memx-arbiter", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Listen and serve in the calling thread until ``stop()`` (from a signal handler or thread)."""
        self._open()
        try:
            self._run()
        finally:
            self._cleanup()

    def request_stop(self) -> None:
        """Ask the event loop to end (safe from a signal handler); ``serve_forever`` then cleans up."""
        self._stopping = True
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass

    def stop(self) -> None:
        """Stop serving, disconnect clients, destroy the chunks, remove the socket file. Idempotent."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
            self._cleanup()

    def _cleanup(self) -> None:
        with self._lock:
            if not self._started:
                return
            for c in list(self._ledger.clients.values()):
                self._drop(c, "arbiter stopping", serve=False)
            for s in (self._listen, self._wake_r, self._wake_w):
                try:
                    s.close()
                except OSError:
                    pass
            self._sel.close()
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
            for chunk in self._ledger.chunks.values():
                self.backend.destroy_chunk(chunk)
            self._ledger.chunks.clear()
            self._ledger.free.clear()
            self._ledger.holder.clear()
            self._started = False

    def __enter__(self) -> Arbiter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------- inspection
    def status(self) -> dict:
        """A snapshot: budget, created, free, pending and per-client holdings."""
        with self._lock:
            return self._status_locked()

    def _status_locked(self) -> dict:
        clients = [c.status_row() for c in sorted(self._ledger.clients.values(), key=lambda c: c.cid)]
        return {
            "budget": self.budget,
            "created": self._ledger.created(),
            "free": len(self._ledger.free),
            "adopted": self._ledger.adopted_total(),
            "floor": self.floor,
            "pending": len(self._pending),
            "reclaim_by_tier": dict(self.reclaim_by_tier),
            "clients": clients,
        }

    def check_invariants(self) -> None:
        """Raise ``ArbiterInvariantError`` if the ledger breaks an invariant (package docstring)."""
        with self._lock:
            self._ledger.check()

    # ----------------------------------------------------------- event loop
    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                timeout = None
                if self._pending:
                    timeout = max(0.0, min(p.deadline for p in self._pending) - time.monotonic())
            try:
                events = self._sel.select(timeout)
            except OSError:  # selector closed under us during stop
                break
            if self._stopping:
                break
            with self._lock:
                for key, _ in events:
                    try:
                        if key.data == "listen":
                            self._accept()
                        elif key.data == "wake":
                            self._wake_r.recv(4096)
                        elif key.data.cid in self._ledger.clients:
                            self._on_readable(key.data)
                    except Exception:  # never let one client take the arbiter down
                        log.exception("arbiter: unexpected error while handling an event")
                        self.stats["errors"] += 1
                        if isinstance(key.data, ClientRecord) and key.data.cid in self._ledger.clients:
                            self._drop(key.data, "internal error")
                self._expire_pending()

    def _accept(self) -> None:
        try:
            sock, _ = self._listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            pid, uid = 0, -1
        sock.settimeout(self.send_timeout)
        refusal = None
        if uid not in self.allowed_uids:
            refusal = ("peer_uid", f"uid {uid} may not use this pool (allowed: {sorted(self.allowed_uids)})")
        elif len(self._ledger.clients) >= self.max_clients:
            refusal = ("clients", f"the arbiter serves at most {self.max_clients} connections at once")
        if refusal is not None:
            self.stats["refused"] += 1
            log.warning("arbiter: refused a connection from uid %d (pid %d): %s", uid, pid, refusal[1])
            try:
                sock.send(proto.encode({"type": "ERROR", "req_id": None, "field": refusal[0], "message": refusal[1]}))
            except OSError:
                pass
            sock.close()
            return
        client = ClientRecord(self._next_cid, sock, pid)
        self._next_cid += 1
        self._ledger.clients[client.cid] = client
        self._sel.register(sock, selectors.EVENT_READ, client)

    def _on_readable(self, client: ClientRecord) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(client.sock, proto.MAX_MESSAGE_BYTES + 1, MAX_FDS)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # ECONNRESET and friends
            self._drop(client, f"recv failed: {exc}")
            return
        close_fds(fds)  # clients never send fds; close whatever arrived so nothing leaks
        if not data and not fds and not flags:
            if self._at_eof(client.sock):
                self._drop(client, "EOF")
            else:
                self._error(client, None, "message", "empty packet")
            return
        if fds or flags & socket.MSG_CTRUNC:
            self._error(client, None, "fds", "the arbiter accepts no file descriptors")
            return
        if flags & socket.MSG_TRUNC or len(data) > proto.MAX_MESSAGE_BYTES:
            self._error(client, None, "message", f"longer than {proto.MAX_MESSAGE_BYTES} bytes")
            return
        try:
            msg = proto.decode_client(data)
        except proto.ProtocolError as exc:
            self._error(client, exc.req_id, exc.field, exc.detail)
            return
        if msg["type"] == "HELLO":
            self._on_hello(client, msg)
        elif client.name is None:
            self._error(client, msg["req_id"], "type", f"expected HELLO first, got {msg['type']}")
        else:
            handlers = {"BORROW": self._on_borrow, "RETURN": self._on_return, "STATUS": self._on_status,
                        "REPORT": self._on_report, "LINK": self._on_link, "ADOPT": self._on_adopt,
                        "RELEASE": self._on_release}  # fmt: skip
            handlers[msg["type"]](client, msg)

    def _on_hello(self, client: ClientRecord, msg: dict) -> None:
        if client.name is not None:
            self._error(client, msg["req_id"], "type", "HELLO already received on this connection")
            return
        client.name, client.pid = msg["name"], msg["pid"]
        self._send(
            client,
            {
                "type": "WELCOME",
                "req_id": msg["req_id"],
                "client_id": client.cid,
                "granularity": self.backend.granularity,
                "budget": self.budget,
                "floor": self.floor,
            },
        )

    def _on_status(self, client: ClientRecord, msg: dict) -> None:
        self._send(client, dict(self._status_locked(), type="STATUS", req_id=msg["req_id"]))

    @staticmethod
    def _at_eof(sock: socket.socket) -> bool:
        """After a 0-byte read: EOF (the peer closed or shut down writing: the kernel flags
        RDHUP on our end) or an empty SEQPACKET record from a live peer?"""
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))

    # ------------------------------------------------------------- handlers
    def _on_borrow(self, client: ClientRecord, msg: dict) -> None:
        n, req_id = msg["n"], msg["req_id"]
        if not self._pending and n <= self._ledger.available_now():
            self._grant(client, req_id, n, msg["owner"])
            return
        waiting = sum(p.n for p in self._pending)
        clients = self._ledger.clients.values()
        shortfall = waiting + n - self._ledger.available_now() - sum(c.asked for c in clients)
        gathered, takes = plan_reclaim(clients, client, max(shortfall, 0), self.budget, self.floor)
        if gathered < shortfall:
            possible = max(0, n - (shortfall - gathered))
            self._deny(client, req_id, f"{n} chunk(s) requested, at most {possible} could be reclaimed", possible)
            return
        self._pending.append(PendingBorrow(client, req_id, n, msg["owner"], time.monotonic() + self.reclaim_timeout))
        self._send_reclaims(takes)
        self._serve_pending()

    def _send_reclaims(self, takes: list[tuple[ClientRecord, int, str]]) -> None:
        asks: dict[int, int] = {}
        for victim, k, tier in takes:
            victim.asked += k
            asks[victim.cid] = asks.get(victim.cid, 0) + k
            self.reclaim_by_tier[tier] = self.reclaim_by_tier.get(tier, 0) + k
        for cid, k in asks.items():
            self.stats["reclaim_sent"] += 1
            self._send(self._ledger.clients[cid], {"type": "RECLAIM", "n": k})

    def _on_report(self, client: ClientRecord, msg: dict) -> None:
        client.idle, client.headroom, client.busy = msg["idle"], msg["headroom"], msg["busy"]
        takes = replan_short_answer(self._ledger, client, self._pending, self.budget, self.floor)
        if takes is not None:
            self.stats["asks_withdrawn"] += 1
            self._send_reclaims(takes)

    def _on_link(self, client: ClientRecord, msg: dict) -> None:
        n, times = msg["num_layers"], msg["iter_times"]
        if len(times) != n + 1:
            self._error(client, msg["req_id"], "iter_times", f"expected {n + 1} entries (intervals 1..{n + 1})")
            return
        if msg["min_interval"] is not None and msg["min_interval"] > n + 1:
            self._error(client, msg["req_id"], "min_interval", f"expected <= {n + 1}")
            return
        if not msg["active"]:
            client.link, client.link_interval = None, None
            self._send(client, {"type": "LINKED", "req_id": msg["req_id"], "interval": None, "sharing": 0,
                                "reason": "withdrawn"})  # fmt: skip
            return
        reason, sharing = join_link(client, msg, self._ledger.clients.values())
        self.stats["link_decisions"] += 1
        self._send(client, {"type": "LINKED", "req_id": msg["req_id"], "interval": client.link_interval,
                            "sharing": sharing, "reason": reason[:4096]})  # fmt: skip

    def _on_adopt(self, client: ClientRecord, msg: dict) -> None:
        """Book up to ``n`` chunks the client kept from an earlier arbiter (module docstring):
        at most what no client holds; FREE chunks are destroyed to make room for them."""
        held_total = sum(c.holding for c in self._ledger.clients.values())
        k = min(msg["n"], self.budget - held_total)
        over = self._ledger.created() + k - self.budget
        for _ in range(max(0, over)):  # k <= free + uncreated, so the FREE list covers it
            cid = self._ledger.free.pop(0)  # coldest first
            self.backend.destroy_chunk(self._ledger.chunks.pop(cid))
        client.adopted += k
        self.stats["adopted"] += k
        if k:
            log.info("arbiter: client %d (%s) adopted %d of %d chunk(s) it kept", client.cid, client.name, k, msg["n"])
        self._send(client, {"type": "ADOPTED", "req_id": msg["req_id"], "adopted": k})

    def _on_release(self, client: ClientRecord, msg: dict) -> None:
        n = msg["n"]
        if n > client.adopted:
            self._error(client, msg["req_id"], "n", f"client {client.cid} has {client.adopted} adopted chunk(s)")
            return
        client.adopted -= n
        client.asked = max(0, client.asked - n)
        self.stats["released"] += n
        self._send(client, {"type": "ACK", "req_id": msg["req_id"], "returned": n})
        self._serve_pending()

    def _on_return(self, client: ClientRecord, msg: dict) -> None:
        ids = msg["chunks"]
        for i, cid in enumerate(ids):
            if client.held.get(cid) is None:
                self._error(client, msg["req_id"], f"chunks[{i}]", f"chunk {cid} is not held by client {client.cid}")
                return
        for cid in ids:
            del client.held[cid], self._ledger.holder[cid]
            self._ledger.free.append(cid)
        client.asked = max(0, client.asked - len(ids))
        self.stats["returned"] += len(ids)
        self._send(client, {"type": "ACK", "req_id": msg["req_id"], "returned": len(ids)})
        self._serve_pending()

    def _grant(self, client: ClientRecord, req_id: int, n: int, owner: str) -> None:
        taken = [self._ledger.free.pop() for _ in range(min(n, len(self._ledger.free)))]
        created: list[PhysicalChunk] = []
        try:
            while len(taken) + len(created) < n:
                created.append(self.backend.create_chunk())
        except Exception as exc:
            self._ledger.free.extend(reversed(taken))
            for c in created:
                self.backend.destroy_chunk(c)
            self._deny(client, req_id, f"creating a chunk failed: {exc}", self._ledger.available_now())
            return
        for c in created:
            self._ledger.chunks[c.handle_id] = c
        ids = taken + [c.handle_id for c in created]
        for cid in ids:
            client.held[cid] = owner
            self._ledger.holder[cid] = client.cid
        self.stats["granted"] += n
        meta = {"type": "GRANT", "req_id": req_id, "owner": owner, "chunks": ids}
        try:
            send_chunks(client.sock, [self._ledger.chunks[i] for i in ids], meta=meta)
        except OSError as exc:
            self._drop(client, f"sending a GRANT failed: {exc}")  # frees the chunks just recorded

    def _deny(self, client: ClientRecord, req_id: int, reason: str, available: int) -> None:
        self.stats["denied"] += 1
        self._send(client, {"type": "DENY", "req_id": req_id, "reason": reason, "available": available})

    def _error(self, client: ClientRecord, req_id: int | None, field_: str, message: str) -> None:
        self.stats["errors"] += 1
        self._send(client, {"type": "ERROR", "req_id": req_id, "field": field_, "message": message[:4096]})

    def _send(self, client: ClientRecord, msg: dict) -> bool:
        try:
            try:
                data = proto.encode(msg)
            except proto.ProtocolError as exc:  # a reply too big for one packet: say so, keep the client
                self.stats["errors"] += 1
                why = f"the {msg['type']} reply does not fit one packet: {exc.detail}"
                data = proto.encode({"type": "ERROR", "req_id": msg.get("req_id"), "field": exc.field, "message": why})
            client.sock.send(data)
            return True
        except OSError as exc:  # includes a send timeout: a client that never reads is dropped
            self._drop(client, f"send failed: {exc}")
            return False

    def _serve_pending(self) -> None:
        while self._pending and self._pending[0].n <= self._ledger.available_now():
            p = self._pending.pop(0)
            if p.client.cid in self._ledger.clients:
                self._grant(p.client, p.req_id, p.n, p.owner)
        if not self._pending:
            for c in self._ledger.clients.values():
                c.asked = 0

    def _expire_pending(self) -> None:
        now = time.monotonic()
        expired = [p for p in self._pending if p.deadline <= now]
        if not expired:
            return
        self._pending = [p for p in self._pending if p.deadline > now]
        for p in expired:
            if p.client.cid in self._ledger.clients:
                self._deny(
                    p.client,
                    p.req_id,
                    f"reclaim did not free enough chunks within {self.reclaim_timeout:g} s",
                    self._ledger.available_now(),
                )
        self._serve_pending()

    def _drop(self, client: ClientRecord, why: str, *, serve: bool = True) -> None:
        if self._ledger.clients.pop(client.cid, None) is None:
            return
        log.info(
            "arbiter: client %d (%s, pid %s) gone: %s; %d chunk(s) back to FREE, %d adopted off the books",
            client.cid,
            client.name,
            client.pid,
            why,
            len(client.held),
            client.adopted,
        )
        try:
            self._sel.unregister(client.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            client.sock.close()
        except OSError:
            pass
        for cid in client.held:
            del self._ledger.holder[cid]
            self._ledger.free.append(cid)
        self.stats["clients_dropped"] += 1
        self.stats["chunks_freed_on_drop"] += len(client.held)
        client.held.clear()
        self.stats["adopted_freed_on_drop"] += client.adopted
        client.adopted = 0
        self._pending = [p for p in self._pending if p.client is not client]
        if serve:
            self._serve_pending()
