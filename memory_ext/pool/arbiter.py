"""Per-device chunk arbiter: several engine processes share one device's memory.

One ``Arbiter`` per device owns the physical chunks (created lazily, at most
``budget_chunks``) and lends them to client processes over a Unix socket
(SOCK_SEQPACKET, mode 0600). Chunks travel as fds (SCM_RIGHTS, ``vmm.ipc``);
the client imports them into its own backend and maps them where it likes.
Wire format: ``arbiter_protocol``. Client: ``arbiter_client.ArbiterClient``.

Ledger and invariants (``check_invariants``)
--------------------------------------------
Every created chunk is either FREE or held by exactly one connected client;
``sum(held) + free == created <= budget``. A chunk is only granted from FREE
(or freshly created), so it is never granted twice. ``created`` counts the
chunks clients ``ADOPT``ed too: memory a client kept privately after an earlier
arbiter died, booked as held by it without fds (never FREE). Adopted chunks
leave ``created`` when the client ``RELEASE``s them or disconnects, so
``sum(held incl. adopted) + free + uncreated == budget`` always.

BORROW and reclaim
------------------
``BORROW(n)`` is granted at once from FREE + uncreated chunks when no earlier
borrow is waiting. Otherwise *where the shortfall comes from* is the node
policy's decision, the same one the simulator's ledger makes:
``memory_ext.policy.arbiter.plan_takes`` over the other clients, each seen as
a KV account (``held`` chunks; ``idle``/``headroom``/``busy`` as its last
``REPORT`` said, minus what it was already asked for; ``nominal`` = the fair
share ``budget // clients``): idle memory of clients above their share goes
back first (RETURN), then idle clients' (IDLE_PEER), then busy clients'
surplus beyond their headroom (SURPLUS); memory in use is never asked for.
A client that never reported counts as busy with everything above
``floor_per_client`` idle. If the plan cannot cover ``n`` the borrow is DENIED
at once (``available`` says what it could gather); else it waits (FIFO) and
the arbiter sends ``RECLAIM(k)`` to each planned donor. Clients answer with
ordinary RETURNs. The head of the queue is granted as soon as enough chunks
are FREE (all-or-nothing); a waiting borrow that is not satisfied within
``reclaim_timeout`` seconds (default 2) is DENIED. The requester is never
asked to give chunks back for its own borrow.

The shared host link (Select-N §4.5)
------------------------------------
The pool's processes stream weights over one host link. ``LINK`` carries a client's
demand (``policy.select_n.GpuDemand``); the arbiter keeps the last active one per
client and answers with the interval ``policy.select_n.LinkCoordinator`` picks jointly
for every active demand, at the slowest link bandwidth any of them measured (the
simulator's coordinator is the same object). A client's demand goes with it when it
withdraws (``active`` false) or disconnects.

Client death
------------
When a client's socket reaches EOF or errors (including the process being
SIGKILLed: the kernel closes its end), every chunk it held returns to FREE
immediately and its waiting borrows are dropped. The arbiter does not scrub
the bytes of returned chunks (the next borrower may see old contents).

Arbiter death
-------------
If this process dies, its clients keep the chunks they hold (the memfds stay
mapped in their processes) and fall back to a private budget of exactly those
(``lent_pool``). A new arbiter on the same socket starts with the full budget;
each survivor reconnects and ``ADOPT``s what it kept, so the budget again counts
every chunk of the device (an adoption the budget cannot cover is partial, and
the survivor retries and destroys its unbooked chunks first when it gives memory
back).

Robustness
----------
A malformed message gets an ERROR naming the field and changes nothing (an
empty packet included: field ``message``; only EOF ends a connection);
fds sent to the arbiter are closed on arrival; one event-loop thread does all
the work under one lock, so ``status()``/``check_invariants()`` are safe from
other threads. A reply too big for one packet (a STATUS listing many clients with
long names) is an ERROR with field ``message``, not a dropped connection. At most
``max_clients`` connections (default 64) are served at once; one more gets ERROR
``clients`` and is closed, so a flood of connections cannot exhaust the arbiter's
fds. ``test/unit/test_arbiter_fuzz.py`` drives a live arbiter with random message
sequences and checks all of this after every step.

Who may connect
---------------
The socket file is 0600 and ``vmm.ipc.listen_unix`` refuses a directory that another
user owns or may write to. On top of that the arbiter reads each connection's peer
credentials (``SO_PEERCRED``) and refuses a uid outside ``allowed_uids`` (default: its
own effective uid): one ERROR with field ``peer_uid``, then the connection is closed,
before anything is read from it.

Run as a process::

    python -m memory_ext.pool.arbiter --socket /run/memx/gpu0.sock \\
        --budget-chunks 4096 --granularity-mib 2
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import selectors
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..policy.arbiter import DEFAULT_TIERS, AccountKey, Donor, Kind, plan_takes
from ..policy.select_n import GpuDemand, LinkCoordinator
from ..proc import wait_for_exit
from ..vmm.base import PhysicalChunk, VmmBackend
from ..vmm.ipc import MAX_FDS, listen_unix, send_chunks
from . import arbiter_protocol as proto

log = logging.getLogger(__name__)


class ArbiterInvariantError(AssertionError):
    pass


@dataclass
class _Client:
    cid: int
    sock: socket.socket
    peer_pid: int
    name: str | None = None
    pid: int | None = None
    held: dict[int, str] = field(default_factory=dict)  # arbiter chunk id -> owner label
    asked: int = 0  # outstanding RECLAIM chunks not yet returned
    idle: int | None = None  # last REPORT: chunks it could give back now (None: never reported)
    headroom: int = 0  # last REPORT: idle chunks its own queue wants to keep
    busy: bool = True  # last REPORT: whether it has work
    link: GpuDemand | None = None  # last active LINK demand
    link_bytes_per_s: float = 0.0  # the link bandwidth that client measured
    link_interval: int | None = None  # last interval the coordinator gave it
    adopted: int = 0  # chunks it kept from an earlier arbiter, booked here without fds (ADOPT)

    @property
    def holding(self) -> int:
        """Chunks this client holds: lent here plus adopted."""
        return len(self.held) + self.adopted


@dataclass
class _Pending:
    client: _Client
    req_id: int
    n: int
    owner: str
    deadline: float


def _owner(c: _Client) -> str:
    """A client as a policy owner: its name (ties between equal donors break by name, as in the
    simulator's ledger) made unique by its id."""
    return f"{c.name}#{c.cid}"


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Arbiter:
    """Lends a device's chunks to client processes. See the module docstring."""

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
        self._chunks: dict[int, PhysicalChunk] = {}  # every chunk created, by handle id
        self._free: list[int] = []  # LIFO: most recently returned first
        self._holder: dict[int, int] = {}  # chunk id -> client id
        self._clients: dict[int, _Client] = {}
        self._pending: list[_Pending] = []
        self._next_cid = 1
        self._listen: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r = self._wake_w = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._started = False
        self.stats = dict.fromkeys(
            ("granted", "denied", "returned", "reclaim_sent", "errors", "clients_dropped", "chunks_freed_on_drop",
             "link_decisions", "refused", "adopted", "released", "adopted_freed_on_drop"), 0
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

    def stop(self) -> None:
        """Stop serving, disconnect clients, destroy the chunks, remove the socket file. Idempotent."""
        self._stopping = True
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
            self._cleanup()

    def _cleanup(self) -> None:
        with self._lock:
            if not self._started:
                return
            for c in list(self._clients.values()):
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
            for chunk in self._chunks.values():
                self.backend.destroy_chunk(chunk)
            self._chunks.clear()
            self._free.clear()
            self._holder.clear()
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
        clients = []
        for c in sorted(self._clients.values(), key=lambda c: c.cid):
            by_owner: dict[str, int] = {}
            for o in c.held.values():
                by_owner[o] = by_owner.get(o, 0) + 1
            clients.append(
                {
                    "client_id": c.cid,
                    "name": c.name,
                    "pid": c.pid,
                    "peer_pid": c.peer_pid,
                    "held": c.holding,
                    "adopted": c.adopted,
                    "by_owner": by_owner,
                    "asked": c.asked,
                    "idle": c.idle,
                    "headroom": c.headroom,
                    "busy": c.busy,
                    "link_interval": c.link_interval if c.link is not None else None,
                }
            )
        return {
            "budget": self.budget,
            "created": self._created(),
            "free": len(self._free),
            "adopted": self._adopted_total(),
            "floor": self.floor,
            "pending": len(self._pending),
            "reclaim_by_tier": dict(self.reclaim_by_tier),
            "clients": clients,
        }

    def check_invariants(self) -> None:
        with self._lock:
            free = set(self._free)
            if len(free) != len(self._free):
                raise ArbiterInvariantError("a chunk is listed FREE twice")
            seen = set(free)
            for c in self._clients.values():
                for cid in c.held:
                    if cid in seen:
                        raise ArbiterInvariantError(f"chunk {cid} is held twice (or held and free)")
                    if self._holder.get(cid) != c.cid:
                        raise ArbiterInvariantError(f"chunk {cid}: holder map disagrees")
                    seen.add(cid)
            held = sum(len(c.held) for c in self._clients.values())
            if len(self._holder) != held:
                raise ArbiterInvariantError(f"holder map has {len(self._holder)} entries, clients hold {held}")
            if seen != set(self._chunks):
                raise ArbiterInvariantError(f"chunks neither free nor held: {sorted(set(self._chunks) - seen)}")
            adopted = self._adopted_total()
            if held + len(self._free) != len(self._chunks) or len(self._chunks) + adopted > self.budget:
                raise ArbiterInvariantError(
                    f"held {held} + free {len(self._free)} != created {len(self._chunks)} "
                    f"(adopted {adopted}, budget {self.budget})"
                )
            live = {c.handle_id for c in self.backend.live_chunks()}
            if not set(self._chunks) <= live:
                raise ArbiterInvariantError("a pooled chunk was destroyed in the backend")

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
                        elif key.data.cid in self._clients:
                            self._on_readable(key.data)
                    except Exception:  # never let one client take the arbiter down
                        log.exception("arbiter: unexpected error while handling an event")
                        self.stats["errors"] += 1
                        if isinstance(key.data, _Client) and key.data.cid in self._clients:
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
        elif len(self._clients) >= self.max_clients:
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
        client = _Client(self._next_cid, sock, pid)
        self._next_cid += 1
        self._clients[client.cid] = client
        self._sel.register(sock, selectors.EVENT_READ, client)

    def _on_readable(self, client: _Client) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(client.sock, proto.MAX_MESSAGE_BYTES + 1, MAX_FDS)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # ECONNRESET and friends
            self._drop(client, f"recv failed: {exc}")
            return
        _close_fds(fds)  # clients never send fds; close whatever arrived so nothing leaks
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
        kind = msg["type"]
        if kind == "HELLO":
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
            return
        if client.name is None:
            self._error(client, msg["req_id"], "type", f"expected HELLO first, got {kind}")
            return
        if kind == "BORROW":
            self._on_borrow(client, msg)
        elif kind == "RETURN":
            self._on_return(client, msg)
        elif kind == "STATUS":
            self._send(client, dict(self._status_locked(), type="STATUS", req_id=msg["req_id"]))
        elif kind == "REPORT":
            self._on_report(client, msg)
        elif kind == "LINK":
            self._on_link(client, msg)
        elif kind == "ADOPT":
            self._on_adopt(client, msg)
        elif kind == "RELEASE":
            self._on_release(client, msg)

    @staticmethod
    def _at_eof(sock: socket.socket) -> bool:
        """After a 0-byte read: EOF (the peer closed or shut down writing: the kernel flags
        RDHUP on our end) or an empty SEQPACKET record from a live peer?"""
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))

    # ------------------------------------------------------------- handlers
    def _adopted_total(self) -> int:
        return sum(c.adopted for c in self._clients.values())

    def _created(self) -> int:
        """Chunks counted against the budget: created here, or adopted."""
        return len(self._chunks) + self._adopted_total()

    def _available_now(self) -> int:
        return len(self._free) + self.budget - self._created()

    def _donor(self, c: _Client, nominal: int) -> Donor:
        """Client ``c`` as the policy sees it (module docstring), net of what it was already asked for."""
        held = c.holding - c.asked
        idle = held - self.floor if c.idle is None else min(c.idle - c.asked, held - self.floor)
        idle = max(0, idle)
        return Donor(
            AccountKey(0, _owner(c), Kind.KV),
            held,
            idle,
            min(c.headroom, idle),
            1,
            nominal,
            c.holding - nominal,
            c.busy,
        )

    def _plan_reclaim(self, client: _Client, want: int) -> tuple[int, list[tuple[_Client, int, str]]]:
        """Where ``want`` more chunks would come from: (chunks gatherable, [(donor, chunks, tier)])."""
        others = [c for c in self._clients.values() if c is not client and c.name is not None]
        named = sum(1 for c in self._clients.values() if c.name is not None)
        nominal = self.budget // max(1, named)
        by_key = {}
        donors = []
        for c in others:
            d = self._donor(c, nominal)
            by_key[d.key] = c
            donors.append(d)
        entitled = client.holding < nominal
        gathered, takes = plan_takes(_owner(client), want, 0, donors, DEFAULT_TIERS, entitled, 0.0)
        return gathered, [(by_key[d.key], n, tier.value) for d, n, tier in takes]

    def _on_borrow(self, client: _Client, msg: dict) -> None:
        n, req_id = msg["n"], msg["req_id"]
        if not self._pending and n <= self._available_now():
            self._grant(client, req_id, n, msg["owner"])
            return
        waiting = sum(p.n for p in self._pending)
        shortfall = waiting + n - self._available_now() - sum(c.asked for c in self._clients.values())
        gathered, takes = self._plan_reclaim(client, max(shortfall, 0))
        if gathered < shortfall:
            possible = max(0, n - (shortfall - gathered))
            self._deny(client, req_id, f"{n} chunk(s) requested, at most {possible} could be reclaimed", possible)
            return
        self._pending.append(_Pending(client, req_id, n, msg["owner"], time.monotonic() + self.reclaim_timeout))
        asks: dict[int, int] = {}
        for victim, k, tier in takes:
            victim.asked += k
            asks[victim.cid] = asks.get(victim.cid, 0) + k
            self.reclaim_by_tier[tier] = self.reclaim_by_tier.get(tier, 0) + k
        for cid, k in asks.items():
            self.stats["reclaim_sent"] += 1
            self._send(self._clients[cid], {"type": "RECLAIM", "n": k})
        self._serve_pending()

    def _on_report(self, client: _Client, msg: dict) -> None:
        client.idle, client.headroom, client.busy = msg["idle"], msg["headroom"], msg["busy"]

    def _on_link(self, client: _Client, msg: dict) -> None:
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
        own_interval = msg["min_interval"] or n + 1
        client.link = GpuDemand(_owner(client), n, msg["layer_bytes"], times[own_interval - 1], msg["min_interval"],
                                None, iter_times={i + 1: t for i, t in enumerate(times)})  # fmt: skip
        client.link_bytes_per_s = float(msg["link_bytes_per_s"])
        others = [c for c in self._clients.values() if c is not client and c.link is not None]
        bandwidth = min([client.link_bytes_per_s] + [c.link_bytes_per_s for c in others])
        decision = LinkCoordinator(bandwidth).decide(client.link, [c.link for c in others])
        if decision.accepted:
            for c in [client] + others:
                c.link_interval = decision.intervals[c.link.name]
            reason = f"{len(others) + 1} on the link, {decision.total_rate / bandwidth:.0%} of it"
        else:  # nothing fits with this one in: it streams nothing more, the others keep theirs
            client.link_interval = None
            reason = decision.reason
        self.stats["link_decisions"] += 1
        self._send(client, {"type": "LINKED", "req_id": msg["req_id"], "interval": client.link_interval,
                            "sharing": len(others) + 1, "reason": reason[:4096]})  # fmt: skip

    def _on_adopt(self, client: _Client, msg: dict) -> None:
        """Book up to ``n`` chunks the client kept from an earlier arbiter (module docstring):
        at most what no client holds; FREE chunks are destroyed to make room for them."""
        held_total = sum(c.holding for c in self._clients.values())
        k = min(msg["n"], self.budget - held_total)
        over = self._created() + k - self.budget
        for _ in range(max(0, over)):  # k <= free + uncreated, so the FREE list covers it
            cid = self._free.pop(0)  # coldest first
            self.backend.destroy_chunk(self._chunks.pop(cid))
        client.adopted += k
        self.stats["adopted"] += k
        if k:
            log.info("arbiter: client %d (%s) adopted %d of %d chunk(s) it kept", client.cid, client.name, k, msg["n"])
        self._send(client, {"type": "ADOPTED", "req_id": msg["req_id"], "adopted": k})

    def _on_release(self, client: _Client, msg: dict) -> None:
        n = msg["n"]
        if n > client.adopted:
            self._error(client, msg["req_id"], "n", f"client {client.cid} has {client.adopted} adopted chunk(s)")
            return
        client.adopted -= n
        client.asked = max(0, client.asked - n)
        self.stats["released"] += n
        self._send(client, {"type": "ACK", "req_id": msg["req_id"], "returned": n})
        self._serve_pending()

    def _on_return(self, client: _Client, msg: dict) -> None:
        ids = msg["chunks"]
        for i, cid in enumerate(ids):
            if client.held.get(cid) is None:
                self._error(client, msg["req_id"], f"chunks[{i}]", f"chunk {cid} is not held by client {client.cid}")
                return
        for cid in ids:
            del client.held[cid], self._holder[cid]
            self._free.append(cid)
        client.asked = max(0, client.asked - len(ids))
        self.stats["returned"] += len(ids)
        self._send(client, {"type": "ACK", "req_id": msg["req_id"], "returned": len(ids)})
        self._serve_pending()

    def _grant(self, client: _Client, req_id: int, n: int, owner: str) -> None:
        taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        created: list[PhysicalChunk] = []
        try:
            while len(taken) + len(created) < n:
                created.append(self.backend.create_chunk())
        except Exception as exc:
            self._free.extend(reversed(taken))
            for c in created:
                self.backend.destroy_chunk(c)
            self._deny(client, req_id, f"creating a chunk failed: {exc}", self._available_now())
            return
        for c in created:
            self._chunks[c.handle_id] = c
        ids = taken + [c.handle_id for c in created]
        for cid in ids:
            client.held[cid] = owner
            self._holder[cid] = client.cid
        self.stats["granted"] += n
        meta = {"type": "GRANT", "req_id": req_id, "owner": owner, "chunks": ids}
        try:
            send_chunks(client.sock, [self._chunks[i] for i in ids], meta=meta)
        except OSError as exc:
            self._drop(client, f"sending a GRANT failed: {exc}")  # frees the chunks just recorded

    def _deny(self, client: _Client, req_id: int, reason: str, available: int) -> None:
        self.stats["denied"] += 1
        self._send(client, {"type": "DENY", "req_id": req_id, "reason": reason, "available": available})

    def _error(self, client: _Client, req_id: int | None, field_: str, message: str) -> None:
        self.stats["errors"] += 1
        self._send(client, {"type": "ERROR", "req_id": req_id, "field": field_, "message": message[:4096]})

    def _send(self, client: _Client, msg: dict) -> bool:
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
        while self._pending and self._pending[0].n <= self._available_now():
            p = self._pending.pop(0)
            if p.client.cid in self._clients:
                self._grant(p.client, p.req_id, p.n, p.owner)
        if not self._pending:
            for c in self._clients.values():
                c.asked = 0

    def _expire_pending(self) -> None:
        now = time.monotonic()
        expired = [p for p in self._pending if p.deadline <= now]
        if not expired:
            return
        self._pending = [p for p in self._pending if p.deadline > now]
        for p in expired:
            if p.client.cid in self._clients:
                self._deny(
                    p.client,
                    p.req_id,
                    f"reclaim did not free enough chunks within {self.reclaim_timeout:g} s",
                    self._available_now(),
                )
        self._serve_pending()

    def _drop(self, client: _Client, why: str, *, serve: bool = True) -> None:
        if self._clients.pop(client.cid, None) is None:
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
            del self._holder[cid]
            self._free.append(cid)
        self.stats["clients_dropped"] += 1
        self.stats["chunks_freed_on_drop"] += len(client.held)
        client.held.clear()
        self.stats["adopted_freed_on_drop"] += client.adopted
        client.adopted = 0
        self._pending = [p for p in self._pending if p.client is not client]
        if serve:
            self._serve_pending()


def _stop_when_gone(pid: int, stop) -> None:
    """Call ``stop`` once process ``pid`` has exited (at once if it is gone already).

    Invariant: an arbiter whose owner died does not outlive it, so a SIGKILLed ``sglang-memx
    serve`` (whose engines die with it, ``PR_SET_PDEATHSIG``) leaves no pool holding memory."""
    wait_for_exit(pid)
    log.warning("arbiter: owner pid %d exited: stopping the pool", pid)
    stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m memory_ext.pool.arbiter",
        description="Per-device chunk arbiter shared by several engine processes.",
    )
    ap.add_argument("--socket", required=True, help="Unix socket path to create (mode 0600)")
    ap.add_argument("--budget-chunks", type=int, required=True)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--granularity-mib", type=int, default=None, help="chunk size in MiB (default 2)")
    size.add_argument("--granularity-kib", type=int, default=None, help="chunk size in KiB")
    ap.add_argument("--pid-file", default=None, help="write this process's pid here (removed on exit)")
    ap.add_argument("--floor-per-client", type=int, default=0)
    ap.add_argument("--reclaim-timeout", type=float, default=2.0)
    ap.add_argument("--backend", choices=("host",), default="host")
    ap.add_argument("--owner-pid", type=int, default=None,
                    help="stop the pool (free every chunk) when this process exits, e.g. the "
                         "`sglang-memx serve` that started the pool's engines")  # fmt: skip
    args = ap.parse_args(argv)
    if args.owner_pid is not None and args.owner_pid <= 0:
        ap.error(f"--owner-pid: must be a positive pid, got {args.owner_pid}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ..vmm import host_backend

    granularity = (args.granularity_kib << 10) if args.granularity_kib else ((args.granularity_mib or 2) << 20)
    backend = host_backend(granularity, name="memx-arbiter")
    arb = Arbiter(
        args.socket,
        backend,
        args.budget_chunks,
        floor_per_client=args.floor_per_client,
        reclaim_timeout=args.reclaim_timeout,
    )

    def _stop(signum, frame):
        arb._stopping = True
        if arb._wake_w is not None:
            try:
                arb._wake_w.send(b"x")
            except OSError:
                pass

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.owner_pid is not None:
        threading.Thread(target=_stop_when_gone, args=(args.owner_pid, lambda: _stop(None, None)), daemon=True,
                         name="memx-arbiter-owner").start()  # fmt: skip
    log.info("arbiter: serving %s, budget %d chunk(s) of %d KiB", args.socket, args.budget_chunks, granularity >> 10)
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    try:
        arb.serve_forever()
    finally:
        backend.close()
        if args.pid_file:
            try:
                os.unlink(args.pid_file)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
