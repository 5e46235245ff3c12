"""WeightStore: decoder layers' parameters in pool chunks, lendable to the KV cache.

Model
-----
Each registered layer gets its own reserved virtual range; its tensors are packed into it
(256-byte aligned) and the caller rebinds the parameters to the views ``add_layer`` returns,
so a parameter keeps one address for the life of the store and the model code is untouched.
A master copy of every layer stays in host memory (pinned when the pool is on CUDA).

A layer is **resident** (its own ``WEIGHTS`` chunks are mapped behind its range) or
**streamed** (it owns no chunk). Streamed layers share ``slots`` staging slots: a slot is a
set of ``WEIGHTS`` chunks big enough for the largest layer, mapped behind a streamed layer's
range while that layer is fetched and computed, then unmapped (``evict``) so the next
streamed layer can use it. With ``s`` streamed layers and ``b`` slots the store lends
``(sum of the streamed layers' chunks) - b * slot chunks`` to the pool: the KV side can map
them at once.

* ``set_streamed(layers, slots)`` moves layers between the two states: released layers
  give their chunks back to the pool (first to fill the staging slots), restored layers
  take chunks from the pool, are mapped again and refilled from the master copy
  asynchronously (``ensure`` waits for that copy).
* ``fetch(layer)`` maps a free slot behind a streamed layer and starts its copy;
  ``ensure(layer)`` blocks until the layer's bytes are in place (fetching it first if needed,
  or raising ``NotResident`` in ``strict`` mode); ``evict(layer)`` returns its slot.

Invariants (``check_invariants``)
---------------------------------
1. A layer's range is mapped only while it is resident or holds a slot; its bytes are read
   only after ``ensure`` returned (the copy that filled them has landed).
2. Chunks held by ``WEIGHTS`` in the pool == own chunks of resident layers + slot chunks +
   chunks reserved for the next restore.
3. A slot is mapped behind at most one layer; a layer holds at most one slot; resident
   layers hold none.
4. No layer is released or evicted while a copy into its range is in flight (those calls
   wait for it first).

Callers serialise ``set_streamed`` / ``fetch`` / ``ensure`` / ``evict`` (the layer pipeline
runs them on the forward's thread); copies run on the copier's worker.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..pool.ownership import ChunkPool, Owner
from ..vmm.base import PhysicalChunk, VirtualRange
from .copier import HostCopier, Ticket

ALIGN = 256  # bytes between packed tensors of one layer


class NotResident(RuntimeError):
    """A forward reached a layer whose bytes are not in place (strict mode)."""


@dataclass
class _Layer:
    key: Hashable
    vrange: VirtualRange
    chunks: int  # chunks its packed tensors span
    nbytes: int
    views: list[torch.Tensor]
    masters: list[torch.Tensor]
    own: list[PhysicalChunk] | None = None  # resident: its chunks
    slot: int | None = None  # streamed and fetched: the slot mapped behind it
    ticket: Ticket | None = None  # last copy into its range


@dataclass
class _Slot:
    chunks: list[PhysicalChunk]
    layer: Hashable | None = None


@dataclass
class WeightStats:
    fetches: int = 0
    fetch_bytes: int = 0
    restores: int = 0
    restore_bytes: int = 0
    releases: int = 0
    copy_seconds: float = 0.0  # measured duration of finished copies
    stall_seconds: float = 0.0  # time forwards waited for a copy
    stalls: int = 0
    unfetched_waits: int = 0  # ensure() found a streamed layer not even fetched
    extra: dict = field(default_factory=dict)


def _packed(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for t in tensors:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += t.numel() * t.element_size()
    return offsets, end


class WeightStore:
    """See the module docstring."""

    def __init__(self, pool: ChunkPool, copier=None, *, strict: bool = False, owner: Owner = Owner.WEIGHTS):
        if not isinstance(pool, ChunkPool):
            raise TypeError(f"pool must be a ChunkPool, got {type(pool).__name__}")
        self.pool = pool
        self.backend = pool.backend
        self.owner = owner
        self.strict = strict
        self.copier = copier if copier is not None else HostCopier()
        self._pin = self.backend.device.type == "cuda"
        self._layers: dict[Hashable, _Layer] = {}
        self._slots: list[_Slot] = []
        self._reserved: list[PhysicalChunk] = []  # taken for the next set_streamed's restores
        self._lock = threading.RLock()
        self.stats = WeightStats()
        self._closed = False

    # ------------------------------------------------------------------ info
    @property
    def keys(self) -> list[Hashable]:
        return list(self._layers)

    def layer_chunks(self, key: Hashable) -> int:
        return self._layers[key].chunks

    @property
    def slot_chunks(self) -> int:
        return max((lay.chunks for lay in self._layers.values()), default=0)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def is_resident(self, key: Hashable) -> bool:
        return self._layers[key].own is not None

    def streamed(self) -> list[Hashable]:
        return [k for k, lay in self._layers.items() if lay.own is None]

    def is_fetched(self, key: Hashable) -> bool:
        """A streamed layer holds a slot (its copy may still be in flight)."""
        return self._layers[key].slot is not None

    def is_ready(self, key: Hashable) -> bool:
        """The layer's bytes are in place (resident or fetched) and its last copy has landed."""
        lay = self._layers[key]
        mapped = lay.own is not None or lay.slot is not None
        return mapped and (lay.ticket is None or lay.ticket.done())

    def held_chunks(self) -> int:
        own = sum(len(lay.own) for lay in self._layers.values() if lay.own)
        return own + sum(len(s.chunks) for s in self._slots) + len(self._reserved)

    def reserve(self, n: int) -> None:
        """Take ``n`` more chunks from the pool now for the next ``set_streamed``'s restores (which
        may run on another thread later): memory the engine may count as free is never taken
        behind its back. ``PoolExhausted`` if the pool cannot; unused ones go back then."""
        with self._lock:
            self._reserved += self.pool.acquire(self.owner, n)

    @property
    def reserved_chunks(self) -> int:
        return len(self._reserved)

    def total_chunks(self) -> int:
        """Chunks every layer resident would hold (what the store had when all were added)."""
        return sum(lay.chunks for lay in self._layers.values())

    def lent_chunks(self) -> int:
        return self.total_chunks() - self.held_chunks()

    def copy_bytes_per_s(self) -> float | None:
        """Bandwidth of the finished copies so far (fetches and restores), or None before any."""
        s = self.stats
        return None if s.copy_seconds <= 0 else (s.fetch_bytes + s.restore_bytes) / s.copy_seconds

    def status(self) -> dict:
        s, bandwidth = self.stats, self.copy_bytes_per_s()
        hidden = None if s.copy_seconds <= 0 else max(0.0, 1.0 - s.stall_seconds / s.copy_seconds)
        g = self.pool.chunk_bytes
        return {
            "layers": len(self._layers),
            "resident_layers": len(self._layers) - len(self.streamed()),
            "streamed_layers": len(self.streamed()),
            "slots": len(self._slots),
            "held_bytes": self.held_chunks() * g,
            "lent_bytes": self.lent_chunks() * g,
            "fetches": s.fetches,
            "fetch_bytes": s.fetch_bytes,
            "restores": s.restores,
            "restore_bytes": s.restore_bytes,
            "releases": s.releases,
            "copy_seconds": round(s.copy_seconds, 6),
            "copy_bytes_per_s": None if bandwidth is None else round(bandwidth),
            "stall_seconds": round(s.stall_seconds, 6),
            "stalls": s.stalls,
            "unfetched_waits": s.unfetched_waits,
            "hidden_fraction": None if hidden is None else round(hidden, 4),
        }

    # -------------------------------------------------------------- register
    def add_layer(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Move ``tensors`` into a new resident layer; return views (same shapes/dtypes) to rebind to.

        The bytes are copied in synchronously; the master copy is taken from ``tensors``.
        Raises ``PoolExhausted`` / ``CeilingExceeded`` if the pool cannot hold the layer (nothing
        changes then)."""
        with self._lock:
            self._check_open()
            if key in self._layers:
                raise ValueError(f"layer {key!r} is already in the store")
            tensors = list(tensors)
            if not tensors:
                raise ValueError(f"layer {key!r} has no tensors")
            offsets, nbytes = _packed(tensors)
            g = self.pool.chunk_bytes
            chunks = max(1, -(-nbytes // g))
            vrange = self.backend.reserve(chunks * g)
            try:
                own = self._map_new(vrange, chunks)
            except BaseException:
                self.backend.release(vrange)
                raise
            views = [self.backend.tensor_view(vrange, off, tuple(t.shape), t.dtype) for t, off in zip(tensors, offsets)]
            masters = []
            for t, v in zip(tensors, views):
                master = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
                master.copy_(t.detach())
                v.copy_(master)
                masters.append(master)
            self._layers[key] = _Layer(key, vrange, chunks, nbytes, views, masters, own=own)
            return views

    def _map_new(self, vrange: VirtualRange, n: int, chunks: list[PhysicalChunk] | None = None) -> list[PhysicalChunk]:
        chunks = chunks if chunks is not None else self.pool.acquire(self.owner, n)
        done = 0
        try:
            for i in range(n):
                self.backend.map(vrange, i * self.pool.chunk_bytes, chunks[i])
                done += 1
        except BaseException:
            for i in range(done):
                self.backend.unmap(vrange, i * self.pool.chunk_bytes)
            raise
        return chunks[:n]

    def _unmap(self, lay: _Layer, n: int) -> None:
        for i in range(n):
            self.backend.unmap(lay.vrange, i * self.pool.chunk_bytes)

    def _copy_in(self, lay: _Layer) -> Ticket:
        lay.ticket = self.copier.submit(list(zip(lay.views, lay.masters)))
        return lay.ticket

    def _settle(self, lay: _Layer) -> None:
        """Wait for the last copy into ``lay`` and account its time."""
        t = lay.ticket
        if t is None:
            return
        t.wait()
        if t.seconds is not None:
            self.stats.copy_seconds += t.seconds
        lay.ticket = None

    def measure_copy(self, key: Hashable, repeats: int = 3) -> float:
        """Bytes/s of restoring resident layer ``key`` from its master copy (best of ``repeats``
        synchronous copies through the copier; the bytes are unchanged)."""
        lay = self._layers[key]
        if lay.own is None:
            raise ValueError(f"layer {key!r} is streamed; measure a resident layer")
        best = math.inf
        for _ in range(repeats):
            t = self._copy_in(lay)
            t.wait()
            best = min(best, t.seconds or math.inf)
            lay.ticket = None
        return lay.nbytes / max(best, 1e-9)

    # ------------------------------------------------------- resident set
    def set_streamed(self, streamed: Iterable[Hashable], slots: int) -> dict:
        """Make exactly ``streamed`` stream through ``slots`` staging slots; the rest resident.

        Releases first (their chunks fill the staging slots, the rest go to the pool), then
        restores (chunks reserved beforehand, then from the pool; copies started). A restore the pool cannot back leaves
        that layer streamed (reported under ``not_restored``). Returns what changed."""
        with self._lock:
            self._check_open()
            want = set(streamed)
            unknown = want - self._layers.keys()
            if unknown:
                raise ValueError(f"streamed: unknown layers {sorted(map(str, unknown))}")
            if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
                raise ValueError(f"slots must be a non-negative int, got {slots!r}")
            if want and slots == 0:
                raise ValueError("slots must be >= 1 while any layer is streamed")
            slots = min(slots, len(want))
            spare: list[PhysicalChunk] = self._reserved
            self._reserved = []
            released = []
            for key, lay in self._layers.items():
                if key in want and lay.own is not None:
                    self._settle(lay)
                    self._unmap(lay, lay.chunks)
                    spare += lay.own
                    lay.own = None
                    released.append(key)
                    self.stats.releases += 1
            # staging slots: keep ``slots``, each with slot_chunks chunks (free slots go first)
            need = self.slot_chunks
            while len(self._slots) > slots:
                idx = next((i for i, s in enumerate(self._slots) if s.layer is None), len(self._slots) - 1)
                if self._slots[idx].layer is not None:
                    self.evict(self._slots[idx].layer)
                spare += self._slots.pop(idx).chunks
            while len(self._slots) < slots:
                take = spare[:need]
                spare = spare[need:]
                if len(take) < need:
                    take += self.pool.acquire(self.owner, need - len(take))
                self._slots.append(_Slot(take))
            restored, not_restored = [], []
            for key, lay in self._layers.items():
                if key in want or lay.own is not None:
                    continue
                if lay.slot is not None:
                    self.evict(key)
                take = spare[: lay.chunks]
                if len(take) < lay.chunks:
                    try:
                        take = take + self.pool.acquire(self.owner, lay.chunks - len(take))
                    except Exception:
                        not_restored.append(key)
                        continue
                spare = spare[len(take):]  # fmt: skip
                lay.own = self._map_new(lay.vrange, lay.chunks, take)
                self._copy_in(lay)
                self.stats.restores += 1
                self.stats.restore_bytes += lay.nbytes
                restored.append(key)
            if spare:
                self.pool.release(self.owner, spare)
            return {"released": released, "restored": restored, "not_restored": not_restored}

    # -------------------------------------------------------------- stream
    def fetch(self, key: Hashable) -> bool:
        """Map a free slot behind streamed layer ``key`` and start its copy. False: no free slot
        (or the layer is resident / already fetched)."""
        with self._lock:
            lay = self._layers[key]
            if lay.own is not None or lay.slot is not None:
                return False
            idx = next((i for i, s in enumerate(self._slots) if s.layer is None), None)
            if idx is None:
                return False
            slot = self._slots[idx]
            self._map_new(lay.vrange, lay.chunks, slot.chunks)
            slot.layer, lay.slot = key, idx
            self._copy_in(lay)
            self.stats.fetches += 1
            self.stats.fetch_bytes += lay.nbytes
            return True

    def ensure(self, key: Hashable) -> float:
        """Block until layer ``key``'s bytes are in place; return the stall in seconds.

        A streamed layer that was not fetched is fetched now (a free slot is made by evicting
        another fetched layer if needed) unless the store is ``strict`` (``NotResident``)."""
        with self._lock:
            lay = self._layers[key]
            if lay.own is None and lay.slot is None:
                if self.strict:
                    raise NotResident(f"layer {key!r} is streamed and was not fetched before its forward")
                self.stats.unfetched_waits += 1
                if not self.fetch(key):
                    victim = next(s.layer for s in self._slots if s.layer is not None)
                    self.evict(victim)
                    self.fetch(key)
            t = lay.ticket
            if t is None:
                return 0.0
            t0 = time.perf_counter()
            self._settle(lay)
            stall = time.perf_counter() - t0
            if stall > 1e-4:
                self.stats.stalls += 1
            self.stats.stall_seconds += stall
            return stall

    def evict(self, key: Hashable) -> None:
        """Unmap the slot behind streamed layer ``key`` (after its forward); no-op if none."""
        with self._lock:
            lay = self._layers[key]
            if lay.slot is None:
                return
            self._settle(lay)
            self.copier.fence()  # CUDA: later copies into this slot wait for its readers ...
            self.copier.wait_fence()  # ... and it is unmapped only once they are done
            self._unmap(lay, lay.chunks)
            self._slots[lay.slot].layer = None
            lay.slot = None

    # ------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        with self._lock:
            held = self.pool.usage()[self.owner] if self.owner in self.pool.usage() else 0
            if held != self.held_chunks():
                raise AssertionError(f"pool says {self.owner} holds {held} chunks, the store {self.held_chunks()}")
            for key, lay in self._layers.items():
                mapped = len(self.backend.mapped_slots(lay.vrange))
                expect = lay.chunks if (lay.own is not None or lay.slot is not None) else 0
                if mapped != expect:
                    raise AssertionError(f"layer {key!r}: {mapped} slots mapped, expected {expect}")
                if lay.own is not None and lay.slot is not None:
                    raise AssertionError(f"layer {key!r} is resident and holds slot {lay.slot}")
                if lay.slot is not None and self._slots[lay.slot].layer != key:
                    raise AssertionError(f"layer {key!r} holds slot {lay.slot}, which names another layer")

    # ----------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("WeightStore is closed")

    def close(self) -> None:
        """Unmap and release everything (views become invalid)."""
        with self._lock:
            if self._closed:
                return
            for key, lay in self._layers.items():
                self._settle(lay)
                if lay.slot is not None:
                    self.evict(key)
                if lay.own is not None:
                    self._unmap(lay, lay.chunks)
                    self.pool.release(self.owner, lay.own)
                    lay.own = None
                self.backend.release(lay.vrange)
            for s in self._slots:
                self.pool.release(self.owner, s.chunks)
            self._slots.clear()
            if self._reserved:
                self.pool.release(self.owner, self._reserved)
                self._reserved = []
            self.copier.close()
            self._closed = True
