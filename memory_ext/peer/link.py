"""The borrower's end of one lease: the donor's chunks mapped here, blocks copied in and out.

``PeerLink(socket_path, name, layout, backend)`` connects (HELLO with the borrower's layout;
a REFUSE raises ValueError naming the donor's field), maps the generation table read-only and
reserves a range as large as the lease can grow. ``copier`` (default: ``copier_for`` the
backend's device) moves every byte of a read or write; tests pass their own to stop a copy at a
chosen moment (``test_peer_donor_mid_read.py``). A thread receives the donor's messages:

* GROW: import the chunks (``backend.import_chunk``), map them at the tail, ``on_grow(blocks)``;
* REVOKE: blocks past the new size are refused to new operations at once, ``on_revoke(blocks)``,
  then their chunks are unmapped and destroyed as soon as no read is in flight and no write of
  this link fences them (never under a running copy: that would fault);
* EOF or error (donor exited, killed, closed): ``on_dead()``, then, once the operations in
  flight have finished, every chunk is unmapped and destroyed, the range and the table released.
  Nothing of the donor's stays mapped, nothing leaks.

Reads (``read(ref, dst)``) are seqlock-validated and never return stale bytes as valid: the
block's generation (donor-written) and this link's own write version of the block must equal
the ``BlockRef``'s both before and after the copy, and the donor must still be connected after
it (a hang-up is checked with ``poll``). A failed validation is a miss (False), never an error.

Writes (``write(blocks, srcs)``) are fenced by the donor (WRITE_BEGIN / WRITE_OK ... WRITE_END):
while fenced, the donor does not reuse those blocks' memory, so a write never lands on bytes the
donor took back. Each write returns ``BlockRef``s carrying the generations the donor granted
under the fence.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..policy._checks import check_int
from ..vmm.base import PhysicalChunk, VmmBackend
from ..vmm.ipc import connect_unix
from . import wire
from .copier import copier_for
from .generations import GenerationTable
from .layout import PeerKVLayout
from .region import blocks_in, blocks_touching

log = logging.getLogger(__name__)

_HUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


@dataclass(frozen=True)
class BlockRef:
    """One stored block: which donor (``peer``), where (``block``), and which tenancy (``gen``, ``lver``)."""

    peer: str
    block: int
    gen: int
    lver: int


class _Pending:
    __slots__ = ("blocks", "reply", "abandoned")

    def __init__(self, blocks):
        self.blocks = blocks
        self.reply: dict | None = None
        self.abandoned = False


def _as_bytes(t: torch.Tensor, nbytes: int, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")
    b = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
    if b.numel() != nbytes:
        raise ValueError(f"{name}: {b.numel()} bytes, a block is {nbytes}")
    return b


class PeerLink:
    def __init__(
        self,
        socket_path,
        name: str,
        layout: PeerKVLayout,
        backend: VmmBackend,
        *,
        copier=None,
        on_grow: Callable[[PeerLink, range], None] | None = None,
        on_revoke: Callable[[PeerLink, range], None] | None = None,
        on_dead: Callable[[PeerLink], None] | None = None,
        write_timeout: float = 10.0,
        pin_bytes: int = 0,
    ):
        if not isinstance(layout, PeerKVLayout):
            raise ValueError(f"layout must be a PeerKVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.backend = backend
        self.copier = copier if copier is not None else copier_for(backend.device)
        self.on_grow, self.on_revoke, self.on_dead = on_grow, on_revoke, on_dead
        self.write_timeout = write_timeout
        self.pin_bytes = check_int("pin_bytes", pin_bytes)
        self.socket_path = os.fspath(socket_path)
        self.peer = self.socket_path  # how the index names this donor
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._reading: Counter[int] = Counter()  # block -> reads in flight
        self._fenced: Counter[int] = Counter()  # block -> this link's writes in flight
        self._writing: set[int] = set()  # blocks of the writes in progress (one write per block)
        self._chunks: list[PhysicalChunk] = []
        self.dead = False
        self.closed = False
        self._closing = False
        self.stats = Counter()
        self.sock = connect_unix(self.socket_path)
        try:
            self._handshake(name)
        except BaseException:
            self.sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"peer-link-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ setup
    def _handshake(self, name: str) -> None:
        hello = {"type": "HELLO", "version": wire.VERSION, "name": name, "pid": os.getpid()}
        if self.pin_bytes:
            hello["pin_bytes"] = self.pin_bytes
        wire.send(self.sock, {**hello, "layout": self.layout.to_wire()})
        got = wire.recv(self.sock)
        if got is None:
            raise ConnectionError(f"peer donor at {self.socket_path} closed the connection during HELLO")
        msg, fds = got
        if msg["type"] == "REFUSE":
            raise ValueError(f"{msg['field']}: refused by the donor at {self.socket_path}: {msg['message']}")
        if msg["type"] != "WELCOME":
            wire.close_fds(fds)
            raise ValueError(f"type: expected WELCOME from the donor, got {msg['type']}")
        try:
            if msg["version"] != wire.VERSION:
                raise ValueError(f"version: donor speaks {msg['version']}, this borrower {wire.VERSION}")
            if msg["device"] != str(self.backend.device):
                raise ValueError(
                    f"device: the donor's KV memory is on {msg['device']}, "
                    f"this link's backend maps {self.backend.device}"
                )
            if msg["chunk_bytes"] != self.backend.granularity:
                raise ValueError(
                    f"chunk_bytes: donor chunks are {msg['chunk_bytes']} bytes, backend granularity "
                    f"{self.backend.granularity}"
                )
            if msg["block_bytes"] != self.layout.block_bytes:
                raise ValueError(f"block_bytes: donor says {msg['block_bytes']}, layout {self.layout.block_bytes}")
            if (
                msg["unit_chunks"] < 1
                or msg["max_units"] * msg["unit_chunks"] * msg["chunk_bytes"] < msg["block_bytes"]
            ):
                raise ValueError(
                    f"max_units: a lease of {msg['max_units']} x {msg['unit_chunks']} chunks holds no block"
                )
        except BaseException:
            wire.close_fds(fds)
            raise
        self.lease = msg["lease"]
        self.block_bytes = msg["block_bytes"]
        self.chunk_bytes = msg["chunk_bytes"]
        self.unit_chunks = msg["unit_chunks"]
        self.unit_bytes = self.unit_chunks * self.chunk_bytes
        self.max_units = msg["max_units"]
        self.max_blocks = blocks_in(self.max_units * self.unit_bytes, self.block_bytes)
        self.generations = GenerationTable.open(fds[0], self.max_blocks)
        try:
            self.vrange = self.backend.reserve(self.max_units * self.unit_chunks * self.chunk_bytes)
        except BaseException:
            self.generations.close()
            raise
        self.units = 0  # logical: blocks [0, num_blocks) may be used
        self._lver = [0] * self.max_blocks

    # ------------------------------------------------------------------ info
    @property
    def num_blocks(self) -> int:
        return blocks_in(self.units * self.unit_bytes, self.block_bytes)

    @property
    def mapped_units(self) -> int:
        return len(self._chunks) // self.unit_chunks

    def has_block(self, block: int) -> bool:
        return not self.dead and 0 <= block < self.num_blocks

    def imported_chunks(self) -> int:
        with self._cond:
            return len(self._chunks)

    # ------------------------------------------------------------------ data path
    def read(self, ref: BlockRef, dst: torch.Tensor) -> bool:
        """Copy block ``ref`` into ``dst``; True only if the bytes are the ones written under ``ref``."""
        out = _as_bytes(dst, self.block_bytes, "dst")
        b = ref.block
        with self._cond:
            if ref.peer != self.peer or not self.has_block(b) or self._lver[b] != ref.lver:
                self.stats["read_misses"] += 1
                return False
            self._reading[b] += 1
        try:
            if self.generations.get(b) != ref.gen:
                self.stats["read_misses"] += 1
                return False
            src = self.backend.tensor_view(self.vrange, b * self.block_bytes, self.block_bytes)
            self.copier.copy(out, src)
            self.copier.fence(out, src)
            ok = self.generations.get(b) == ref.gen and self._lver[b] == ref.lver and not self._hung_up()
            self.stats["reads_ok" if ok else "reads_invalidated"] += 1
            return ok
        finally:
            with self._cond:
                self._reading[b] -= 1
                if not self._reading[b]:
                    del self._reading[b]
                    self._trim()
                    self._cond.notify_all()

    @property
    def usable_bytes(self) -> int:
        """Bytes of the complete blocks of the lease now (what ``span`` may cover)."""
        with self._cond:
            return 0 if self.dead else self.num_blocks * self.block_bytes

    @contextlib.contextmanager
    def span(self, offset: int, nbytes: int):
        """A uint8 view of bytes ``[offset, offset + nbytes)`` of the lease, for raw copies (the
        layer stream cache's layer planes), or None when the donor is gone or those bytes are not
        (any more) in the lease. While the ``with`` body runs, the blocks under the span count as
        being read: a revoke or the donor's death unmaps them only after it ends, so a copy never
        faults. Whether the bytes stayed the donor's is the caller's check (``alive`` after the
        copy): only pinned leases, which the donor never revokes, should be read this way."""
        first, end = offset // self.block_bytes, -(-(offset + nbytes) // self.block_bytes)
        blocks = range(first, end)
        with self._cond:
            ok = not (self.dead or self._closing or end > self.num_blocks)
            if ok:
                self._reading.update(blocks)
        if not ok:
            yield None
            return
        try:
            yield self.backend.tensor_view(self.vrange, offset, nbytes)
        finally:
            with self._cond:
                self._reading.subtract(blocks)
                self._reading += Counter()  # drop zero counts
                self._trim()
                self._cond.notify_all()

    def alive(self) -> bool:
        """The donor is connected and the lease not revoked (a hang-up is seen at once)."""
        return not self.dead and not self._hung_up()

    def write(self, blocks: Sequence[int], srcs: Sequence[torch.Tensor]) -> list[BlockRef] | None:
        """Copy ``srcs[i]`` into block ``blocks[i]`` under the donor's fence; None if refused or gone."""
        blocks = [int(b) for b in blocks]
        if len(blocks) != len(srcs) or len(set(blocks)) != len(blocks) or not blocks:
            raise ValueError("blocks: need one distinct block per source tensor")
        data = [_as_bytes(s, self.block_bytes, f"srcs[{i}]") for i, s in enumerate(srcs)]
        req_id = next(self._ids)
        pending = _Pending(blocks)
        with self._cond:
            busy = self._writing.intersection(blocks)
            if busy:
                raise ValueError(f"blocks: {sorted(busy)[:8]} are being written already (one write per block)")
            if self.dead or self._closing or any(not self.has_block(b) for b in blocks):
                self.stats["writes_refused"] += 1
                return None
            self._pending[req_id] = pending
            self._writing.update(blocks)
        try:
            return self._fenced_write(req_id, pending, blocks, data)
        finally:
            with self._cond:
                self._writing.difference_update(blocks)
                self._cond.notify_all()

    def _fenced_write(self, req_id: int, pending: _Pending, blocks: list[int], data) -> list[BlockRef] | None:
        try:
            self._send({"type": "WRITE_BEGIN", "req_id": req_id, "blocks": blocks})
        except (OSError, ConnectionError):
            with self._cond:
                self._pending.pop(req_id, None)
            return None
        with self._cond:
            self._cond.wait_for(lambda: pending.reply is not None or self.dead, self.write_timeout)
            reply = pending.reply
            if reply is None:
                # stays in _pending: a late WRITE_OK is ended (WRITE_END) by the receiving thread
                pending.abandoned = True
                self.stats["writes_refused"] += 1
                return None
            self._pending.pop(req_id, None)
            if reply["type"] != "WRITE_OK":
                self.stats["writes_refused"] += 1
                return None
            # WRITE_OK registered the fence (receiver thread) before waking us
            for b in blocks:
                self._lver[b] += 1  # odd: being written
        try:
            for b, src in zip(blocks, data):
                dst = self.backend.tensor_view(self.vrange, b * self.block_bytes, self.block_bytes)
                self.copier.copy(dst, src)
            self.copier.fence(dst, data[-1])
        finally:
            with self._cond:
                for b in blocks:
                    self._lver[b] += 1
                self._fenced.subtract(blocks)
                self._fenced += Counter()  # drop zero counts
                refs = [BlockRef(self.peer, b, g, self._lver[b]) for b, g in zip(blocks, reply["gens"])]
                self._trim()
                self._cond.notify_all()
            try:
                self._send({"type": "WRITE_END", "req_id": req_id, "blocks": blocks})
            except (OSError, ConnectionError):
                pass
        self.stats["blocks_written"] += len(blocks)
        return refs

    # ------------------------------------------------------------------ internals
    def _send(self, msg: dict) -> None:
        with self._send_lock:
            wire.send(self.sock, msg)

    def _hung_up(self) -> bool:
        poller = select.poll()  # one per call: poll objects are not thread-safe
        poller.register(self.sock.fileno(), _HUP)
        return any(ev & _HUP for _, ev in poller.poll(0))

    def _busy(self, unit: int) -> bool:
        blocks = blocks_touching(unit * self.unit_bytes, (unit + 1) * self.unit_bytes, self.block_bytes)
        return any(self._fenced.get(b) or self._reading.get(b) for b in blocks)

    def _trim(self) -> None:
        """Unmap revoked units from the tail, stopping at one a read or write still uses (cond held)."""
        while self.mapped_units > self.units:
            unit = self.mapped_units - 1
            if self._busy(unit):
                return
            first = unit * self.unit_chunks
            for slot in range(first, len(self._chunks)):
                self.backend.unmap(self.vrange, slot * self.chunk_bytes)
            for chunk in self._chunks[first:]:
                self.backend.destroy_chunk(chunk)
            del self._chunks[first:]

    def _run(self) -> None:
        try:
            while True:
                got = wire.recv(self.sock)
                if got is None:
                    break
                self._handle(*got)
        except (OSError, ConnectionError):
            pass
        except ValueError as exc:
            log.warning("peer link %s: bad message from the donor: %s", self.socket_path, exc)
        finally:
            self._teardown()

    def _handle(self, msg: dict, fds: list[int]) -> None:
        kind = msg["type"]
        if kind == "GROW":
            self._grow(msg, fds)
        elif kind == "REVOKE":
            with self._cond:
                old = self.num_blocks
                self.units = min(self.units, msg["units"])
                revoked = range(self.num_blocks, old)
            self.stats["revoked_blocks"] += len(revoked)
            if revoked and self.on_revoke is not None:
                self.on_revoke(self, revoked)
            with self._cond:
                self._trim()
        elif kind in ("WRITE_OK", "WRITE_DENIED"):
            late_end = None
            with self._cond:
                pending = self._pending.get(msg["req_id"])
                if pending is None:
                    raise ValueError(f"req_id: {msg['req_id']} answers no write of this link")
                if pending.abandoned:
                    del self._pending[msg["req_id"]]
                    if kind == "WRITE_OK":
                        late_end = pending.blocks
                elif kind == "WRITE_OK":
                    if len(msg["gens"]) != len(pending.blocks):
                        raise ValueError(f"gens: {len(msg['gens'])} for {len(pending.blocks)} blocks")
                    self._fenced.update(pending.blocks)
                    pending.reply = msg
                else:
                    pending.reply = msg
                self._cond.notify_all()
            if late_end is not None:
                self._send({"type": "WRITE_END", "req_id": msg["req_id"], "blocks": late_end})
        else:
            raise ValueError(f"type: unexpected {kind} from a donor")

    def _grow(self, msg: dict, fds: list[int]) -> None:
        imported: list[PhysicalChunk] = []
        try:
            if msg["units"] * self.unit_chunks != len(msg["chunks"]):
                raise ValueError(f"chunks: {len(msg['chunks'])} chunks for {msg['units']} units")
            for fd, cid in zip(fds, msg["chunks"]):
                imported.append(self.backend.import_chunk(fd, self.chunk_bytes, source_id=cid))
        except BaseException:
            for c in imported:
                self.backend.destroy_chunk(c)
            raise
        finally:
            wire.close_fds(fds)
        with self._cond:
            self._trim()
            self._cond.wait_for(lambda: self.mapped_units == self.units or self.dead)
            if msg["first_unit"] != self.units or self.mapped_units != self.units:
                for c in imported:
                    self.backend.destroy_chunk(c)
                raise ValueError(f"first_unit: GROW at unit {msg['first_unit']}, the lease has {self.units} units")
            if self.units + msg["units"] > self.max_units:
                for c in imported:
                    self.backend.destroy_chunk(c)
                raise ValueError(f"units: GROW past max_units {self.max_units}")
            first = len(self._chunks)
            for i, chunk in enumerate(imported):
                self.backend.map(self.vrange, (first + i) * self.chunk_bytes, chunk)
            self._chunks.extend(imported)
            old = self.num_blocks
            self.units += msg["units"]
            grown = range(old, self.num_blocks)
        self.stats["grown_blocks"] += len(grown)
        if self.on_grow is not None:
            self.on_grow(self, grown)

    def _teardown(self) -> None:
        with self._cond:
            if self.closed:
                return
            self.dead = True
            self.units = 0
            self._cond.notify_all()
        if self.on_dead is not None:
            try:
                self.on_dead(self)
            except Exception:  # noqa: BLE001 - a callback must not stop the cleanup
                log.exception("peer link %s: on_dead failed", self.socket_path)
        with self._cond:
            self._cond.wait_for(lambda: not +self._reading and not +self._fenced)
            try:
                self._trim()
                self.backend.release(self.vrange)
            except (ValueError, RuntimeError) as exc:  # the backend was closed under us: nothing left to free
                log.warning("peer link %s: cleanup after the backend closed: %s", self.socket_path, exc)
            self.generations.close()
            self.sock.close()
            self.closed = True  # last: everything of the donor's is gone when this is seen
            self._cond.notify_all()

    def close(self) -> None:
        """Leave the lease: no new write starts, the writes in flight finish (the donor reuses the
        memory as soon as the connection closes), then everything is unmapped and released."""
        with self._cond:
            self._closing = True
            self._cond.wait_for(lambda: not self._writing, self.write_timeout + 5)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
