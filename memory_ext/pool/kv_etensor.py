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

Hiding the mapping cost (eLLM §5.1)
-----------------------------------
Two opt-in mechanisms take map/unmap calls off the hot path
(``ensure_mapped``/``free_pages``). With neither (the defaults:
``headroom_slots=0, async_unmap=False``) the behaviour is exactly the eager
model above.

* **Speculative pre-mapping.** ``premap(page_ids)`` maps the slots of pages
  the caller will write soon, without making the pages live.
  ``headroom_slots=K`` asks for K mapped-but-empty ("spare") slots to be kept
  ready: ``refill()`` (run by the caller between steps, or by a background
  thread; never by the hot path) maps spares up to K, and ``free_pages`` keeps
  a slot it empties as a spare instead of unmapping it while fewer than K
  spares exist. ``ensure_mapped`` on a spare slot makes zero map calls.
  ``trim_headroom(keep)`` unmaps spares down to ``keep`` and returns their
  chunks to the pool. ``suggest_pages(n)`` lists free pages in the order that
  needs the fewest maps (partly used slots, spares, retiring slots, then
  unmapped slots), for a caller's page allocator.
* **Asynchronous unmapping.** With ``async_unmap=True`` (or a shared
  ``unmapper=AsyncUnmapper()``), a slot that ``free_pages`` empties beyond the
  headroom becomes RETIRING and its unmap + release is queued to the
  unmapper's worker thread; ``free_pages`` returns at once. If
  ``ensure_mapped``/``premap``/``refill`` needs a RETIRING slot before the
  worker got to it, the retirement is cancelled (zero map calls, the worker's
  job becomes a no-op). ``flush()`` waits for every queued job and re-raises
  a worker failure.

Slot states (every slot is in exactly one)::

    FREE --ensure_mapped--> LIVE <--ensure_mapped-- SPARE <--refill/premap-- FREE
                             |  ^                     ^  |
              last page freed|  |ensure_mapped        |  |trim_headroom / pool pressure
                             v  |                     |  v
            (spares < K) SPARE  RETIRING --worker--> FREE   (sync mode: LIVE -> FREE at once)

* FREE: not mapped, no chunk. LIVE: mapped, >= 1 live page. SPARE: mapped,
  no live page, kept on purpose. RETIRING: mapped, no live page, unmap queued.
* Invariants (``check_invariants``): a slot is mapped iff it is LIVE, SPARE or
  RETIRING; SPARE and RETIRING slots have no live page; a LIVE slot is never
  SPARE or RETIRING; every mapped slot's chunk is owned by this tensor's owner
  in the pool ledger (spare and retiring chunks count as KV until unmapped).
* The worker unmaps a slot only under the tensor's lock and only if its
  retirement ticket is still current, so it can never unmap a slot that got
  live pages again.
* Pool pressure: if ``ensure_mapped`` cannot get chunks from the pool while
  this tensor holds SPARE or RETIRING slots it does not need, it unmaps and
  releases those synchronously and retries once (a refused call may so have
  given back spares; live pages never change).

Not here: donating idle mapped slots to other owners (spares are the only
idle mapped slots; ``trim_headroom`` gives them back to the pool, whence any
owner may acquire them). Moving a page's backing "map at the new place first,
unmap the old one later" needs no code here: the vmm layer allows one chunk to
be mapped at two slots (aliases), so a caller can map the new slot, switch,
and queue the old slot's unmap.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from .ownership import CeilingExceeded, ChunkPool, Owner, PoolExhausted
from .slots import PooledSlots, SlotBackedTensor
from .unmapper import AsyncUnmapper


def _check_headroom(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"headroom_slots must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"headroom_slots must be >= 0, got {value}")
    return value


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVETensor(SlotBackedTensor):
    """A paged buffer over one virtual range, backed chunk by chunk. See the module docstring."""

    def __init__(
        self,
        pool: ChunkPool,
        page_bytes: int,
        num_pages: int,
        dtype: torch.dtype = torch.uint8,
        owner: Owner = Owner.KV,
        *,
        headroom_slots: int = 0,
        async_unmap: bool = False,
        unmapper: AsyncUnmapper | None = None,
    ):
        if not isinstance(pool, ChunkPool):
            raise TypeError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        for name, value in (("page_bytes", page_bytes), ("num_pages", num_pages)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not isinstance(owner, Owner) or owner is Owner.FREE:
            raise ValueError(f"owner must be an Owner other than FREE, got {owner!r}")
        _check_headroom(headroom_slots)
        if unmapper is not None and not isinstance(unmapper, AsyncUnmapper):
            raise TypeError(f"unmapper must be an AsyncUnmapper, got {type(unmapper).__name__}")
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
        self._live = bytearray(num_pages)  # 1 where the page is live
        self._slot_live = [0] * self._num_slots  # live pages per slot
        self._slot_chunk = self._slots.mapped  # slot index -> mapped chunk (owned by _slots)
        self._closed = False
        self._headroom = headroom_slots
        self._spare: set[int] = set()  # mapped, no live page, kept ready
        self._retiring: dict[int, object] = {}  # mapped, no live page, unmap queued: slot -> ticket
        self._own_unmapper = unmapper is None and async_unmap
        self._unmapper = AsyncUnmapper() if self._own_unmapper else unmapper
        self._stats = {"cancelled_retirements": 0, "retired_async": 0, "spares_used": 0}

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

    # ------------------------------------------------------- headroom info
    @property
    def headroom_slots(self) -> int:
        return self._headroom

    @headroom_slots.setter
    def headroom_slots(self, value: int) -> None:
        """Set K. Lowering it does not unmap anything: ``trim_headroom`` does."""
        self._headroom = _check_headroom(value)

    @property
    def async_unmap(self) -> bool:
        return self._unmapper is not None

    @property
    def spare_slots(self) -> int:
        """Mapped slots with no live page kept ready (SPARE)."""
        with self._lock:
            return len(self._spare)

    @property
    def retiring_slots(self) -> int:
        """Mapped slots with no live page whose unmap is queued (RETIRING)."""
        with self._lock:
            return len(self._retiring)

    def slot_state(self, slot: int) -> str:
        """'free', 'live', 'spare' or 'retiring'."""
        with self._lock:
            if not 0 <= slot < self._num_slots:
                raise ValueError(f"slot {slot} is outside [0, {self._num_slots})")
            if slot in self._spare:
                return "spare"
            if slot in self._retiring:
                return "retiring"
            return "live" if slot in self._slot_chunk else "free"

    def stats(self) -> dict[str, int]:
        """Counters: cancelled_retirements, retired_async (jobs that unmapped), spares_used."""
        with self._lock:
            return dict(self._stats)

    def suggest_pages(self, n: int, exclude: Iterable[int] = ()) -> list[int]:
        """Up to ``n`` free page ids, cheapest first: partly live slots, spares, retiring, unmapped.

        A helper for the caller's page allocator (this class picks no pages
        itself). Costs O(mapped slots * pages_per_slot + unmapped slots scanned).
        """
        skip = set(exclude)
        out: list[int] = []
        pps = self._pages_per_slot
        with self._lock:
            partly = sorted(s for s in self._slot_chunk if self._slot_live[s])
            order = [partly, sorted(self._spare), sorted(self._retiring)]
            for group in order:
                for slot in group:
                    for p in range(slot * pps, min((slot + 1) * pps, self._num_pages)):
                        if not self._live[p] and p not in skip:
                            out.append(p)
                            if len(out) >= n:
                                return out
            for slot in range(self._num_slots):
                if slot in self._slot_chunk:
                    continue
                for p in range(slot * pps, min((slot + 1) * pps, self._num_pages)):
                    if p not in skip:
                        out.append(p)
                        if len(out) >= n:
                            return out
        return out

    # ------------------------------------------------------------ mutations
    def _reclaim(self, slots: Iterable[int]) -> None:
        """Under the lock: slots about to be used leave SPARE/RETIRING (no map call)."""
        for slot in slots:
            if slot in self._spare:
                self._spare.discard(slot)
                self._stats["spares_used"] += 1
            elif self._retiring.pop(slot, None) is not None:
                self._stats["cancelled_retirements"] += 1

    def _give_back_idle(self, keep: Iterable[int] = (), limit: int | None = None) -> int:
        """Under the lock: unmap + release RETIRING then SPARE slots not in ``keep`` (sync)."""
        keep = set(keep)
        victims = [s for s in sorted(self._retiring) if s not in keep]
        victims += [s for s in sorted(self._spare, reverse=True) if s not in keep]
        if limit is not None:
            victims = victims[:limit]
        for s in victims:
            self._retiring.pop(s, None)  # the worker's job for it becomes a no-op
            self._spare.discard(s)
        return self._slots.unmap_slots(victims)

    def _map_needed(self, slots: list[int]) -> int:
        """Under the lock: map every listed slot not mapped yet, all or nothing, easing pool pressure."""
        try:
            return self._slots.map_slots(slots)
        except (PoolExhausted, CeilingExceeded):
            if not (self._spare or self._retiring):
                raise
            self._give_back_idle(keep=slots)
            return self._slots.map_slots(slots)

    def ensure_mapped(self, page_ids: Iterable[int]) -> int:
        """Mark ``page_ids`` live, mapping every slot they need; return how many slots were mapped.

        All or nothing (see the module docstring). Pages already live stay
        live. SPARE and RETIRING slots are taken over without a map call.
        """
        pages = [self._check_page(p) for p in page_ids]
        with self._lock:
            self._check_open()
            pps = self._pages_per_slot
            slots = sorted({p // pps for p in pages})
            newly_mapped = self._map_needed(slots)
            if self._spare or self._retiring:
                self._reclaim(slots)
            for p in pages:
                if not self._live[p]:
                    self._live[p] = 1
                    self._slot_live[p // pps] += 1
            return newly_mapped

    def free_pages(self, page_ids: Iterable[int]) -> int:
        """Mark live pages free; a slot left with no live page is retired.

        Retiring a slot: while fewer than ``headroom_slots`` spares exist it
        stays mapped as a SPARE; otherwise it is unmapped and its chunk
        released now (sync) or queued to the unmapper (``async_unmap``).
        Returns how many slots were unmapped or queued for unmapping. Refused
        (nothing changes) if a page is not live or is listed twice.
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
            retire = []
            for slot in emptied:
                if len(self._spare) < self._headroom:
                    self._spare.add(slot)
                else:
                    retire.append(slot)
            if self._unmapper is None or not retire:
                return self._slots.unmap_slots(retire)
            for slot in retire:
                ticket = object()
                self._retiring[slot] = ticket
                self._unmapper.submit(self._retire_job, slot, ticket)
            return len(retire)

    def _retire_job(self, slot: int, ticket: object) -> bool:
        """Worker side: unmap + release ``slot`` unless its retirement was cancelled."""
        with self._lock:
            if self._closed or self._retiring.get(slot) is not ticket:
                return False
            del self._retiring[slot]
            try:
                self._slots.unmap_slots([slot])
            except BaseException:
                if slot in self._slot_chunk:  # still mapped: keep it as a spare, not lost
                    self._spare.add(slot)
                raise
            self._stats["retired_async"] += 1
            return True

    def premap(self, page_ids: Iterable[int]) -> int:
        """Map (as SPARE) the slots of ``page_ids`` that are not mapped; pages stay free.

        All or nothing; returns how many slots were mapped. RETIRING slots
        among them are kept (retirement cancelled) as spares. Off the hot path.
        """
        pages = [self._check_page(p) for p in page_ids]
        with self._lock:
            self._check_open()
            pps = self._pages_per_slot
            slots = sorted({p // pps for p in pages})
            newly = [s for s in slots if s not in self._slot_chunk]
            mapped = self._slots.map_slots(newly)
            for s in slots:
                if self._slot_live[s]:
                    continue
                if self._retiring.pop(s, None) is not None:
                    self._stats["cancelled_retirements"] += 1
                self._spare.add(s)
            return mapped

    def refill(self) -> int:
        """Bring the spare count up to ``headroom_slots``; return how many slots were mapped.

        RETIRING slots are taken back first (no map call), then the lowest
        FREE slots are mapped one at a time; stops quietly when the pool
        refuses. Run it off the hot path (between steps or on a background
        thread); it holds the tensor's lock while it maps.
        """
        with self._lock:
            self._check_open()
            for slot in sorted(self._retiring):
                if len(self._spare) >= self._headroom:
                    break
                del self._retiring[slot]
                self._spare.add(slot)
                self._stats["cancelled_retirements"] += 1
            mapped = 0
            slot = 0
            while len(self._spare) < self._headroom and slot < self._num_slots:
                if slot not in self._slot_chunk:
                    try:
                        self._slots.map_slots([slot])
                    except (PoolExhausted, CeilingExceeded):
                        break
                    self._spare.add(slot)
                    mapped += 1
                slot += 1
            return mapped

    def trim_headroom(self, keep: int = 0) -> int:
        """Unmap SPARE slots (highest first) down to ``keep``, releasing their chunks; return how many."""
        _check_headroom(keep)
        with self._lock:
            self._check_open()
            extra = len(self._spare) - keep
            if extra <= 0:
                return 0
            victims = sorted(self._spare, reverse=True)[:extra]
            for s in victims:
                self._spare.discard(s)
            return self._slots.unmap_slots(victims)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued unmap has run; re-raise a worker failure. No-op when sync.

        Must not be called with this tensor's lock held by the caller (the
        worker needs it).
        """
        if self._unmapper is not None:
            self._unmapper.flush(timeout)

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
            if self._spare & self._retiring.keys():
                raise AssertionError(f"slots both spare and retiring: {sorted(self._spare & self._retiring.keys())}")
            for slot in range(self._num_slots):
                live = sum(self._live[slot * pps : (slot + 1) * pps])
                if live != self._slot_live[slot]:
                    raise AssertionError(f"slot {slot}: {live} live pages but count says {self._slot_live[slot]}")
                idle = slot in self._spare or slot in self._retiring
                if live and idle:
                    raise AssertionError(f"slot {slot}: {live} live pages but marked spare/retiring")
                if (live > 0 or idle) != (slot in self._slot_chunk):
                    raise AssertionError(
                        f"slot {slot}: {live} live pages, idle={idle}, mapped={slot in self._slot_chunk}"
                    )
            if self._closed:
                return
            self._slots.check_invariants()

    def close(self) -> None:
        """Wait for queued unmaps, unmap every slot, release the chunks and the range. Idempotent.

        A worker failure is re-raised after everything is closed.
        """
        error = None
        if not self._closed and self._unmapper is not None:
            try:
                self._unmapper.flush()
            except BaseException as exc:
                error = exc
        with self._lock:
            if not self._closed:
                self._retiring.clear()  # jobs still queued (another thread freed pages) become no-ops
                self._spare.clear()
                self._slots.close()
                self._live = bytearray(self._num_pages)
                self._slot_live = [0] * self._num_slots
                self._closed = True
        if self._own_unmapper:
            self._unmapper.close()
        if error is not None:
            raise error

    def __enter__(self) -> KVETensor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
