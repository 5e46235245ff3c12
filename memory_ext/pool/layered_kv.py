"""LayeredKVBuffers: per-layer K/V buffers of one KV pool, backed group by group.

Engines keep KV as ``N`` separate row-major buffers (K and V of every layer),
each ``num_rows`` rows long, where row ``r`` of every buffer belongs to the
same token slot. A token slot is usable only if its row is backed in *all*
``N`` buffers, so backing is managed in **groups**: group ``g`` is rows
``[g * group_rows, (g + 1) * group_rows)`` of every buffer at once.

``group_rows`` is the smallest multiple of ``rows_multiple`` (the engine's
page size in rows) for which every buffer's group is a whole number of chunks
(``group_rows * row_bytes[i] % chunk_bytes == 0``), so groups never share a
chunk. Buffer ``i`` therefore needs ``chunks_per_group[i]`` chunks per group.

Invariants (``check_invariants``):
* a group is mapped in every buffer or in none (``map_groups`` is all or
  nothing across buffers; ``unmap_groups`` unmaps every buffer);
* the chunks of mapped groups are owned by ``owner`` in the pool;
* rows of unmapped groups are holes in ``view(i)``: the engine must only touch
  rows of mapped groups (a hole is a SIGSEGV on the host backend, an
  illegal-address fault on CUDA).

Mechanism only: which groups to map or unmap is the caller's decision.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

import torch

from ..policy.kv_format import slab_tokens
from .ownership import ChunkPool, Owner
from .slots import PooledSlots


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def group_rows_for(row_bytes: Sequence[int], chunk_bytes: int, rows_multiple: int = 1) -> int:
    """Smallest row count that is a multiple of ``rows_multiple`` and fills whole chunks in every buffer.

    This is F1's slab rule on the chunk (``memory_ext.policy.kv_format.slab_tokens``): a group is
    the server's KV slab, and the status and the simulator size it with the same function."""
    _positive_int("rows_multiple", rows_multiple)
    _positive_int("chunk_bytes", chunk_bytes)
    for i, rb in enumerate(row_bytes):
        _positive_int(f"row_bytes[{i}]", rb)
    return slab_tokens(list(row_bytes), chunk_bytes, rows_multiple)


class LayeredKVBuffers:
    """``N`` row buffers over reserved ranges, mapped group by group. See the module docstring."""

    def __init__(
        self, pool: ChunkPool, row_bytes: Sequence[int], num_rows: int, rows_multiple: int = 1, owner: Owner = Owner.KV
    ):
        if not isinstance(pool, ChunkPool):
            raise TypeError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        row_bytes = [int(_positive_int(f"row_bytes[{i}]", rb)) for i, rb in enumerate(row_bytes)]
        if not row_bytes:
            raise ValueError("row_bytes must list at least one buffer")
        _positive_int("num_rows", num_rows)
        if not isinstance(owner, Owner) or owner is Owner.FREE:
            raise ValueError(f"owner must be an Owner other than FREE, got {owner!r}")
        self._pool = pool
        self._owner = owner
        self._row_bytes = row_bytes
        self._chunk_bytes = pool.chunk_bytes
        self._group_rows = group_rows_for(row_bytes, self._chunk_bytes, rows_multiple)
        self._num_groups = -(-num_rows // self._group_rows)
        self._num_rows = num_rows
        self._chunks_per_group = [self._group_rows * rb // self._chunk_bytes for rb in row_bytes]
        self._lock = threading.RLock()
        self._buffers: list[PooledSlots] = []
        try:
            for cpg in self._chunks_per_group:
                self._buffers.append(PooledSlots(pool, owner, self._num_groups * cpg))
        except BaseException:
            for b in self._buffers:
                b.close()
            raise
        self._mapped: set[int] = set()
        self._closed = False
        self.map_calls = 0
        self.unmap_calls = 0

    # ----------------------------------------------------------------- info
    @property
    def group_rows(self) -> int:
        return self._group_rows

    @property
    def num_groups(self) -> int:
        return self._num_groups

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def num_buffers(self) -> int:
        return len(self._row_bytes)

    @property
    def chunks_per_group(self) -> int:
        """Chunks one group takes over all buffers."""
        return sum(self._chunks_per_group)

    @property
    def group_bytes(self) -> int:
        return self.chunks_per_group * self._chunk_bytes

    @property
    def pool(self) -> ChunkPool:
        return self._pool

    def mapped_groups(self) -> list[int]:
        with self._lock:
            return sorted(self._mapped)

    @property
    def num_mapped(self) -> int:
        with self._lock:
            return len(self._mapped)

    def is_mapped(self, group: int) -> bool:
        with self._lock:
            return group in self._mapped

    @property
    def mapped_bytes(self) -> int:
        return self.num_mapped * self.group_bytes

    def _check_group(self, g) -> int:
        if isinstance(g, bool) or not isinstance(g, int):
            raise TypeError(f"group must be an int, got {type(g).__name__}")
        if not 0 <= g < self._num_groups:
            raise ValueError(f"group {g} is outside [0, {self._num_groups})")
        return g

    def _slots_of(self, i: int, groups: Iterable[int]) -> list[int]:
        cpg = self._chunks_per_group[i]
        return [g * cpg + k for g in groups for k in range(cpg)]

    # ------------------------------------------------------------ mutations
    def map_groups(self, groups: Iterable[int]) -> int:
        """Back every listed group not yet mapped, in every buffer; return how many were mapped.

        All or nothing: if the pool cannot supply every chunk (``PoolExhausted``
        / ``CeilingExceeded``) or a map fails, nothing stays mapped.
        """
        groups = sorted({self._check_group(g) for g in groups})
        with self._lock:
            self._check_open()
            needed = [g for g in groups if g not in self._mapped]
            if not needed:
                return 0
            done: list[int] = []
            try:
                for i, buf in enumerate(self._buffers):
                    buf.map_slots(self._slots_of(i, needed))
                    done.append(i)
            except BaseException:
                for i in done:
                    self._buffers[i].unmap_slots(self._slots_of(i, needed))
                raise
            self._mapped.update(needed)
            self.map_calls += len(needed)
            return len(needed)

    def unmap_groups(self, groups: Iterable[int]) -> int:
        """Unmap the listed mapped groups in every buffer and release their chunks; return how many."""
        groups = sorted({self._check_group(g) for g in groups})
        with self._lock:
            self._check_open()
            missing = [g for g in groups if g not in self._mapped]
            if missing:
                raise ValueError(f"groups {missing} are not mapped")
            if not groups:
                return 0
            for i, buf in enumerate(self._buffers):
                buf.unmap_slots(self._slots_of(i, groups))
            self._mapped.difference_update(groups)
            self.unmap_calls += len(groups)
            return len(groups)

    # ---------------------------------------------------------------- views
    def view(self, i: int, dtype: torch.dtype, row_shape: Sequence[int]) -> torch.Tensor:
        """Buffer ``i`` as a ``(num_rows, *row_shape)`` tensor; rows of unmapped groups are holes."""
        row_shape = tuple(int(d) for d in row_shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(row_shape) * itemsize != self._row_bytes[i]:
            raise ValueError(f"row_shape {row_shape} of {dtype} is not row_bytes[{i}] = {self._row_bytes[i]}")
        with self._lock:
            self._check_open()
            buf = self._buffers[i]
            flat = buf.backend._make_tensor(buf.vrange.base, self._num_rows * self._row_bytes[i], dtype)
            return flat.view((self._num_rows,) + row_shape)

    # ------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LayeredKVBuffers is closed")

    def check_invariants(self) -> None:
        with self._lock:
            for i, buf in enumerate(self._buffers):
                buf.check_invariants()
                expect = set(self._slots_of(i, self._mapped))
                if set(buf.mapped) != expect:
                    raise AssertionError(
                        f"buffer {i}: mapped slots {sorted(buf.mapped)} differ from "
                        f"the mapped groups' slots {sorted(expect)}"
                    )

    def close(self) -> None:
        """Unmap every group, release the chunks and the ranges (views become invalid)."""
        with self._lock:
            if self._closed:
                return
            for buf in self._buffers:
                buf.close()
            self._mapped.clear()
            self._closed = True
