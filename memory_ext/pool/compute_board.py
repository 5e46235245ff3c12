"""A device's compute board: which of its co-located engines has work, in one shared file.

Each engine of a CPU device owns one slot (its place in the launcher's order; the launcher
creates the board before any engine starts) and writes its pid and a busy flag there once
per scheduler iteration; every engine reads all slots to decide which cores it computes on
(``memory_ext.policy.compute_share``). A file mapped shared, not a socket: a write or read
is a few bytes of memory, no process waits on another and nothing needs a server that
could die.

Layout: an 8-byte magic, a little-endian u32 slot count, 4 bytes of padding, then one
16-byte record per slot: i32 pid (0: never written), u8 busy, 3 bytes padding, f64 the
writer's ``time.monotonic()`` when it last published itself busy (0: never; one clock for all
processes of a host): how long a sibling has been idle, read by the lender's quiet rule.

Invariants: a slot is written only by its own engine; a slot whose pid is not a live
process (gone or a zombie) reads as idle once its last busy stamp is ``FRESH_S`` old (an engine
that died, was SIGKILLed or restarted holds cores it cannot use for at most that long); a file of
another layout is refused naming the path.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from memory_ext.proc import pid_alive

__all__ = ["ComputeBoard", "ComputeBoardError", "SlotState"]

_MAGIC = b"MXCB0001"
_HEADER = struct.Struct("<8sI4x")
_SLOT = struct.Struct("<iB3xd")


class ComputeBoardError(ValueError):
    """A board file that cannot be used; the message names the path."""


@dataclass(frozen=True)
class SlotState:
    pid: int
    busy: bool
    stamp: float


class ComputeBoard:
    """One mapped board file of ``slots`` records (``create`` writes it, ``open`` maps and checks it)."""

    FRESH_S = 0.5  # a busy slot stamped this recently needs no /proc read (``states``)

    def __init__(self, path: Path, slots: int, view: mmap.mmap):
        self.path, self.slots, self._view = path, slots, view

    @classmethod
    def create(cls, path: str | os.PathLike, slots: int) -> ComputeBoard:
        """Write a board of ``slots`` empty records at ``path`` (atomically: a reader sees the whole
        file or none) and map it."""
        if not 1 <= slots <= 4096:
            raise ComputeBoardError(f"{path}: slots must be 1..4096, got {slots}")
        p = Path(path)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_bytes(_HEADER.pack(_MAGIC, slots) + bytes(slots * _SLOT.size))
        os.replace(tmp, p)
        return cls.open(p)

    @classmethod
    def open(cls, path: str | os.PathLike) -> ComputeBoard:
        """Map the board at ``path`` (written by ``create``)."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError as e:
            raise ComputeBoardError(f"{p}: cannot open the compute board: {e.strerror or e}") from None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                raise ComputeBoardError(f"{p}: {size} bytes is not a compute board")
            view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, slots = _HEADER.unpack_from(view, 0)
        if magic != _MAGIC or size != _HEADER.size + slots * _SLOT.size:
            view.close()
            raise ComputeBoardError(f"{p}: not a compute board (magic {magic!r}, {slots} slots, {size} bytes)")
        return cls(p, slots, view)

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise ComputeBoardError(f"{self.path}: slot {slot} is not one of {self.slots}")
        return _HEADER.size + slot * _SLOT.size

    def publish(self, slot: int, pid: int, busy: bool, now: float) -> None:
        """The slot's pid and flag; its stamp becomes ``now`` only when ``busy`` (else it keeps
        the time the slot was last busy)."""
        off = self._offset(slot)
        stamp = now if busy else _SLOT.unpack_from(self._view, off)[2]
        _SLOT.pack_into(self._view, off, pid, 1 if busy else 0, stamp)

    def read(self, slot: int) -> SlotState:
        pid, busy, stamp = _SLOT.unpack_from(self._view, self._offset(slot))
        return SlotState(pid, bool(busy), stamp)

    def states(self, own_slot: int | None = None, now: float | None = None) -> list[SlotState]:
        """Every slot, in one pass; a slot without a live writer reads as idle (its stamp kept).
        ``own_slot``: the caller's slot, whose writer is the caller (its liveness is not read from
        /proc: that read was 1-2 % of a tiny model's scheduler iteration). ``now`` (the caller's
        ``time.monotonic()``): a busy slot stamped within ``FRESH_S`` of it was written by a live
        engine that recently, so /proc is read only for a stale busy slot (a sibling in one long
        forward, or dead); a dead sibling reads busy for at most ``FRESH_S``."""
        out = []
        for slot in range(self.slots):
            s = self.read(slot)
            fresh = now is not None and 0.0 <= now - s.stamp < self.FRESH_S
            live = s.busy and (slot == own_slot or fresh or pid_alive(s.pid))
            out.append(s if live == s.busy else SlotState(s.pid, live, s.stamp))
        return out

    def busy_flags(self, own_slot: int | None = None, now: float | None = None) -> list[bool]:
        """Each slot's busy flag (``states``)."""
        return [s.busy for s in self.states(own_slot, now)]

    def close(self) -> None:
        self._view.close()
