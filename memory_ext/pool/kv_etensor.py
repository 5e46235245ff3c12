"""KVETensor: a paged KV buffer whose physical backing follows its live pages.

Model
-----
One virtual range is reserved for the full logical capacity (``num_pages *
page_bytes``, rounded up to whole chunks), so a page's address never changes.
Pages are grouped into chunk-sized **slots** of ``pages_per_slot = chunk_bytes
// page_bytes`` consecutive pages (``chunk_bytes % page_bytes`` must be 0).

* ``ensure_mapped(page_ids)`` marks the pages live and maps a KV chunk (from
  the ``ChunkPool``) behind every slot they need that is not mapped yet. All
  or nothing: if the pool cannot supply every chunk, or a map fails, nothing
  changes (chunks already mapped by the call are unmapped and released).
* ``free_pages(page_ids)`` marks pages free. **Deflation is eager at slot
  granularity**: as soon as every page of a slot is free, the slot is unmapped
  and its chunk goes back to FREE. Which pages to free (and so how well slots
  empty out) is the caller's decision; this class makes none.
* ``page_view(page_id)`` is a checked zero-copy view of one live page.
  ``view(dtype, shape_per_page)`` is the whole logical buffer as one tensor of
  shape ``(num_pages, *shape_per_page)``; its unmapped slots are inaccessible
  holes, so only rows of live pages may be touched (touching a hole is a
  SIGSEGV on the host backend, an illegal-address fault on CUDA).

A page's bytes survive as long as the page is live, whatever happens to other
slots. A freed page's bytes are gone once its slot is unmapped: a later
``ensure_mapped`` may put any chunk (with any old contents) there.

Not here: donating idle mapped slots to other owners (with eager deflation a
KV slot without live pages is never mapped, so there is nothing idle to
donate), speculative pre-mapping, asynchronous unmapping.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import torch

from .ownership import ChunkPool, Owner
from .slots import PooledSlots


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVETensor:
    """A paged buffer over one virtual range, backed chunk by chunk. See the module docstring."""

    def __init__(self, pool: ChunkPool, page_bytes: int, num_pages: int,
                 dtype: torch.dtype = torch.uint8, owner: Owner = Owner.KV):
        if not isinstance(pool, ChunkPool):
            raise TypeError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        for name, value in (("page_bytes", page_bytes), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not isinstance(owner, Owner) or owner is Owner.FREE:
            raise ValueError(f"owner must be an Owner other than FREE, got {owner!r}")
        chunk_bytes = pool.chunk_bytes
        if chunk_bytes % page_bytes:
            raise ValueError(f"page_bytes {page_bytes} does not divide the chunk size {chunk_bytes}")
        if page_bytes % _itemsize(dtype):
            raise ValueError(f"page_bytes {page_bytes} is not a multiple of the {dtype} item size")
        self._pool = pool
        self._backend = pool.backend
        self._owner = owner
        self._dtype = dtype
        self._page_bytes = page_bytes
        self._num_pages = num_pages
        self._chunk_bytes = chunk_bytes
        self._pages_per_slot = chunk_bytes // page_bytes
        self._num_slots = -(-num_pages // self._pages_per_slot)
        self._slots = PooledSlots(pool, owner, self._num_slots)
        self._range = self._slots.vrange
        self._lock = threading.RLock()
        self._live = bytearray(num_pages)          # 1 where the page is live
        self._slot_live = [0] * self._num_slots    # live pages per slot
        self._slot_chunk = self._slots.mapped       # slot index -> mapped chunk (owned by _slots)
        self._closed = False

    # ----------------------------------------------------------------- info
    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def pages_per_slot(self) -> int:
        return self._pages_per_slot

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def vrange(self):
        return self._range

    @property
    def mapped_chunks(self) -> int:
        """How many slots are mapped (= KV chunks this tensor holds)."""
        with self._lock:
            return len(self._slot_chunk)

    @property
    def live_pages(self) -> int:
        with self._lock:
            return sum(self._slot_live)

    def is_live(self, page_id: int) -> bool:
        self._check_page(page_id)
        return bool(self._live[page_id])

    def slot_of(self, page_id: int) -> int:
        return self._check_page(page_id) // self._pages_per_slot

    def chunk_of_slot(self, slot: int):
        """The chunk mapped at ``slot``, or None."""
        with self._lock:
            return self._slot_chunk.get(slot)

    def _check_page(self, page_id) -> int:
        if isinstance(page_id, bool) or not isinstance(page_id, int):
            raise TypeError(f"page id must be an int, got {type(page_id).__name__}")
        if not 0 <= page_id < self._num_pages:
            raise ValueError(f"page id {page_id} is outside [0, {self._num_pages})")
        return page_id

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVETensor is closed")

    # ------------------------------------------------------------ mutations
    def ensure_mapped(self, page_ids: Iterable[int]) -> int:
        """Mark ``page_ids`` live, mapping every slot they need; return how many slots were mapped.

        All or nothing (see the module docstring). Pages already live stay live.
        """
        pages = [self._check_page(p) for p in page_ids]
        with self._lock:
            self._check_open()
            pps = self._pages_per_slot
            newly_mapped = self._slots.map_slots(p // pps for p in pages)
            for p in pages:
                if not self._live[p]:
                    self._live[p] = 1
                    self._slot_live[p // pps] += 1
            return newly_mapped

    def free_pages(self, page_ids: Iterable[int]) -> int:
        """Mark live pages free; unmap and release each slot left with no live page.

        Returns how many chunks went back to the pool. Refused (nothing
        changes) if a page is not live or is listed twice.
        """
        pages = [self._check_page(p) for p in page_ids]
        with self._lock:
            self._check_open()
            seen = set()
            for p in pages:
                if p in seen:
                    raise ValueError(f"page id {p} is listed twice")
                if not self._live[p]:
                    raise ValueError(f"page id {p} is not live")
                seen.add(p)
            pps = self._pages_per_slot
            emptied = []
            for p in pages:
                self._live[p] = 0
                slot = p // pps
                self._slot_live[slot] -= 1
                if self._slot_live[slot] == 0:
                    emptied.append(slot)
            return self._slots.unmap_slots(emptied)

    # ----------------------------------------------------------------- views
    def page_view(self, page_id: int, dtype=None, shape=None) -> torch.Tensor:
        """A zero-copy view of one live page (1-D of ``dtype``, or ``shape``)."""
        dtype = self._dtype if dtype is None else dtype
        with self._lock:
            self._check_open()
            if not self._live[self._check_page(page_id)]:
                raise ValueError(f"page id {page_id} is not live")
            if shape is None:
                size = _itemsize(dtype)
                if self._page_bytes % size:
                    raise ValueError(f"page_bytes {self._page_bytes} is not a multiple of the {dtype} item size")
                spec = self._page_bytes
            else:
                spec = tuple(shape)
                n = 1
                for d in spec:
                    n *= d
                if n * _itemsize(dtype) != self._page_bytes:
                    raise ValueError(f"shape {spec} of {dtype} does not fill page_bytes {self._page_bytes}")
            return self._backend.tensor_view(self._range, page_id * self._page_bytes, spec, dtype)

    def view(self, dtype=None, shape_per_page: Sequence[int] = ()) -> torch.Tensor:
        """The whole buffer as ``(num_pages, *shape_per_page)``; only live pages' rows may be touched.

        Unchecked by design: unmapped slots are holes (see the module docstring).
        """
        dtype = self._dtype if dtype is None else dtype
        shape = tuple(shape_per_page)
        per_page = 1
        for d in shape:
            per_page *= d
        if not shape:
            if self._page_bytes % _itemsize(dtype):
                raise ValueError(f"page_bytes {self._page_bytes} is not a multiple of the {dtype} item size")
            shape = (self._page_bytes // _itemsize(dtype),)
        elif per_page * _itemsize(dtype) != self._page_bytes:
            raise ValueError(f"shape_per_page {shape} of {dtype} does not fill page_bytes {self._page_bytes}")
        with self._lock:
            self._check_open()
            flat = self._backend._make_tensor(self._range.base, self._num_pages * self._page_bytes, dtype)
            return flat.view((self._num_pages,) + shape)

    # ------------------------------------------------------------ lifecycle
    def check_invariants(self) -> None:
        with self._lock:
            pps = self._pages_per_slot
            for slot in range(self._num_slots):
                live = sum(self._live[slot * pps:(slot + 1) * pps])
                if live != self._slot_live[slot]:
                    raise AssertionError(f"slot {slot}: {live} live pages but count says {self._slot_live[slot]}")
                if (live > 0) != (slot in self._slot_chunk):
                    raise AssertionError(f"slot {slot}: {live} live pages, mapped={slot in self._slot_chunk}")
            if self._closed:
                return
            self._slots.check_invariants()

    def close(self) -> None:
        """Unmap every slot, release its chunk to the pool, release the range. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._slots.close()
            self._live = bytearray(self._num_pages)
            self._slot_live = [0] * self._num_slots
            self._closed = True

    def __enter__(self) -> "KVETensor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
