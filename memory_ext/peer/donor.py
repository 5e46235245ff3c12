"""The donor's end: a Unix socket where borrowers connect, one lease (a ``DonatedRegion``) each.

Chunks reach a borrower over a **direct** Unix socket (``listen_unix``: SOCK_SEQPACKET, file 0600
in a private directory), not through the pool's arbiter: a donation does not change who holds
the memory. The chunks stay the donor's (``PEER_DONATION`` in its ledger, and the donor's in the
arbiter's books when the pool is shared), so the budget counts them once, and when the donor
dies the arbiter's existing client-death path takes them back. The arbiter moves *ownership*;
this socket moves *access* (fd duplicates) plus the lease's control messages (``wire``).

Per lease, the donor (engine thread) calls ``grow`` / ``reclaim``; a thread per lease answers
the borrower. The protocol's guarantees:

* **Reads are never stale.** ``reclaim`` bumps the revoked blocks' generations before it returns
  (``region.revoke_tail``); a borrower validates each read against them (``link``).
* **Reclaim is immediate.** The revoked units go back to the pool (or to ``to``) in the same call,
  without waiting for the borrower, except units under a *write fence*: a borrower announces
  its writes (WRITE_BEGIN, answered WRITE_OK only for blocks still in the region) and ends them
  (WRITE_END). A fenced unit is handed back when its fence ends or the borrower dies; so the
  donor never reuses bytes a borrower may still be writing.
* **Borrower death** (EOF or a socket error): the lease is dropped; units an earlier reclaim left
  behind go to that reclaim's owner (``on_release``), the others to FREE (``on_lost``). A dead
  process writes nothing, so its fences are void (a borrower that leaves lets its writes end
  first: ``PeerLink.close``).
* **Closing** (``close``): every lease is revoked at once, running writes get a bounded wait.

Not handled: a borrower alive but stuck inside a write keeps its fenced units (``status``
reports them as ``fenced_units``). Sends are blocking; the messages are small.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from ..policy._checks import check_int
from ..pool.ownership import ChunkPool, Owner
from ..vmm.base import PhysicalChunk
from ..vmm.ipc import listen_unix
from . import wire
from .layout import PeerKVLayout
from .region import DonatedRegion, exact_unit_chunks

log = logging.getLogger(__name__)


class _Lease:
    def __init__(self, lease_id: int, sock: socket.socket, peer_pid: int):
        self.id = lease_id
        self.sock = sock
        self.peer_pid = peer_pid
        self.name = ""
        self.layout: PeerKVLayout | None = None
        self.region: DonatedRegion | None = None
        self.fences: collections.Counter[int] = collections.Counter()
        self.pending_to = Owner.FREE
        self.alive = True
        self.pin_bytes = 0  # > 0: a pinned lease (layer stream cache): never reclaimed while it lives
        self.send_lock = threading.Lock()

    def fenced(self, blocks: range) -> bool:
        return any(self.fences.get(b) for b in blocks)

    def send(self, msg: dict, fds=()) -> None:
        with self.send_lock:
            wire.send(self.sock, msg, fds)


def _peer_pid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


class PeerDonor:
    """Serve leases of donated KV space to borrowers connecting at ``socket_path``.

    ``max_bytes_per_lease`` caps one borrower's region. Regions grow and shrink by one chunk, or
    with ``exact_units`` by the smallest run of chunks that holds whole blocks (``region``).
    ``accept_layout(layout)`` may raise ValueError to refuse a borrower (its message goes back in
    REFUSE). ``on_release(lease, chunks)`` is called when units a ``reclaim`` had to leave behind
    (write fence) are handed back to its ``to`` owner later. ``on_lost(lease, units)`` is called when a lease ends (the
    borrower died or left): its remaining ``units`` went back to FREE.
    """

    def __init__(
        self,
        pool: ChunkPool,
        socket_path,
        *,
        max_bytes_per_lease: int,
        name: str = "donor",
        accept_layout: Callable[[PeerKVLayout], None] | None = None,
        exact_units: bool = False,
        on_release: Callable[[int, list[PhysicalChunk]], None] | None = None,
        on_lost: Callable[[int, int], None] | None = None,
    ):
        if not isinstance(pool, ChunkPool):
            raise ValueError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        self.pool = pool
        self.name = name
        self.max_bytes_per_lease = check_int("max_bytes_per_lease", max_bytes_per_lease, minimum=1)
        self.device = str(pool.backend.device)
        self._accept_layout = accept_layout
        self.exact_units = bool(exact_units)
        self._on_release = on_release
        self._on_lost = on_lost
        self._lock = threading.RLock()
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.socket_path = os.fspath(socket_path)
        self._listener = listen_unix(self.socket_path)
        self.stats = collections.Counter()
        self._changed = threading.Condition(self._lock)
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._accept_thread.start()

    # ------------------------------------------------------------------ engine side
    def unit_chunks_for(self, block_bytes: int) -> int:
        """Chunks per region unit for blocks of ``block_bytes``: 1, or with ``exact_units`` the
        smallest unit holding whole blocks (``region.exact_unit_chunks``)."""
        return exact_unit_chunks(block_bytes, self.pool.chunk_bytes) if self.exact_units else 1

    def leases(self) -> list[int]:
        with self._lock:
            return [lid for lid, lease in self._leases.items() if lease.region is not None]

    def wait_for_lease(self, timeout: float = 5.0) -> int | None:
        """The id of a lease once one borrower has been welcomed (or None after ``timeout``)."""
        with self._changed:
            self._changed.wait_for(lambda: self.leases(), timeout)
            ids = self.leases()
            return ids[0] if ids else None

    def _lease(self, lease_id: int) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.region is None:
            raise ValueError(f"lease: no live lease {lease_id!r}")
        return lease

    def region(self, lease_id: int) -> DonatedRegion:
        with self._lock:
            return self._lease(lease_id).region

    def pin_bytes(self, lease_id: int) -> int:
        """Bytes a pinned lease asked for (its borrower streams layers from it); 0: an ordinary lease."""
        with self._lock:
            return self._lease(lease_id).pin_bytes

    def grow(self, lease_id: int, units: int) -> list[PhysicalChunk]:
        """Donate ``units`` more elastic units to the lease (PoolExhausted etc. propagate)."""
        with self._lock:
            lease = self._lease(lease_id)
            region = lease.region
            first = region.units
            chunks = region.grow(units)
            fds = []
            try:
                fds = [self.pool.backend.export_chunk(c) for c in chunks]
                lease.send(
                    {"type": "GROW", "first_unit": first, "units": units, "chunks": [c.handle_id for c in chunks]},
                    fds,
                )
            except (OSError, ConnectionError) as exc:
                log.warning("peer donor %s: lease %d lost during GROW: %s", self.name, lease_id, exc)
                self._drop(lease)
                return []
            finally:
                wire.close_fds(fds)
            self.stats["grown_units"] += units
            return chunks

    def reclaim(self, lease_id: int, units: int, *, to: Owner = Owner.FREE) -> list[PhysicalChunk]:
        """Take ``units`` units back from the lease's tail, at once.

        Returns the chunks handed back now (to FREE or owned by ``to``); units under a borrower's
        write fence follow when the fence ends (``on_release``).
        """
        check_int("units", units)
        with self._lock:
            lease = self._lease(lease_id)
            region = lease.region
            revoked = region.revoke_tail(units)
            lease.pending_to = to
            self.stats["reclaimed_blocks"] += len(revoked)
            try:
                lease.send({"type": "REVOKE", "units": region.units})
            except (OSError, ConnectionError):
                pass  # the lease thread sees the death and drops the lease
            return region.release_tail(to, fenced=lease.fenced)

    def status(self) -> dict:
        with self._lock:
            out = []
            for lease in self._leases.values():
                if lease.region is None:
                    continue
                r = lease.region
                out.append(
                    {
                        "lease": lease.id,
                        "borrower": lease.name,
                        "pid": lease.peer_pid,
                        "units": r.units,
                        "fenced_units": r.physical_units - r.units,
                        "donated_bytes": r.units * r.unit_bytes,
                        "fences": sum(1 for v in lease.fences.values() if v),
                        "pin_bytes": lease.pin_bytes,
                    }
                )
            return {"leases": out, **dict(self.stats)}

    def close(self, fence_timeout: float = 5.0) -> None:
        """Stop serving: revoke every lease at once (generations bumped, REVOKE sent), wait up to
        ``fence_timeout`` s for the borrowers' running writes to end, then close every lease (its
        chunks go back to FREE) and the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leases = list(self._leases.values())
            for lease in leases:
                if lease.region is not None and lease.alive:
                    lease.region.revoke_tail(lease.region.units)
                    try:
                        lease.send({"type": "REVOKE", "units": 0})
                    except (OSError, ConnectionError):
                        pass
            if not self._changed.wait_for(lambda: not any(le.alive and +le.fences for le in leases), fence_timeout):
                log.warning("peer donor %s: closing with borrower writes still running", self.name)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        for lease in leases:
            try:
                lease.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join(5)
        for t in list(self._threads):
            t.join(5)
        with self._lock:
            for lease in list(self._leases.values()):
                self._drop(lease)

    # ------------------------------------------------------------------ threads
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                try:
                    lease = _Lease(next(self._ids), sock, _peer_pid(sock))
                except OSError:
                    sock.close()
                    continue
                self._leases[lease.id] = lease
                t = threading.Thread(
                    target=self._serve, args=(lease,), name=f"{self.name}-lease{lease.id}", daemon=True
                )
                self._threads.append(t)
            t.start()

    def _serve(self, lease: _Lease) -> None:
        try:
            if self._handshake(lease):
                while True:
                    got = wire.recv(lease.sock)
                    if got is None:
                        break
                    msg, fds = got
                    wire.close_fds(fds)  # only WELCOME / GROW carry fds, and a donor receives neither
                    self._handle(lease, msg)
        except (OSError, ConnectionError):
            pass
        except ValueError as exc:
            log.warning("peer donor %s: lease %d sent a bad message: %s", self.name, lease.id, exc)
        finally:
            with self._lock:
                self._drop(lease)

    def _handshake(self, lease: _Lease) -> bool:
        got = wire.recv(lease.sock)
        if got is None:
            return False
        msg, _ = got
        try:
            if msg["type"] != "HELLO":
                raise ValueError(f"type: expected HELLO, got {msg['type']}")
            if msg["version"] != wire.VERSION:
                raise ValueError(f"version: expected {wire.VERSION}, got {msg['version']}")
            layout = PeerKVLayout.from_wire(msg["layout"])
            if self._accept_layout is not None:
                self._accept_layout(layout)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            wire.send(lease.sock, {"type": "REFUSE", "field": field, "message": str(exc)})
            self.stats["refused"] += 1
            return False
        with self._lock:
            if self._closed:
                return False
            unit_chunks = self.unit_chunks_for(layout.block_bytes)
            unit_bytes = unit_chunks * self.pool.chunk_bytes
            max_units = self.max_bytes_per_lease // unit_bytes
            if max_units * unit_bytes < layout.block_bytes:
                msg = (
                    f"max_bytes_per_lease {self.max_bytes_per_lease} holds no {layout.block_bytes}-byte block "
                    f"in units of {unit_bytes} bytes"
                )
                wire.send(lease.sock, {"type": "REFUSE", "field": "layout", "message": msg})
                return False
            region = DonatedRegion(
                self.pool, layout.block_bytes, max_units, unit_chunks=unit_chunks, name=f"memx-peer-{lease.id}"
            )
            lease.name, lease.layout = msg["name"], layout
            lease.pin_bytes = msg.get("pin_bytes", 0)
            gen_fd = region.generations.export_fd()
            try:
                lease.send(
                    {
                        "type": "WELCOME",
                        "version": wire.VERSION,
                        "lease": lease.id,
                        "device": self.device,
                        "chunk_bytes": region.chunk_bytes,
                        "block_bytes": region.block_bytes,
                        "unit_chunks": region.unit_chunks,
                        "max_units": region.max_units,
                    },
                    [gen_fd],
                )
            except BaseException:
                region.close()
                raise
            finally:
                os.close(gen_fd)
            lease.region = region
            self._changed.notify_all()
        return True

    def _handle(self, lease: _Lease, msg: dict) -> None:
        kind = msg["type"]
        with self._lock:
            region = lease.region
            if kind == "WRITE_BEGIN":
                blocks = msg["blocks"]
                bad = [b for b in blocks if b >= region.num_blocks]
                if bad:
                    lease.send(
                        {
                            "type": "WRITE_DENIED",
                            "req_id": msg["req_id"],
                            "message": f"blocks {bad[:8]} are not in the region ({region.num_blocks} blocks)",
                        }
                    )
                    self.stats["writes_denied"] += 1
                    return
                lease.fences.update(blocks)
                self.stats["writes_fenced"] += 1
                gens = [region.generations.get(b) for b in blocks]
                lease.send({"type": "WRITE_OK", "req_id": msg["req_id"], "gens": gens})
            elif kind == "WRITE_END":
                for b in msg["blocks"]:
                    if lease.fences.get(b, 0) > 0:
                        lease.fences[b] -= 1
                        if not lease.fences[b]:
                            del lease.fences[b]
                self._changed.notify_all()
                if region.physical_units > region.units:
                    late = region.release_tail(lease.pending_to, fenced=lease.fenced)
                    if late and self._on_release is not None:
                        self._on_release(lease.id, late)
            else:
                lease.send({"type": "ERROR", "field": "type", "message": f"unexpected {kind} from a borrower"})

    def _drop(self, lease: _Lease) -> None:
        """Forget a lease, socket closed, lock held: units an earlier ``reclaim`` left behind go to
        its ``to`` owner (``on_release``), the lease's other units to FREE (``on_lost``)."""
        if self._leases.pop(lease.id, None) is None:
            return
        lease.alive = False
        lease.fences.clear()  # a dead (or departed) borrower writes nothing more
        region = lease.region
        if region is not None:
            late = region.release_tail(lease.pending_to)  # reclaimed earlier, held by a fence
            units = region.units
            region.revoke_tail(units)
            region.release_tail(Owner.FREE)
            region.close()
            self.stats["leases_dropped"] += 1
            if late and self._on_release is not None:
                self._on_release(lease.id, late)
            if self._on_lost is not None:
                self._on_lost(lease.id, units)
        try:
            lease.sock.close()
        except OSError:
            pass
        self._changed.notify_all()
