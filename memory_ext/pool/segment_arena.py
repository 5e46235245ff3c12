"""SegmentArena: activation memory from pool chunks behind a caching allocator's segment calls.

torch's caching allocator asks its backing allocator for large *segments* and
carves tensors out of them itself. On CUDA, ``mempool()`` plugs this arena in
as that backing allocator (``CUDAPluggableAllocator`` + ``torch.cuda.MemPool``),
so the tensors a forward allocates inside ``torch.cuda.use_mem_pool`` live in
chunks that the pool accounts to ``Owner.ACTIVATION``.

Model
-----
* One virtual range of ``capacity`` bytes (a whole number of chunks) is
  reserved once. Its low part ``[0, limit)`` is mapped: ``grow(chunks)`` maps
  the given chunks (already acquired by the caller) at the top and raises the
  limit; ``shrink(n)`` lowers the limit over idle chunks and returns their
  chunks, unmapped, to the caller. Which chunks, and how many, is the caller's
  (the balloon's) policy; the arena never touches the ``ChunkPool``.
* Segment placement happens in C (``segment_arena.c``): best fit below the
  limit, no Python and no driver call on that path, so the allocator never
  waits for the GIL while torch holds its allocator lock.
* A segment that does not fit below the limit comes from the overflow
  allocator (``cuMemAlloc_v2`` on CUDA: ordinary device memory, as stock torch
  would use) and is counted (``overflow_allocs``); with none set it fails and
  torch reports out-of-memory.
* ``shrink`` never unmaps below the highest live segment (the C side refuses
  to lower the limit under one), so a tensor's memory is never unmapped.

The C state is per process (torch's pluggable allocator passes no context),
so one arena may be open at a time. The shared library is compiled from the C
source on first use with the system C compiler (``$CC``, else ``cc``) into
``$SGLANG_MEMX_HOME/arena`` (default ``~/.cache/sglang-memx/arena``) and reused.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..vmm import PhysicalChunk, VmmBackend

SOURCE = Path(__file__).with_name("segment_arena.c")
ALLOC_SYMBOL = "memx_arena_alloc"
FREE_SYMBOL = "memx_arena_free"
STAT_NAMES = (
    "allocs",
    "frees",
    "live_segments",
    "live_bytes",
    "overflow_allocs",
    "overflow_live_bytes",
    "failed_allocs",
    "bad_frees",
    "peak_bytes",
    "syncs",
)
MAX_SEGMENTS = 1 << 16

_library: ctypes.CDLL | None = None
_library_lock = threading.Lock()
_open_arena: SegmentArena | None = None


class ArenaBuildError(OSError):
    """The arena's shared library could not be compiled or loaded."""


def _cache_dir() -> Path:
    home = os.environ.get("SGLANG_MEMX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-memx")
    return Path(home) / "arena"


def library_path() -> Path:
    """Compile ``segment_arena.c`` once (keyed by its hash and the compiler) and return the .so path."""
    cc = os.environ.get("CC") or "cc"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + cc.encode()).hexdigest()[:16]
    target = _cache_dir() / f"libmemx_segment_arena-{key}.so"
    if target.exists():
        return target
    if shutil.which(cc) is None:
        raise ArenaBuildError(f"no C compiler: {cc!r} is not on PATH (set $CC); the activation arena needs one")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(out), str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ArenaBuildError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent builder sees a whole file or none
    return target


def load_library() -> ctypes.CDLL:
    global _library
    with _library_lock:
        if _library is None:
            lib = ctypes.CDLL(str(library_path()))
            u64, vp = ctypes.c_uint64, ctypes.c_void_p
            lib.memx_arena_init.argtypes = [u64, u64, u64, u64, vp, vp, vp]
            lib.memx_arena_init.restype = ctypes.c_int
            lib.memx_arena_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, vp]
            lib.memx_arena_alloc.restype = vp
            lib.memx_arena_free.argtypes = [vp, ctypes.c_size_t, ctypes.c_int, vp]
            lib.memx_arena_free.restype = None
            lib.memx_arena_set_limit.argtypes = [u64]
            lib.memx_arena_set_limit.restype = ctypes.c_int64
            lib.memx_arena_high_water.argtypes = []
            lib.memx_arena_high_water.restype = u64
            lib.memx_arena_mark_synced.argtypes = []
            lib.memx_arena_mark_synced.restype = None
            lib.memx_arena_stats.argtypes = [ctypes.POINTER(u64)]
            lib.memx_arena_stats.restype = ctypes.c_int
            _library = lib
        return _library


def cuda_driver_hooks() -> dict[str, int]:
    """Addresses of ``cuMemAlloc_v2``, ``cuMemFree_v2`` and ``cuCtxSynchronize`` in libcuda."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise ArenaBuildError(f"libcuda.so.1 cannot be loaded: {exc}") from None
    return {
        name: ctypes.cast(getattr(cuda, sym), ctypes.c_void_p).value
        for name, sym in (
            ("overflow_alloc", "cuMemAlloc_v2"),
            ("overflow_free", "cuMemFree_v2"),
            ("sync", "cuCtxSynchronize"),
        )
    }


class SegmentArena:
    """See the module docstring. ``grow``/``shrink`` are serialised by a Python lock."""

    def __init__(
        self,
        backend: VmmBackend,
        capacity_chunks: int,
        *,
        overflow_alloc: int | None = None,
        overflow_free: int | None = None,
        sync: int | None = None,
        align: int = 512,
        release_interval_s: float = 1.0,
    ):
        global _open_arena
        if isinstance(capacity_chunks, bool) or not isinstance(capacity_chunks, int) or capacity_chunks <= 0:
            raise ValueError(f"capacity_chunks must be a positive int, got {capacity_chunks!r}")
        if (overflow_alloc is None) != (overflow_free is None):
            raise ValueError("overflow_alloc and overflow_free go together: give both or neither")
        self._lib = load_library()
        self.backend = backend
        self.chunk_bytes = backend.granularity
        self.capacity_chunks = capacity_chunks
        self._lock = threading.Lock()
        self._chunks: list[PhysicalChunk] = []  # chunk mapped at slot i
        self._sync = ctypes.CFUNCTYPE(ctypes.c_int)(sync) if sync else None
        self.release_interval_s = release_interval_s
        self._last_release = float("-inf")
        self.releases = 0
        with _library_lock:
            if _open_arena is not None:
                raise RuntimeError(
                    "a SegmentArena is already open in this process (the C allocator state "
                    "is per process); close it first"
                )
            self.vrange = backend.reserve(capacity_chunks * self.chunk_bytes)
            rc = self._lib.memx_arena_init(
                self.vrange.base, self.vrange.size, align, MAX_SEGMENTS, overflow_alloc, overflow_free, sync
            )
            if rc != 0:
                backend.release(self.vrange)
                raise RuntimeError(
                    "memx_arena_init refused: segments of a previous arena are still live"
                    if rc == -1
                    else f"memx_arena_init: bad arguments (align {align})"
                )
            _open_arena = self
        self._closed = False

    # ------------------------------------------------------------------ info
    @property
    def mapped_chunks(self) -> int:
        return len(self._chunks)

    @property
    def limit_bytes(self) -> int:
        return len(self._chunks) * self.chunk_bytes

    def pinned_chunks(self) -> int:
        """Chunks under the highest live segment: what ``shrink`` cannot take now."""
        return -(-int(self._lib.memx_arena_high_water()) // self.chunk_bytes)

    def stats(self) -> dict[str, int]:
        raw = (ctypes.c_uint64 * 16)()
        n = self._lib.memx_arena_stats(raw)
        return {name: int(raw[i]) for i, name in enumerate(STAT_NAMES[:n])}

    def contains(self, address: int) -> bool:
        return self.vrange.base <= address < self.vrange.end

    # ------------------------------------------------------------- mutations
    def grow(self, chunks: Sequence[PhysicalChunk]) -> None:
        """Map ``chunks`` at the top of the mapped part and raise the limit over them (all or nothing)."""
        with self._lock:
            self._check_open()
            chunks = list(chunks)
            if len(self._chunks) + len(chunks) > self.capacity_chunks:
                raise ValueError(
                    f"grow by {len(chunks)} chunk(s) exceeds the arena's capacity "
                    f"({len(self._chunks)} of {self.capacity_chunks} mapped)"
                )
            done = 0
            try:
                for chunk in chunks:
                    self.backend.map(self.vrange, (len(self._chunks) + done) * self.chunk_bytes, chunk)
                    done += 1
            except BaseException:
                for i in range(done):
                    self.backend.unmap(self.vrange, (len(self._chunks) + i) * self.chunk_bytes)
                raise
            self._chunks.extend(chunks)
            if self._lib.memx_arena_set_limit(self.limit_bytes) < 0:  # cannot happen: the limit only rises
                raise RuntimeError("memx_arena_set_limit refused to raise the limit")

    def shrink(self, n: int, release_cached: Callable[[], None] | None = None) -> list[PhysicalChunk]:
        """Unmap up to ``n`` chunks from the top, never under a live segment; return them.

        ``release_cached`` (``ArenaMemPool.release_cached`` on CUDA) runs first when the
        top is pinned, so that segments torch caches but no tensor uses come back; at
        most once per ``release_interval_s``, since a tensor that lives on pins the top
        however often the cache is emptied.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        with self._lock:
            self._check_open()
            if n == 0 or not self._chunks:
                return []
            now = time.monotonic()
            if (
                release_cached is not None
                and len(self._chunks) - self.pinned_chunks() < n
                and now - self._last_release >= self.release_interval_s
            ):
                self._last_release = now
                self.releases += 1
                frees = self.stats()["frees"]
                release_cached()
                if self._sync is not None and self.stats()["frees"] != frees:
                    self._sync()  # here, so that the next segment alloc inside a forward need not
                    self._lib.memx_arena_mark_synced()
            keep = max(len(self._chunks) - n, self.pinned_chunks())
            if keep >= len(self._chunks):
                return []
            if self._lib.memx_arena_set_limit(keep * self.chunk_bytes) < 0:
                return []  # a segment landed above `keep` meanwhile; nothing was unmapped
            for slot in range(len(self._chunks) - 1, keep - 1, -1):
                self.backend.unmap(self.vrange, slot * self.chunk_bytes)
            give, self._chunks = self._chunks[keep:], self._chunks[:keep]
            return give

    def close(self) -> list[PhysicalChunk]:
        """Unmap every chunk and release the range; return the chunks. Refused while segments are live."""
        global _open_arena
        with self._lock:
            if self._closed:
                return []
            stats = self.stats()
            if stats["live_segments"] or stats["overflow_live_bytes"]:
                raise RuntimeError(
                    f"{stats['live_segments']} arena segment(s) and "
                    f"{stats['overflow_live_bytes']} overflow byte(s) are still live; "
                    f"free them (torch.cuda.empty_cache) before closing"
                )
            self._lib.memx_arena_set_limit(0)
            for slot in range(len(self._chunks) - 1, -1, -1):
                self.backend.unmap(self.vrange, slot * self.chunk_bytes)
            give, self._chunks = self._chunks, []
            self.backend.release(self.vrange)
            self._closed = True
        with _library_lock:
            if _open_arena is self:
                _open_arena = None
        return give

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SegmentArena is closed")


class ArenaMemPool:
    """A ``torch.cuda.MemPool`` whose segments come from the open ``SegmentArena`` (CUDA only).

    ``use()`` routes the calling thread's CUDA allocations to it. A live MemPool
    keeps the segments it caches even through ``torch.cuda.empty_cache()``, so
    ``release_cached()`` swaps in a fresh MemPool over the same allocator and drops
    the old one: its cached segments go back to the arena, while segments still
    under live tensors stay until those tensors are freed. Call it outside ``use()``.
    """

    def __init__(self):
        import torch

        self._torch = torch
        # one allocator object for the process: every MemPool made here points at it
        self._allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library_path()), ALLOC_SYMBOL, FREE_SYMBOL)
        self.pool = torch.cuda.MemPool(self._allocator.allocator())
        self.rotations = 0

    def use(self):
        return self._torch.cuda.use_mem_pool(self.pool)

    def release_cached(self) -> None:
        old, self.pool = self.pool, self._torch.cuda.MemPool(self._allocator.allocator())
        del old
        self._torch.cuda.empty_cache()
        self.rotations += 1
