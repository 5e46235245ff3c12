"""ActivationETensor: a chunk-granular arena for activations that keeps freed memory mapped.

Model
-----
One virtual range of ``max_bytes`` (rounded up to chunks) is divided into
chunk-sized slots. ``alloc(nbytes)`` rounds up to whole slots and places the
block by **best fit** over the free extents of the range (the smallest free
extent that fits; ties go to the lowest address), at the start of that
extent. Slots of the block that are not mapped yet get ACTIVATION chunks from
the ``ChunkPool`` (all or nothing: on ``PoolExhausted`` or a map failure
nothing changes). ``free(block)`` returns the slots to the free extents and
**coalesces** them with free neighbours, but the slots **stay mapped**: the
next ``alloc`` that lands there costs no map call and no pool traffic.

``shrink(n)`` is the lazy deflation primitive: it unmaps up to ``n`` idle
mapped slots (mapped, not in any block), highest address first, and returns
their chunks to FREE. How many, and when, is the caller's policy.

A block's address never changes while it is allocated; ``tensor(block)``
gives a zero-copy view of it, valid until the block is freed and its slots
are shrunk away.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .ownership import ChunkPool, Owner
from .slots import PooledSlots, SlotBackedTensor


@dataclass(frozen=True)
class ActivationBlock:
    """An allocated run of ``num_slots`` slots starting at ``start_slot``."""

    start_slot: int
    num_slots: int
    nbytes: int
    offset: int
    block_id: int = field(default=0, compare=False)


class ActivationETensor(SlotBackedTensor):
    """Best-fit, coalescing, lazily deflated arena. See the module docstring."""

    def __init__(self, pool: ChunkPool, max_bytes: int, owner: Owner = Owner.ACTIVATION):
        if not isinstance(pool, ChunkPool):
            raise TypeError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int, got {type(max_bytes).__name__}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not isinstance(owner, Owner) or owner is Owner.FREE:
            raise ValueError(f"owner must be an Owner other than FREE, got {owner!r}")
        self._pool = pool
        self._backend = pool.backend
        self._owner = owner
        self._chunk_bytes = pool.chunk_bytes
        self._num_slots = -(-max_bytes // self._chunk_bytes)
        self._slots = PooledSlots(pool, owner, self._num_slots)
        self._range = self._slots.vrange
        self._lock = threading.RLock()
        self._free: dict[int, int] = {0: self._num_slots}  # start -> length of each free extent
        self._free_end: dict[int, int] = {self._num_slots: 0}  # end -> start
        self._blocks: dict[int, ActivationBlock] = {}  # start -> live block
        self._mapped = self._slots.mapped  # slot -> chunk (owned by _slots)
        self._ids = itertools.count(1)
        self._closed = False

    # ----------------------------------------------------------------- info

    @property
    def allocated_slots(self) -> int:
        with self._lock:
            return sum(b.num_slots for b in self._blocks.values())

    @property
    def idle_mapped_chunks(self) -> int:
        """Mapped slots that no block uses (what ``shrink`` can give back)."""
        with self._lock:
            return len(self._mapped) - sum(
                1
                for b in self._blocks.values()
                for s in range(b.start_slot, b.start_slot + b.num_slots)
                if s in self._mapped
            )

    def free_extents(self) -> list[tuple[int, int]]:
        """``(start_slot, num_slots)`` of every free extent, by address."""
        with self._lock:
            return sorted(self._free.items())

    # ------------------------------------------------------------ extents
    def _take_extent(self, start: int, length: int, n: int) -> None:
        del self._free[start], self._free_end[start + length]
        if length > n:
            self._free[start + n] = length - n
            self._free_end[start + length] = start + n

    def _put_extent(self, start: int, length: int) -> None:
        end = start + length
        before = self._free_end.pop(start, None)  # a free extent ending where this one starts
        if before is not None:
            del self._free[before]
            start = before
        after = self._free.pop(end, None)  # a free extent starting where this one ends
        if after is not None:
            del self._free_end[end + after]
            end += after
        self._free[start] = end - start
        self._free_end[end] = start

    # ------------------------------------------------------------ mutations
    def alloc(self, nbytes: int) -> ActivationBlock:
        """Place a block of ``nbytes`` (rounded up to chunks) by best fit; map what it needs."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        n = -(-nbytes // self._chunk_bytes)
        with self._lock:
            self._check_open()
            best: tuple[int, int] | None = None
            for start, length in self._free.items():
                if length >= n and (best is None or (length, start) < (best[1], best[0])):
                    best = (start, length)
            if best is None:
                largest = max(self._free.values(), default=0)
                raise ValueError(
                    f"nbytes {nbytes} needs {n} contiguous slot(s); the largest free extent "
                    f"has {largest} (of {self._num_slots})"
                )
            start, length = best
            self._slots.map_slots(range(start, start + n))
            self._take_extent(start, length, n)
            block = ActivationBlock(start, n, nbytes, start * self._chunk_bytes, next(self._ids))
            self._blocks[start] = block
            return block

    def free(self, block: ActivationBlock) -> None:
        """Return a block's slots to the free extents (coalesced); they stay mapped."""
        with self._lock:
            self._check_open()
            live = self._blocks.get(getattr(block, "start_slot", None))
            if live is None or live.block_id != block.block_id:
                raise ValueError(f"block {block} is not allocated here (freed twice?)")
            del self._blocks[block.start_slot]
            self._put_extent(block.start_slot, block.num_slots)

    def shrink(self, n: int | None = None) -> int:
        """Unmap up to ``n`` (default: all) idle mapped slots, highest first; release their chunks."""
        with self._lock:
            self._check_open()
            idle = sorted(
                (s for start, length in self._free.items() for s in range(start, start + length) if s in self._mapped),
                reverse=True,
            )
            if n is not None:
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"n must be a non-negative int, got {n!r}")
                idle = idle[:n]
            return self._slots.unmap_slots(idle)

    def tensor(
        self, block: ActivationBlock, dtype: torch.dtype = torch.uint8, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """A zero-copy view of an allocated block: ``nbytes`` bytes (1-D) or ``shape``."""
        with self._lock:
            self._check_open()
            live = self._blocks.get(block.start_slot)
            if live is None or live.block_id != block.block_id:
                raise ValueError(f"block {block} is not allocated here")
            spec = block.nbytes if shape is None else tuple(shape)
            return self._backend.tensor_view(self._range, block.offset, spec, dtype)

    # ------------------------------------------------------------ lifecycle
    def check_invariants(self) -> None:
        with self._lock:
            cover = [None] * self._num_slots
            for start, length in self._free.items():
                if self._free_end.get(start + length) != start:
                    raise AssertionError(f"free extent ({start}, {length}) missing from the end index")
                for s in range(start, start + length):
                    if cover[s] is not None:
                        raise AssertionError(f"slot {s} is in two extents")
                    cover[s] = "free"
                if start + length in self._free:
                    raise AssertionError(f"free extents at {start} and {start + length} are not coalesced")
            if len(self._free_end) != len(self._free):
                raise AssertionError("end index has stale entries")
            for start, b in self._blocks.items():
                for s in range(start, start + b.num_slots):
                    if cover[s] is not None:
                        raise AssertionError(f"slot {s} is in a block and in another extent")
                    if s not in self._mapped:
                        raise AssertionError(f"slot {s} of a live block is not mapped")
                    cover[s] = "block"
            if None in cover:
                raise AssertionError(f"slot {cover.index(None)} is neither free nor allocated")
            if self._closed:
                return
            self._slots.check_invariants()

    def close(self) -> None:
        """Unmap everything, release the chunks and the range (live blocks become invalid). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._slots.close()
            self._blocks.clear()
            self._free, self._free_end = {0: self._num_slots}, {self._num_slots: 0}
            self._closed = True

    def __enter__(self) -> ActivationETensor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
