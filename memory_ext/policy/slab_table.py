"""FineServe F1: the KV slab table of one GPU (paper section 5.2) and its block numbering.

``SlabTable`` cuts a GPU's KV memory into uniform slabs, each FREE or formatted for one key
(a block format) and then PARTIAL or FULL; engine block ids are
``slab_id * blocks_per_slab + local_id`` (``engine_block_id`` / ``split_engine_block_id``).
Plain numbers in, ids out: nothing here allocates or maps memory; only stdlib is used.

Invariants (``SlabTable.check``): every slab is FREE or held by exactly one key; a key's
used blocks are the sum over its slabs; a FREE slab fits any key (one slab size).
Readings of the paper where it is not explicit are marked "READINGS:".
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence

from ._checks import check_int as _int

__all__ = ["blocks_per_slab", "engine_block_id", "split_engine_block_id", "SlabTable"]


def blocks_per_slab(slab_size: int, block_size: int) -> int:
    """Blocks of ``block_size`` bytes in a slab of ``slab_size`` (which must hold whole blocks)."""
    _int("slab_size", slab_size, 1)
    _int("block_size", block_size, 1)
    if slab_size % block_size:
        raise ValueError(f"slab_size {slab_size} is not a multiple of block_size {block_size}")
    return slab_size // block_size


def engine_block_id(slab_id: int, local_id: int, blocks_per_slab: int) -> int:
    """Blk ID = slab ID x blocks per slab + local blk ID (paper §5.2)."""
    _int("blocks_per_slab", blocks_per_slab, 1)
    _int("slab_id", slab_id, 0)
    _int("local_id", local_id, 0)
    if local_id >= blocks_per_slab:
        raise ValueError(f"local_id {local_id} must be < blocks_per_slab {blocks_per_slab}")
    return slab_id * blocks_per_slab + local_id


def split_engine_block_id(block_id: int, blocks_per_slab: int) -> tuple[int, int]:
    """Inverse of ``engine_block_id``: returns (slab_id, local_id)."""
    _int("blocks_per_slab", blocks_per_slab, 1)
    _int("block_id", block_id, 0)
    return divmod(block_id, blocks_per_slab)


class SlabTable:
    """The KV slab table of one GPU (paper §5.2): ``num_slabs`` uniform slabs
    of ``slab_size`` bytes, each FREE or formatted for one key (a block
    format) and then PARTIAL or FULL.

    ``alloc(key, block_size, n)`` hands out ``n`` engine block ids
    (``engine_block_id(slab, local, slab_size // block_size)``) from the key's
    slabs, carving FREE slabs when those are full; ``free`` takes ids back and
    returns a slab that became empty to FREE (unless ``keep_empty``).
    ``carve`` formats slabs ahead of use (an engine growing its pool before it
    places blocks); ``release_empty`` returns such slabs if still unused.
    ``pin`` keeps a number of a key's slabs formatted even when empty.

    Fragmentation, in the paper's terms: external fragmentation between keys
    cannot arise (every slab has the same size, so any FREE slab fits any
    key); what remains is internal to slabs -- free blocks inside a key's
    PARTIAL slabs, usable by that key only (``stranded_blocks``).

    READINGS: the paper says the key is the KV block size, so models with the
    same block size may share slabs; callers choose the key (block size, or a
    model name to keep one model per slab). Allocation order is not given:
    the lowest-id non-full slab of the key first, then the lowest-id FREE
    slab; inside a slab the lowest free local id first.
    """

    FREE, PARTIAL, FULL = "FREE", "PARTIAL", "FULL"

    def __init__(self, num_slabs: int, slab_size: int):
        self.num_slabs = _int("num_slabs", num_slabs, 0)
        self.slab_size = _int("slab_size", slab_size, 1)
        self._key: list[Hashable | None] = [None] * num_slabs
        self._used = [0] * num_slabs
        self._free_ids: list[list[int]] = [[] for _ in range(num_slabs)]  # heaps of free local ids
        self._taken: list[bytearray] = [bytearray() for _ in range(num_slabs)]
        self._free_slabs = list(range(num_slabs))  # heap of FREE slab ids
        self._open: dict[Hashable, list[int]] = {}  # key -> heap of non-full slab ids (lazy)
        self._bps: dict[Hashable, int] = {}
        self._held: dict[Hashable, int] = {}
        self._used_blocks: dict[Hashable, int] = {}
        self._pinned: dict[Hashable, int] = {}
        self._empty: dict[Hashable, set[int]] = {}  # formatted slabs holding no block

    # -- queries
    @property
    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def blocks_per_slab(self, key: Hashable) -> int:
        return self._bps[key]

    def held_slabs(self, key: Hashable) -> int:
        return self._held.get(key, 0)

    def used_blocks(self, key: Hashable) -> int:
        return self._used_blocks.get(key, 0)

    def stranded_blocks(self, key: Hashable) -> int:
        """Free blocks inside the key's formatted slabs (usable by that key only)."""
        return self.held_slabs(key) * self._bps.get(key, 0) - self.used_blocks(key)

    def allocatable(self, key: Hashable, block_size: int) -> int:
        """Blocks ``alloc(key, block_size, n)`` could hand out now."""
        bps = self._format(key, block_size, check_only=True)
        return self.stranded_blocks(key) + self.free_slabs * bps

    def state(self, slab_id: int) -> str:
        _int("slab_id", slab_id, 0)
        if slab_id >= self.num_slabs:
            raise ValueError(f"slab_id {slab_id} must be < num_slabs {self.num_slabs}")
        key = self._key[slab_id]
        if key is None:
            return self.FREE
        return self.FULL if self._used[slab_id] == self._bps[key] else self.PARTIAL

    def used_in(self, slab_id: int) -> int:
        """Blocks allocated in slab ``slab_id`` (0 when FREE)."""
        return self._used[slab_id]

    def key_of(self, slab_id: int) -> Hashable | None:
        return self._key[slab_id]

    def keys(self) -> tuple[Hashable, ...]:
        return tuple(self._bps)

    # -- changes
    def _format(self, key: Hashable, block_size: int, check_only: bool = False) -> int:
        bps = self._bps.get(key)
        if bps is not None and bps * block_size == self.slab_size and type(block_size) is int:
            return bps  # fast path: a known key, same block size
        want = blocks_per_slab(self.slab_size, block_size)
        if bps is None:
            if not check_only:
                self._bps[key] = want
                self._open[key] = []
                self._held[key] = 0
                self._used_blocks[key] = 0
                self._pinned[key] = 0
                self._empty[key] = set()
            return want
        if bps != want:
            raise ValueError(f"key {key!r} has block size {self.slab_size // bps}, got {block_size}")
        return bps

    def _carve_one(self, key: Hashable, bps: int) -> int:
        sid = heapq.heappop(self._free_slabs)
        self._key[sid] = key
        self._used[sid] = 0
        self._free_ids[sid] = list(range(bps))  # sorted = a valid heap
        self._taken[sid] = bytearray(bps)
        self._empty[key].add(sid)
        heapq.heappush(self._open[key], sid)
        self._held[key] += 1
        return sid

    def _release(self, sid: int) -> None:
        key = self._key[sid]
        self._key[sid] = None
        self._free_ids[sid] = []
        self._taken[sid] = bytearray()
        self._empty[key].discard(sid)
        self._held[key] -= 1
        heapq.heappush(self._free_slabs, sid)

    def carve(self, key: Hashable, block_size: int, n_slabs: int) -> int:
        """Format up to ``n_slabs`` FREE slabs for ``key``; returns how many."""
        bps = self._format(key, block_size)
        k = min(_int("n_slabs", n_slabs, 0), self.free_slabs)
        for _ in range(k):
            self._carve_one(key, bps)
        return k

    def pin(self, key: Hashable, block_size: int, n_slabs: int) -> int:
        """Keep at least ``n_slabs`` slabs formatted for ``key`` (carving what is
        missing); returns the slabs carved. Raises if the FREE slabs are too few."""
        bps = self._format(key, block_size)
        _int("n_slabs", n_slabs, 0)
        need = max(0, n_slabs - self._held[key])
        if need > self.free_slabs:
            raise ValueError(f"pin {key!r}: {need} slabs needed, {self.free_slabs} free")
        for _ in range(need):
            self._carve_one(key, bps)
        self._pinned[key] = n_slabs
        return need

    def alloc(self, key: Hashable, block_size: int, n: int, carve: bool = True) -> list[int] | None:
        """``n`` engine block ids for ``key``, or None (and no change) if the
        key's slabs (plus FREE slabs when ``carve``) cannot hold them."""
        bps = self._format(key, block_size)
        if type(n) is not int or n < 0:
            _int("n", n, 0)
        room = self.stranded_blocks(key) + (self.free_slabs * bps if carve else 0)
        if n > room:
            return None
        out: list[int] = []
        heap = self._open[key]
        while len(out) < n:
            while heap and (self._key[heap[0]] != key or self._used[heap[0]] == bps):
                heapq.heappop(heap)  # stale: released or full
            sid = heap[0] if heap else self._carve_one(key, bps)
            ids, taken = self._free_ids[sid], self._taken[sid]
            k = min(n - len(out), len(ids))
            for _ in range(k):
                local = heapq.heappop(ids)
                taken[local] = 1
                out.append(sid * bps + local)
            if k and self._used[sid] == 0:
                self._empty[key].discard(sid)
            self._used[sid] += k
            if self._used[sid] == bps:
                heapq.heappop(heap)
        self._used_blocks[key] += n
        return out

    def free(self, key: Hashable, block_ids: Iterable[int], keep_empty: bool = False) -> int:
        """Take back ``block_ids`` of ``key``; a slab left empty goes back to
        FREE unless ``keep_empty`` or pinned slabs would drop below the pin.
        Returns the slabs released."""
        bps = self._bps.get(key)
        if bps is None:
            raise ValueError(f"unknown key {key!r}")
        touched = set()
        n = 0
        for b in block_ids:
            sid, local = split_engine_block_id(b, bps)
            if sid >= self.num_slabs or self._key[sid] != key or not self._taken[sid][local]:
                raise ValueError(f"block {b} is not allocated to {key!r}")
            if self._used[sid] == bps:
                heapq.heappush(self._open[key], sid)
            heapq.heappush(self._free_ids[sid], local)
            self._taken[sid][local] = 0
            self._used[sid] -= 1
            if self._used[sid] == 0:
                self._empty[key].add(sid)
            touched.add(sid)
            n += 1
        self._used_blocks[key] -= n
        if keep_empty:
            return 0
        return self._release_empty(key, sorted(s for s in touched if self._used[s] == 0))

    def _release_empty(self, key: Hashable, sids: Sequence[int]) -> int:
        k = 0
        for sid in reversed(sids):  # highest ids first: low ids stay formatted
            if self._held[key] <= self._pinned[key]:
                break
            self._release(sid)
            k += 1
        return k

    def adopt(self, key: Hashable, block_size: int, slab_id: int, used: int) -> None:
        """Format the FREE slab ``slab_id`` for ``key`` with ``used`` blocks taken
        (local ids ``0 .. used-1``): a snapshot of slabs an engine's own
        allocator already fills, where only the count per slab is known. States,
        ``used_blocks`` and ``stranded_blocks`` then read as for ``alloc``."""
        bps = self._format(key, block_size)
        _int("slab_id", slab_id, 0)
        if slab_id >= self.num_slabs:
            raise ValueError(f"slab_id {slab_id} must be < num_slabs {self.num_slabs}")
        _int("used", used, 0)
        if used > bps:
            raise ValueError(f"used {used} must be <= blocks_per_slab {bps}")
        if self._key[slab_id] is not None:
            raise ValueError(f"slab {slab_id} is not FREE (formatted for {self._key[slab_id]!r})")
        self._free_slabs.remove(slab_id)
        heapq.heapify(self._free_slabs)
        self._key[slab_id] = key
        self._used[slab_id] = used
        self._free_ids[slab_id] = list(range(used, bps))
        self._taken[slab_id] = bytearray(b"\x01" * used + b"\x00" * (bps - used))
        self._held[key] += 1
        self._used_blocks[key] += used
        if used == 0:
            self._empty[key].add(slab_id)
        if used < bps:
            heapq.heappush(self._open[key], slab_id)

    def slab_counts(self, key: Hashable) -> dict[str, int]:
        """``FREE`` slabs of the table, ``PARTIAL`` / ``FULL`` slabs of ``key``;
        ``empty``: the key's PARTIAL slabs that hold no block."""
        held = self.held_slabs(key)
        full = sum(1 for s in range(self.num_slabs) if self._key[s] == key and self._used[s] == self._bps[key])
        return {self.FREE: self.free_slabs, self.PARTIAL: held - full, self.FULL: full,
                "empty": len(self._empty.get(key, ()))}  # fmt: skip

    def release_empty(self, key: Hashable) -> int:
        """Return every empty slab of ``key`` beyond its pin to FREE; returns how many."""
        if key not in self._bps:
            return 0
        return self._release_empty(key, sorted(self._empty[key]))

    def check(self) -> None:
        """Assert the table's invariants (counts agree with the slabs)."""
        assert len(self._free_slabs) == sum(1 for k in self._key if k is None)
        for key, bps in self._bps.items():
            sl = [s for s in range(self.num_slabs) if self._key[s] == key]
            assert len(sl) == self._held[key], (key, len(sl), self._held[key])
            assert sum(self._used[s] for s in sl) == self._used_blocks[key]
            assert self._empty[key] == {s for s in sl if self._used[s] == 0}
            for s in sl:
                assert 0 <= self._used[s] <= bps and len(self._free_ids[s]) == bps - self._used[s]
                assert sum(self._taken[s]) == self._used[s]
