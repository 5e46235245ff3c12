"""The virtual-memory layer's interface: ranges, chunks, slots, aliases, views.

Model
-----
* A **VirtualRange** is a reserved span of virtual addresses with no memory
  behind it. Its ``base`` and ``size`` are multiples of the backend's
  ``granularity``. It is divided into **slots** of ``granularity`` bytes; a
  slot is named by its byte ``offset`` from ``base``.
* A **PhysicalChunk** is one granularity-sized piece of physical memory
  (host: a memfd; CUDA: a cuMemCreate allocation). It has no address of its
  own; it becomes addressable by being mapped into a slot.
* ``map(range, offset, chunk)`` puts a chunk behind an empty slot;
  ``unmap(range, offset)`` takes it out again and the slot returns to the
  reserved, inaccessible state. The chunk and its bytes survive an unmap.
* A chunk may be mapped into several slots at once (in one range or several):
  these are **aliases** of the same bytes, and a write through one alias is
  visible through every other. This is what makes "map-before-unmap" moves
  possible: map the chunk at its new slot, switch users over, unmap the old
  slot; no byte is copied.
* ``tensor_view`` gives a zero-copy ``torch.Tensor`` over mapped bytes.

Invariants (checked by the base class for every backend)
--------------------------------------------------------
1. Every mapped slot points to a live (not destroyed) chunk owned by this
   backend, and ``mappings_of(chunk)`` lists exactly the slots holding it.
2. A slot holds at most one chunk; mapping into a full slot is refused.
3. A chunk cannot be destroyed while mapped anywhere; a range cannot be
   released while any of its slots is mapped. The error names the offenders.
4. ``chunks_created + chunks_imported - chunks_destroyed == len(live_chunks())``.
5. Offsets passed to map/unmap are multiples of ``granularity`` and lie inside
   the range; violations raise ``ValueError`` naming ``offset`` and the range.
6. A tensor view covers mapped slots only, at the time it is made.

Views after unmap
-----------------
A view is valid only while every slot it covers stays mapped to the chunk it
was mapped to when the view was made. Using a view after one of its slots is
unmapped is **undefined**: on the host backend the slot is PROT_NONE again and
the access kills the process with SIGSEGV; on CUDA it is an illegal-address
fault. Two cheap guards exist: ``check_view(tensor)`` raises if a slot under a
view has been unmapped or remapped since the view was made (each mapping gets
a fresh generation number), and ``unmap(..., strict=True)`` refuses to unmap a
slot while a view made over it is still alive (views are tracked by weakref).
Views *derived* from a view (slices, ``.view()``) are not tracked.

File descriptors
----------------
``export_chunk`` returns a new fd that the caller owns and must close.
``import_chunk(fd, size)`` does not take ownership: it duplicates what it
needs, and the caller still closes ``fd``.

Subclasses implement the ``_os_*`` primitives and ``_make_tensor``; all
bookkeeping, validation, counters and locking live here. Primitives are called
with the backend lock held.
"""

from __future__ import annotations

import abc
import itertools
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a tensor is made: the arbiter process never needs it
    from collections.abc import Sequence

    import torch

    ShapeLike = int | Sequence[int] | torch.Size


@dataclass(frozen=True)
class VirtualRange:
    """A reserved span of virtual addresses: ``[base, base + size)``."""

    range_id: int
    base: int
    size: int
    owner: Any = field(default=None, repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.base + self.size

    def __str__(self) -> str:
        return f"range #{self.range_id} [{self.base:#x}, {self.end:#x})"


@dataclass(frozen=True)
class PhysicalChunk:
    """One granularity-sized physical allocation.

    ``handle_id`` is unique within the backend that owns the chunk (not across
    processes). ``source_id`` is the sender's ``handle_id`` for an imported
    chunk, else None.
    """

    handle_id: int
    size: int
    source_id: int | None = None
    owner: Any = field(default=None, repr=False, compare=False)
    handle: Any = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return f"chunk #{self.handle_id}"


@dataclass
class _Slot:
    chunk: PhysicalChunk
    generation: int
    views: list[weakref.ref] = field(default_factory=list)

    def live_views(self) -> int:
        self.views = [r for r in self.views if r() is not None]
        return len(self.views)


COUNTER_NAMES = (
    "reserve_calls",
    "release_calls",
    "map_calls",
    "unmap_calls",
    "chunks_created",
    "chunks_imported",
    "chunks_destroyed",
    "chunks_exported",
    "views_made",
)

_VIEW_ATTR = "_memx_vmm_slots"


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


class VmmBackend(abc.ABC):
    """Abstract virtual-memory backend. See the module docstring for the model."""

    #: torch device of the tensors ``tensor_view`` returns (set by each backend).
    device: torch.device

    def __init__(self, granularity: int):
        self._granularity = _check_int("granularity", granularity)
        if granularity <= 0:
            raise ValueError(f"granularity must be positive, got {granularity}")
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._ranges: dict[int, VirtualRange] = {}
        self._slots: dict[int, dict[int, _Slot]] = {}
        self._chunks: dict[int, PhysicalChunk] = {}
        self._mappings: dict[int, list[tuple[VirtualRange, int]]] = {}
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._closed = False

    # ------------------------------------------------------------ primitives
    @abc.abstractmethod
    def _os_reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of inaccessible address space aligned to granularity."""

    @abc.abstractmethod
    def _os_release(self, base: int, size: int) -> None:
        """Give a whole reservation back."""

    @abc.abstractmethod
    def _os_create(self) -> Any:
        """Allocate one granularity-sized physical chunk; return its handle."""

    @abc.abstractmethod
    def _os_destroy(self, handle: Any) -> None:
        """Free a chunk handle (it is mapped nowhere)."""

    @abc.abstractmethod
    def _os_map(self, address: int, handle: Any) -> None:
        """Map the chunk read-write at ``address`` (one slot of a reservation)."""

    @abc.abstractmethod
    def _os_unmap(self, address: int) -> None:
        """Return one slot to the reserved, inaccessible state."""

    @abc.abstractmethod
    def _os_export(self, handle: Any) -> int:
        """Return a new fd (owned by the caller) that shares the chunk."""

    @abc.abstractmethod
    def _os_import(self, fd: int, size: int) -> Any:
        """Return a handle to the chunk behind ``fd`` (``fd`` stays the caller's)."""

    @abc.abstractmethod
    def _make_tensor(self, address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D zero-copy tensor of ``nbytes // itemsize`` elements at ``address``."""

    # ---------------------------------------------------------------- basics
    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def map_calls(self) -> int:
        return self._counters["map_calls"]

    @property
    def unmap_calls(self) -> int:
        return self._counters["unmap_calls"]

    def counters(self) -> dict[str, int]:
        """A copy of the call/chunk counters (for benchmarks)."""
        with self._lock:
            return dict(self._counters)

    def round_up(self, size: int) -> int:
        return -(-size // self._granularity) * self._granularity

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _check_range(self, vrange: VirtualRange) -> VirtualRange:
        if not isinstance(vrange, VirtualRange):
            raise TypeError(f"range must be a VirtualRange, got {type(vrange).__name__}")
        if vrange.owner is not self:
            raise ValueError(f"range: {vrange} belongs to another backend")
        if vrange.range_id not in self._ranges:
            raise ValueError(f"range: {vrange} has been released")
        return vrange

    def _check_chunk(self, chunk: PhysicalChunk) -> PhysicalChunk:
        if not isinstance(chunk, PhysicalChunk):
            raise TypeError(f"chunk must be a PhysicalChunk, got {type(chunk).__name__}")
        if chunk.owner is not self:
            raise ValueError(f"chunk: {chunk} belongs to another backend")
        if chunk.handle_id not in self._chunks:
            raise ValueError(f"chunk: {chunk} has been destroyed")
        return chunk

    def _check_offset(self, vrange: VirtualRange, offset: int) -> int:
        _check_int("offset", offset)
        g = self._granularity
        if offset % g:
            raise ValueError(f"offset {offset:#x} is not a multiple of granularity {g:#x} in {vrange}")
        if offset < 0 or offset + g > vrange.size:
            raise ValueError(f"offset {offset:#x} is outside {vrange} (size {vrange.size:#x})")
        return offset

    # ---------------------------------------------------------------- ranges
    def reserve(self, size: int) -> VirtualRange:
        """Reserve ``size`` bytes (rounded up to granularity) of address space."""
        _check_int("size", size)
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        size = self.round_up(size)
        with self._lock:
            self._check_open()
            base = self._os_reserve(size)
            vrange = VirtualRange(next(self._ids), base, size, owner=self)
            self._ranges[vrange.range_id] = vrange
            self._slots[vrange.range_id] = {}
            self._counters["reserve_calls"] += 1
            return vrange

    def release(self, vrange: VirtualRange) -> None:
        """Give a range back. Refused while any slot is mapped (the error names them)."""
        with self._lock:
            self._check_range(vrange)
            slots = self._slots[vrange.range_id]
            if slots:
                held = ", ".join(f"offset {o:#x} -> {s.chunk}" for o, s in sorted(slots.items()))
                raise ValueError(f"cannot release {vrange}: mapped slots remain: {held}")
            self._os_release(vrange.base, vrange.size)
            del self._ranges[vrange.range_id], self._slots[vrange.range_id]
            self._counters["release_calls"] += 1

    def ranges(self) -> list[VirtualRange]:
        with self._lock:
            return list(self._ranges.values())

    # ---------------------------------------------------------------- chunks
    def create_chunk(self) -> PhysicalChunk:
        """Allocate one granularity-sized physical chunk."""
        with self._lock:
            self._check_open()
            handle = self._os_create()
            chunk = PhysicalChunk(next(self._ids), self._granularity, owner=self, handle=handle)
            self._register_chunk(chunk)
            self._counters["chunks_created"] += 1
            return chunk

    def _register_chunk(self, chunk: PhysicalChunk) -> None:
        self._chunks[chunk.handle_id] = chunk
        self._mappings[chunk.handle_id] = []

    def destroy_chunk(self, chunk: PhysicalChunk) -> None:
        """Free a chunk. Refused while it is mapped anywhere (the error names where)."""
        with self._lock:
            self._check_chunk(chunk)
            where = self._mappings[chunk.handle_id]
            if where:
                at = ", ".join(f"{r} offset {o:#x}" for r, o in where)
                raise ValueError(f"cannot destroy {chunk}: still mapped at {at}")
            self._os_destroy(chunk.handle)
            del self._chunks[chunk.handle_id], self._mappings[chunk.handle_id]
            self._counters["chunks_destroyed"] += 1

    def live_chunks(self) -> list[PhysicalChunk]:
        with self._lock:
            return list(self._chunks.values())

    def export_chunk(self, chunk: PhysicalChunk) -> int:
        """A new fd sharing the chunk's memory; the caller owns it and must close it."""
        with self._lock:
            self._check_chunk(chunk)
            fd = self._os_export(chunk.handle)
            self._counters["chunks_exported"] += 1
            return fd

    def import_chunk(self, fd: int, size: int, *, source_id: int | None = None) -> PhysicalChunk:
        """Adopt a chunk exported by another backend (maybe in another process).

        ``size`` must equal this backend's granularity. ``fd`` is not consumed:
        the caller still closes it.
        """
        _check_int("fd", fd)
        _check_int("size", size)
        if size != self._granularity:
            raise ValueError(f"size {size} of the imported chunk differs from granularity {self._granularity}")
        with self._lock:
            self._check_open()
            handle = self._os_import(fd, size)
            chunk = PhysicalChunk(next(self._ids), size, source_id=source_id, owner=self, handle=handle)
            self._register_chunk(chunk)
            self._counters["chunks_imported"] += 1
            return chunk

    # --------------------------------------------------------------- mapping
    def map(self, vrange: VirtualRange, offset: int, chunk: PhysicalChunk) -> int:
        """Map ``chunk`` into the empty slot at ``offset``; return the slot's address."""
        with self._lock:
            self._check_range(vrange)
            self._check_chunk(chunk)
            self._check_offset(vrange, offset)
            slots = self._slots[vrange.range_id]
            if offset in slots:
                raise ValueError(
                    f"offset {offset:#x} in {vrange} is already mapped to {slots[offset].chunk}; unmap it first"
                )
            address = vrange.base + offset
            self._os_map(address, chunk.handle)
            slots[offset] = _Slot(chunk, next(self._generations))
            self._mappings[chunk.handle_id].append((vrange, offset))
            self._counters["map_calls"] += 1
            return address

    def unmap(self, vrange: VirtualRange, offset: int, *, strict: bool = False) -> PhysicalChunk:
        """Empty the slot at ``offset`` and return the chunk that was there.

        With ``strict=True`` the unmap is refused while a view made by
        ``tensor_view`` over this slot is still alive.
        """
        with self._lock:
            self._check_range(vrange)
            self._check_offset(vrange, offset)
            slots = self._slots[vrange.range_id]
            slot = slots.get(offset)
            if slot is None:
                raise ValueError(f"offset {offset:#x} in {vrange} is not mapped")
            if strict and slot.live_views():
                raise ValueError(
                    f"offset {offset:#x} in {vrange}: {slot.live_views()} live tensor view(s) still cover it"
                )
            self._os_unmap(vrange.base + offset)
            del slots[offset]
            self._mappings[slot.chunk.handle_id].remove((vrange, offset))
            self._counters["unmap_calls"] += 1
            return slot.chunk

    def mapped_slots(self, vrange: VirtualRange) -> dict[int, PhysicalChunk]:
        """``{offset: chunk}`` for every mapped slot of the range, by offset."""
        with self._lock:
            self._check_range(vrange)
            return {o: s.chunk for o, s in sorted(self._slots[vrange.range_id].items())}

    def mappings_of(self, chunk: PhysicalChunk) -> list[tuple[VirtualRange, int]]:
        """Every ``(range, offset)`` the chunk is mapped at."""
        with self._lock:
            self._check_chunk(chunk)
            return list(self._mappings[chunk.handle_id])

    # ----------------------------------------------------------------- views
    def tensor_view(
        self, vrange: VirtualRange, offset: int, nbytes_or_shape: ShapeLike, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A zero-copy tensor over ``[base + offset, base + offset + nbytes)``.

        ``nbytes_or_shape``: an int is a byte count (1-D result); a sequence is
        a shape. ``offset`` need not be slot-aligned but must be a multiple of
        the dtype's item size. Every slot touched must be mapped.
        """
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if isinstance(nbytes_or_shape, int) and not isinstance(nbytes_or_shape, bool):
            nbytes, shape = nbytes_or_shape, None
            if nbytes % itemsize:
                raise ValueError(f"nbytes {nbytes} is not a multiple of the {dtype} item size {itemsize}")
        else:
            shape = tuple(_check_int("shape", d) for d in nbytes_or_shape)
            if any(d < 0 for d in shape):
                raise ValueError(f"shape {shape} has a negative dimension")
            nbytes = math.prod(shape) * itemsize
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        _check_int("offset", offset)
        if offset % itemsize:
            raise ValueError(f"offset {offset:#x} is not a multiple of the {dtype} item size {itemsize}")
        with self._lock:
            self._check_range(vrange)
            if offset < 0 or offset + nbytes > vrange.size:
                raise ValueError(f"offset {offset:#x} + nbytes {nbytes:#x} is outside {vrange}")
            if nbytes == 0:
                return torch.empty(shape if shape is not None else 0, dtype=dtype, device=self.device)
            g = self._granularity
            slots = self._slots[vrange.range_id]
            covered = []
            for slot_off in range(offset - offset % g, offset + nbytes, g):
                slot = slots.get(slot_off)
                if slot is None:
                    raise ValueError(f"offset {slot_off:#x} in {vrange} is not mapped (needed by the view)")
                covered.append((slot_off, slot))
            tensor = self._make_tensor(vrange.base + offset, nbytes, dtype)
            if shape is not None:
                tensor = tensor.view(shape)
            ref = weakref.ref(tensor)
            for _, slot in covered:
                if len(slot.views) >= 64:  # keep the weakref list bounded
                    slot.live_views()
                slot.views.append(ref)
            setattr(tensor, _VIEW_ATTR, (vrange, tuple((o, s.generation) for o, s in covered)))
            self._counters["views_made"] += 1
            return tensor

    def check_view(self, tensor: torch.Tensor) -> None:
        """Raise ValueError if a slot under this view was unmapped or remapped since it was made."""
        info = getattr(tensor, _VIEW_ATTR, None)
        if info is None:
            raise ValueError("tensor was not made by tensor_view (derived views are not tracked)")
        vrange, covered = info
        with self._lock:
            if vrange.owner is not self or vrange.range_id not in self._ranges:
                raise ValueError(f"view is stale: {vrange} has been released")
            slots = self._slots[vrange.range_id]
            for offset, generation in covered:
                slot = slots.get(offset)
                if slot is None or slot.generation != generation:
                    raise ValueError(f"view is stale: offset {offset:#x} in {vrange} was unmapped since it was made")

    def live_views(self, vrange: VirtualRange, offset: int) -> int:
        """How many views made by ``tensor_view`` over this slot are still alive."""
        with self._lock:
            self._check_range(vrange)
            slot = self._slots[vrange.range_id].get(self._check_offset(vrange, offset))
            return slot.live_views() if slot else 0

    # --------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Unmap everything, release every range, destroy every chunk. Idempotent.

        Any view still in use afterwards is invalid (see the module docstring).
        """
        with self._lock:
            if self._closed:
                return
            for vrange in list(self._ranges.values()):
                for offset in list(self._slots[vrange.range_id]):
                    self.unmap(vrange, offset)
                self.release(vrange)
            for chunk in list(self._chunks.values()):
                self.destroy_chunk(chunk)
            self._closed = True

    def __enter__(self) -> VmmBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
