"""The donor's donated region: block-major KV space for one borrower, backed by pool chunks.

The region is one reserved virtual range; block ``b`` is the bytes
``[b * block_bytes, (b + 1) * block_bytes)``. It grows and shrinks only at its tail and only by
whole *units* of ``unit_chunks`` pool chunks, so a resize is ``unit_chunks`` map/unmap calls plus
ledger moves: no byte is copied, no other block moves (block-major, SwiftCache §3.4).

The unit is the donor's choice:

* ``unit_chunks=1`` (default): the pool's own unit. A block may straddle two chunks; the region
  holds the *complete* blocks of its mapped chunks (``blocks_in``), so at most one block's worth
  of the last chunk is unused.
* ``exact_unit_chunks(block_bytes, chunk_bytes)``: ``lcm(block_bytes, chunk_bytes)`` bytes, the
  chunk-aligned minimum elastic unit of Eq. 6-9: units hold whole blocks and nothing is unused,
  but a unit can be large (e.g. 45 chunks of 2 MiB for 360 KiB blocks).

Chunks are owned by ``Owner.PEER_DONATION`` in the donor's ``ChunkPool`` from ``grow`` until
``release_tail`` hands them back (to FREE, or transferred to another owner such as KV).

Two-step shrink (the reclaim protocol of ``donor``):
1. ``revoke_tail(units)``: the last ``units`` units stop being part of the region *at once*;
   the generations of the blocks that stop being complete are bumped before this returns, so any
   borrower read of them that completes afterwards fails validation. Their chunks stay mapped
   (``physical_units`` >= ``units``).
2. ``release_tail(...)``: unmaps and hands back the revoked units from the tail, skipping
   none: a unit with a block still fenced by a borrower's in-flight write stops the release there.

Invariants: ``units <= physical_units <= max_units``; the mapped slots are exactly the
first ``physical_units * unit_chunks`` slots; every mapped chunk is PEER_DONATION's; the blocks
a borrower may use are ``range(num_blocks)``, all complete in mapped, unrevoked units.
Not thread-safe: the donor serialises calls under its lease lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..policy._checks import check_int
from ..pool.ownership import ChunkPool, Owner
from ..vmm.base import PhysicalChunk
from .generations import GenerationTable


def exact_unit_chunks(block_bytes: int, chunk_bytes: int) -> int:
    """Chunks of the smallest unit holding whole blocks: ``lcm(block_bytes, chunk_bytes) / chunk_bytes``."""
    check_int("block_bytes", block_bytes, minimum=1)
    check_int("chunk_bytes", chunk_bytes, minimum=1)
    return math.lcm(block_bytes, chunk_bytes) // chunk_bytes


def blocks_in(nbytes: int, block_bytes: int) -> int:
    """Complete blocks in the first ``nbytes`` bytes of a region."""
    return nbytes // block_bytes


def blocks_touching(first_byte: int, end_byte: int, block_bytes: int) -> range:
    """Blocks that have at least one byte in ``[first_byte, end_byte)``."""
    return range(first_byte // block_bytes, -(-end_byte // block_bytes))


class DonatedRegion:
    def __init__(
        self,
        pool: ChunkPool,
        block_bytes: int,
        max_units: int,
        *,
        unit_chunks: int = 1,
        name: str = "memx-peer",
    ):
        if not isinstance(pool, ChunkPool):
            raise ValueError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        self.pool = pool
        self.backend = pool.backend
        self.block_bytes = check_int("block_bytes", block_bytes, minimum=1)
        self.max_units = check_int("max_units", max_units, minimum=1)
        self.unit_chunks = check_int("unit_chunks", unit_chunks, minimum=1)
        self.chunk_bytes = pool.chunk_bytes
        self.unit_bytes = self.unit_chunks * self.chunk_bytes
        self.max_blocks = blocks_in(max_units * self.unit_bytes, block_bytes)
        if self.max_blocks < 1:
            raise ValueError(
                f"max_units: {max_units} unit(s) of {self.unit_bytes} bytes hold no {block_bytes}-byte block"
            )
        self.vrange = self.backend.reserve(max_units * self.unit_bytes)
        self.generations = GenerationTable.create(self.max_blocks, name=f"{name}-gen")
        self._chunks: list[PhysicalChunk] = []  # slot order
        self.units = 0  # logical: blocks [0, num_blocks) belong to the borrower
        self.closed = False

    # ------------------------------------------------------------------ info
    @property
    def num_blocks(self) -> int:
        return blocks_in(self.units * self.unit_bytes, self.block_bytes)

    @property
    def physical_units(self) -> int:
        return len(self._chunks) // self.unit_chunks

    @property
    def chunks(self) -> list[PhysicalChunk]:
        return list(self._chunks)

    def blocks_of_unit(self, unit: int) -> range:
        """Blocks with a byte in unit ``unit`` (a straddling block belongs to both of its units)."""
        touching = blocks_touching(unit * self.unit_bytes, (unit + 1) * self.unit_bytes, self.block_bytes)
        return range(touching.start, min(touching.stop, self.max_blocks))

    def view(self, block: int):
        """The donor's own uint8 view of one block (for the donor's use after a reclaim, or tests)."""
        check_int("block", block)
        mapped = blocks_in(self.physical_units * self.unit_bytes, self.block_bytes)
        if block >= mapped:
            raise ValueError(f"block {block} is not mapped (complete mapped blocks: {mapped})")
        return self.backend.tensor_view(self.vrange, block * self.block_bytes, self.block_bytes)

    # --------------------------------------------------------------- resizing
    def grow(self, units: int) -> list[PhysicalChunk]:
        """Append ``units`` units (acquired as PEER_DONATION, mapped); all or nothing.

        Only when no revoked unit is still mapped (``physical_units == units``).
        """
        check_int("units", units, minimum=1)
        if self.closed:
            raise RuntimeError("region is closed")
        if self.physical_units != self.units:
            raise ValueError(
                f"units: {self.physical_units - self.units} revoked unit(s) are still mapped; release_tail first"
            )
        if self.units + units > self.max_units:
            raise ValueError(f"units: growing by {units} would exceed max_units {self.max_units} (have {self.units})")
        chunks = self.pool.acquire(Owner.PEER_DONATION, units * self.unit_chunks)
        first = len(self._chunks)
        done = 0
        try:
            for i, chunk in enumerate(chunks):
                self.backend.map(self.vrange, (first + i) * self.chunk_bytes, chunk)
                done += 1
        except BaseException:
            for i in range(done):
                self.backend.unmap(self.vrange, (first + i) * self.chunk_bytes)
            self.pool.release(Owner.PEER_DONATION, chunks)
            raise
        self._chunks.extend(chunks)
        self.units += units
        return chunks

    def revoke_tail(self, units: int) -> range:
        """Step 1 of a shrink: take the last ``units`` units back logically; bump their generations.

        Returns the revoked block range. At most ``self.units`` units are revoked.
        """
        check_int("units", units)
        units = min(units, self.units)
        before = self.num_blocks
        self.units -= units
        blocks = range(self.num_blocks, before)
        self.generations.bump(blocks)
        return blocks

    def release_tail(
        self, to: Owner = Owner.FREE, *, fenced: Callable[[range], bool] | None = None
    ) -> list[PhysicalChunk]:
        """Step 2: unmap revoked units from the tail and give their chunks to ``to``.

        Stops at the first unit (from the tail) whose blocks ``fenced(blocks)`` says are still
        being written. Returns the chunks handed back (unmapped; FREE, or now owned by ``to``).
        """
        if not isinstance(to, Owner):
            raise ValueError(f"to must be an Owner, got {to!r}")
        out: list[PhysicalChunk] = []
        while self.physical_units > self.units:
            unit = self.physical_units - 1
            if fenced is not None and fenced(self.blocks_of_unit(unit)):
                break
            first_slot = unit * self.unit_chunks
            chunks = self._chunks[first_slot:]
            for slot in range(first_slot, first_slot + len(chunks)):
                self.backend.unmap(self.vrange, slot * self.chunk_bytes)
            del self._chunks[first_slot:]
            if to is Owner.FREE:
                self.pool.release(Owner.PEER_DONATION, chunks)
            else:
                self.pool.transfer(chunks, Owner.PEER_DONATION, to)
            out.extend(chunks)
        return out

    def close(self) -> None:
        """Revoke and release everything, give the range and the generation table back."""
        if self.closed:
            return
        self.revoke_tail(self.units)
        self.release_tail()
        self.backend.release(self.vrange)
        self.generations.close()
        self.closed = True
