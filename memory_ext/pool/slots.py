"""A reserved virtual range cut into chunk-sized slots, backed on demand from a ChunkPool.

Both eTensors (KV and activation) are built on this: they decide *which*
slots must be backed; ``PooledSlots`` acquires, maps, unmaps and releases.

Invariants:
* ``mapped`` (slot -> chunk) equals the backend's mappings of ``vrange``;
* every chunk in ``mapped`` is owned by ``owner`` in the pool;
* ``map_slots`` is all-or-nothing: on any failure nothing stays mapped or acquired.
Not locked: the owning eTensor serialises calls under its own lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..vmm import PhysicalChunk
from .ownership import ChunkPool, Owner


class PooledSlots:
    def __init__(self, pool: ChunkPool, owner: Owner, num_slots: int):
        self.pool = pool
        self.owner = owner
        self.backend = pool.backend
        self.chunk_bytes = pool.chunk_bytes
        self.num_slots = num_slots
        self.vrange = self.backend.reserve(num_slots * self.chunk_bytes)
        self.mapped: dict[int, PhysicalChunk] = {}

    def offset(self, slot: int) -> int:
        return slot * self.chunk_bytes

    def map_slots(self, slots: Iterable[int]) -> int:
        """Back every listed slot that is not mapped yet; return how many were mapped."""
        needed = sorted(set(slots) - self.mapped.keys())
        if not needed:
            return 0
        chunks = self.pool.acquire(self.owner, len(needed))
        done: list[int] = []
        try:
            for slot, chunk in zip(needed, chunks):
                self.backend.map(self.vrange, self.offset(slot), chunk)
                done.append(slot)
        except BaseException:
            for slot in done:
                self.backend.unmap(self.vrange, self.offset(slot))
            self.pool.release(self.owner, chunks)
            raise
        self.mapped.update(zip(needed, chunks))
        return len(needed)

    def unmap_slots(self, slots: Iterable[int]) -> int:
        """Unmap the listed (mapped) slots and release their chunks; return how many."""
        slots = list(slots)
        chunks = [self.backend.unmap(self.vrange, self.offset(s)) for s in slots]
        for s in slots:
            del self.mapped[s]
        if chunks:
            self.pool.release(self.owner, chunks)
        return len(chunks)

    def check_invariants(self) -> None:
        actual = self.backend.mapped_slots(self.vrange)
        expect = {self.offset(s): c for s, c in self.mapped.items()}
        if actual.keys() != expect.keys() or any(actual[o] is not c for o, c in expect.items()):
            raise AssertionError(f"backend mappings {sorted(actual)} differ from the slot table {sorted(expect)}")
        for chunk in self.mapped.values():
            if self.pool.owner_of(chunk) is not self.owner:
                raise AssertionError(f"{chunk} is mapped here but owned by {self.pool.owner_of(chunk)}")

    def close(self) -> None:
        """Unmap and release every slot, then release the range."""
        self.unmap_slots(sorted(self.mapped))
        self.backend.release(self.vrange)


class SlotBackedTensor:
    """Accessors shared by the elastic tensors built on one ``PooledSlots`` (``self._slots``)
    and guarded by ``self._lock``; ``self._closed`` marks a closed tensor."""

    _slots: PooledSlots

    @property
    def num_slots(self) -> int:
        return self._slots.num_slots

    @property
    def vrange(self):
        return self._slots.vrange

    @property
    def mapped_chunks(self) -> int:
        """How many slots are mapped (= chunks this tensor holds from the pool)."""
        with self._lock:
            return len(self._slots.mapped)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
