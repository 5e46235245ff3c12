"""One pool of physical chunks, one owner per chunk: the unified-pool ledger.

Model
-----
A ``ChunkPool`` hands out the granularity-sized ``PhysicalChunk``s of one
``VmmBackend``. Every chunk the pool has created has exactly one ``Owner``;
``Owner.FREE`` holds the chunks nobody uses. Owners are *kinds of use* (KV
cache, activations, weights, chunks donated to a peer, host staging buffers),
not objects: which KV tensor holds a KV chunk is the tensor's business.

Chunks are created **lazily**: ``acquire`` first reuses FREE chunks (most
recently freed first, so warm memory is reused), and creates new chunks only
when FREE is empty, never more than ``capacity_chunks`` in total. ``trim``
destroys idle FREE chunks to give the memory back to the system.

Limits (mechanisms only; a policy chooses the numbers)
------------------------------------------------------
* ``ceilings[o]``: owner ``o`` never holds more than this many chunks
  (``acquire`` and ``transfer`` into ``o`` raise ``CeilingExceeded``).
* ``floors[o]``: a guarantee, not an obligation. Headroom is reserved for
  ``o`` up to its floor: another owner's ``acquire`` is refused
  (``PoolExhausted``) if it would leave fewer free-or-uncreated chunks than
  the owners below their floors still need. ``transfer`` out of ``o`` is
  refused (``FloorViolation``) if it would drop ``o`` below its floor.
  ``release`` by ``o`` itself is always allowed (its headroom stays reserved).

Invariants (``check_invariants``)
---------------------------------
1. Conservation: ``sum(usage().values()) == chunks created - chunks destroyed``
   (the pool's own counters) and ``<= capacity_chunks``.
2. Exclusive ownership: every chunk is in exactly one owner's set.
3. No owner exceeds its ceiling; every pooled chunk is alive in the backend.
4. FREE chunks are mapped nowhere (``release`` refuses mapped chunks, so a
   chunk never changes hands with a stale alias still pointing at it).

All methods are thread-safe (one lock per pool). ``acquire``, ``release`` and
``transfer`` are all-or-nothing: on error nothing has changed hands.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Mapping

from ..vmm.base import PhysicalChunk, VmmBackend


class Owner(enum.Enum):
    FREE = "free"
    KV = "kv"
    ACTIVATION = "activation"
    WEIGHTS = "weights"
    PEER_DONATION = "peer_donation"
    HOST_BUFFER = "host_buffer"

    def __str__(self) -> str:
        return self.name


class PoolError(RuntimeError):
    """Base class of the pool's refusals."""


class PoolExhausted(PoolError):
    """Not enough free (or still uncreated) chunks for an acquire."""

    def __init__(self, owner: Owner, requested: int, available: int, reserved: int, capacity: int):
        self.owner, self.requested, self.available = owner, requested, available
        self.reserved, self.capacity = reserved, capacity
        super().__init__(
            f"pool exhausted: owner {owner} requested {requested} chunk(s), {available} available "
            f"({reserved} more held back for other owners' floors; capacity {capacity})"
        )


class CeilingExceeded(PoolError):
    """The owner would hold more chunks than its ceiling."""

    def __init__(self, owner: Owner, requested: int, held: int, ceiling: int):
        self.owner, self.requested, self.held, self.ceiling = owner, requested, held, ceiling
        super().__init__(
            f"ceiling exceeded: owner {owner} holds {held} chunk(s), requested {requested} more, ceiling {ceiling}"
        )


class FloorViolation(PoolError):
    """A transfer would take an owner below its floor."""

    def __init__(self, owner: Owner, requested: int, held: int, floor: int):
        self.owner, self.requested, self.held, self.floor = owner, requested, held, floor
        super().__init__(
            f"floor violation: owner {owner} holds {held} chunk(s), transfer of {requested} would "
            f"leave it below its floor {floor}"
        )


class OwnershipError(PoolError, ValueError):
    """A chunk is not owned by the owner the caller named (or is not the pool's)."""


def _check_owner(name: str, owner: object, *, allow_free: bool = False) -> Owner:
    if not isinstance(owner, Owner):
        raise TypeError(f"{name} must be an Owner, got {type(owner).__name__}")
    if owner is Owner.FREE and not allow_free:
        raise ValueError(f"{name} must not be Owner.FREE (use acquire/release)")
    return owner


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


class ChunkPool:
    """The ledger of a backend's chunks: who owns each one. See the module docstring."""

    def __init__(
        self,
        backend: VmmBackend,
        capacity_chunks: int,
        floors: Mapping[Owner, int] | None = None,
        ceilings: Mapping[Owner, int] | None = None,
        *,
        create_chunks: bool = True,
    ):
        if not isinstance(backend, VmmBackend):
            raise TypeError(f"backend must be a VmmBackend, got {type(backend).__name__}")
        self._backend = backend
        self._capacity = _check_count("capacity_chunks", capacity_chunks)
        self._floors: dict[Owner, int] = {}
        self._ceilings: dict[Owner, int] = {}
        for label, given, into in (("floors", floors, self._floors), ("ceilings", ceilings, self._ceilings)):
            for owner, n in (given or {}).items():
                _check_owner(f"{label} key", owner)
                into[owner] = _check_count(f"{label}[{owner}]", n)
        for owner, floor in self._floors.items():
            ceiling = self._ceilings.get(owner)
            if ceiling is not None and floor > ceiling:
                raise ValueError(f"floors[{owner}] = {floor} is above ceilings[{owner}] = {ceiling}")
        if sum(self._floors.values()) > self._capacity:
            raise ValueError(f"floors sum to {sum(self._floors.values())}, above capacity_chunks {self._capacity}")
        self._lock = threading.RLock()
        self._held: dict[Owner, dict[int, PhysicalChunk]] = {o: {} for o in Owner}
        self._owner_of: dict[int, Owner] = {}
        self._created = 0
        self._destroyed = 0
        self._creates = bool(create_chunks)

    # ----------------------------------------------------------------- info
    @property
    def backend(self) -> VmmBackend:
        return self._backend

    @property
    def chunk_bytes(self) -> int:
        return self._backend.granularity

    @property
    def capacity_chunks(self) -> int:
        return self._capacity

    def floor(self, owner: Owner) -> int:
        return self._floors.get(owner, 0)

    def ceiling(self, owner: Owner) -> int | None:
        return self._ceilings.get(owner)

    def usage(self) -> dict[Owner, int]:
        """Chunks held by each owner (FREE: created and idle). Every owner is listed."""
        with self._lock:
            return {o: len(h) for o, h in self._held.items()}

    def held_by(self, owner: Owner) -> int:
        """Chunks ``owner`` holds (FREE: created and idle); ``usage()[owner]`` without the others."""
        with self._lock:
            return len(self._held[owner])

    @property
    def chunks_created(self) -> int:
        """Chunks created and not yet destroyed by ``trim`` (the pool's live chunks)."""
        with self._lock:
            return len(self._owner_of)

    @property
    def creates_chunks(self) -> bool:
        """False for a pool that only holds adopted (lent) chunks."""
        return self._creates

    def available(self) -> int:
        """FREE chunks plus chunks that may still be created (none if the pool does not create)."""
        with self._lock:
            creatable = self._capacity - len(self._owner_of) if self._creates else 0
            return len(self._held[Owner.FREE]) + creatable

    def owner_of(self, chunk: PhysicalChunk) -> Owner:
        with self._lock:
            owner = self._owner_of.get(chunk.handle_id)
            if owner is None or self._held[owner].get(chunk.handle_id) is not chunk:
                raise OwnershipError(f"{chunk} does not belong to this pool")
            return owner

    def chunks_of(self, owner: Owner) -> list[PhysicalChunk]:
        with self._lock:
            return list(self._held[_check_owner("owner", owner, allow_free=True)].values())

    def _reserved_for_others(self, owner: Owner) -> int:
        return sum(max(0, f - len(self._held[o])) for o, f in self._floors.items() if o is not owner)

    # ------------------------------------------------------------ mutations
    def acquire(self, owner: Owner, n: int) -> list[PhysicalChunk]:
        """Give ``n`` chunks from FREE (creating them if needed) to ``owner``. All or nothing."""
        _check_owner("owner", owner)
        _check_count("n", n)
        with self._lock:
            held = len(self._held[owner])
            ceiling = self._ceilings.get(owner)
            if ceiling is not None and held + n > ceiling:
                raise CeilingExceeded(owner, n, held, ceiling)
            # The owner's own unmet floor is headroom reserved *for* it: only others' count.
            reserved = self._reserved_for_others(owner)
            available = self.available()
            if n > available - reserved:
                raise PoolExhausted(owner, n, max(0, available - reserved), reserved, self._capacity)
            free = self._held[Owner.FREE]
            while len(free) < n:  # lazy creation; a failure leaves the new chunks in FREE
                chunk = self._backend.create_chunk()
                self._created += 1
                self._owner_of[chunk.handle_id] = Owner.FREE
                free[chunk.handle_id] = chunk
            taken = []
            for _ in range(n):
                hid, chunk = free.popitem()  # LIFO: the most recently freed (warm) chunk first
                self._held[owner][hid] = chunk
                self._owner_of[hid] = owner
                taken.append(chunk)
            return taken

    def _check_held(self, chunks: list[PhysicalChunk], owner: Owner) -> None:
        seen = set()
        for chunk in chunks:
            if not isinstance(chunk, PhysicalChunk):
                raise TypeError(f"chunks must be PhysicalChunks, got {type(chunk).__name__}")
            if chunk.handle_id in seen:
                raise OwnershipError(f"{chunk} is listed twice")
            seen.add(chunk.handle_id)
            actual = self._owner_of.get(chunk.handle_id)
            if actual is None or self._held[actual].get(chunk.handle_id) is not chunk:
                raise OwnershipError(f"{chunk} does not belong to this pool (owner {owner} named)")
            if actual is not owner:
                raise OwnershipError(f"{chunk} is owned by {actual}, not by {owner}")

    def release(self, owner: Owner, chunks: Iterable[PhysicalChunk]) -> None:
        """Return ``owner``'s chunks to FREE. Refused if one is not ``owner``'s or is still mapped."""
        _check_owner("owner", owner)
        chunks = list(chunks)
        with self._lock:
            self._check_held(chunks, owner)
            for chunk in chunks:
                where = self._backend.mappings_of(chunk)
                if where:
                    at = ", ".join(f"{r} offset {o:#x}" for r, o in where)
                    raise OwnershipError(f"owner {owner} cannot release {chunk}: still mapped at {at}")
            for chunk in chunks:
                del self._held[owner][chunk.handle_id]
                self._held[Owner.FREE][chunk.handle_id] = chunk
                self._owner_of[chunk.handle_id] = Owner.FREE

    def transfer(self, chunks: Iterable[PhysicalChunk], src_owner: Owner, dst_owner: Owner) -> None:
        """Move ownership of ``chunks`` from ``src_owner`` to ``dst_owner`` without touching mappings.

        The inflation/deflation primitive: the chunks stay mapped wherever they
        are; the caller remaps (or not). Respects ``src_owner``'s floor and
        ``dst_owner``'s ceiling.
        """
        _check_owner("src_owner", src_owner)
        _check_owner("dst_owner", dst_owner)
        if src_owner is dst_owner:
            raise ValueError(f"src_owner and dst_owner are both {src_owner}")
        chunks = list(chunks)
        with self._lock:
            self._check_held(chunks, src_owner)
            n = len(chunks)
            src_held, dst_held = len(self._held[src_owner]), len(self._held[dst_owner])
            floor = self._floors.get(src_owner, 0)
            if src_held - n < floor:
                raise FloorViolation(src_owner, n, src_held, floor)
            ceiling = self._ceilings.get(dst_owner)
            if ceiling is not None and dst_held + n > ceiling:
                raise CeilingExceeded(dst_owner, n, dst_held, ceiling)
            for chunk in chunks:
                del self._held[src_owner][chunk.handle_id]
                self._held[dst_owner][chunk.handle_id] = chunk
                self._owner_of[chunk.handle_id] = dst_owner

    def adopt(self, chunks: Iterable[PhysicalChunk]) -> None:
        """Put chunks created elsewhere (alive in this pool's backend) into FREE. All or nothing."""
        chunks = list(chunks)
        with self._lock:
            live = {c.handle_id for c in self._backend.live_chunks()}
            seen = set()
            for chunk in chunks:
                if not isinstance(chunk, PhysicalChunk):
                    raise TypeError(f"chunks must be PhysicalChunks, got {type(chunk).__name__}")
                if chunk.handle_id in self._owner_of or chunk.handle_id in seen:
                    raise OwnershipError(f"{chunk} is already in this pool")
                if chunk.handle_id not in live:
                    raise OwnershipError(f"{chunk} is not alive in this pool's backend")
                seen.add(chunk.handle_id)
            if len(self._owner_of) + len(chunks) > self._capacity:
                raise PoolError(
                    f"adopting {len(chunks)} chunk(s) would exceed capacity_chunks "
                    f"{self._capacity} ({len(self._owner_of)} in the pool)"
                )
            for chunk in chunks:
                self._held[Owner.FREE][chunk.handle_id] = chunk
                self._owner_of[chunk.handle_id] = Owner.FREE
                self._created += 1

    def disown(self, max_chunks: int | None = None) -> list[PhysicalChunk]:
        """Take up to ``max_chunks`` (default: all) FREE chunks out of the ledger, undestroyed.

        The caller now owns them (to hand back to their lender). Coldest first.
        """
        with self._lock:
            free = self._held[Owner.FREE]
            n = len(free) if max_chunks is None else min(_check_count("max_chunks", max_chunks), len(free))
            out = []
            for _ in range(n):
                hid, chunk = next(iter(free.items()))
                del free[hid], self._owner_of[hid]
                self._destroyed += 1
                out.append(chunk)
            return out

    def trim(self, max_chunks: int | None = None) -> int:
        """Destroy up to ``max_chunks`` (default: all) FREE chunks; return how many."""
        with self._lock:
            free = self._held[Owner.FREE]
            n = len(free) if max_chunks is None else min(_check_count("max_chunks", max_chunks), len(free))
            for _ in range(n):
                hid, chunk = next(iter(free.items()))  # oldest (coldest) first
                self._backend.destroy_chunk(chunk)
                del free[hid], self._owner_of[hid]
                self._destroyed += 1
            return n

    def close(self) -> None:
        """Destroy every FREE chunk. Refused (naming owners) while any chunk is still owned."""
        with self._lock:
            owned = {o: len(h) for o, h in self._held.items() if o is not Owner.FREE and h}
            if owned:
                held = ", ".join(f"{o}: {n}" for o, n in owned.items())
                raise PoolError(f"cannot close the pool: chunks still owned ({held})")
            self.trim()

    def add_capacity(self, chunks: int) -> None:
        """Raise ``capacity_chunks`` by ``chunks`` (a second KV space of the same server joins its
        own pool: a hybrid sliding-window model's two sub-pools). Never lowers it."""
        n = _check_count("chunks", chunks)
        with self._lock:
            self._capacity += n

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant (see the module docstring)."""
        with self._lock:
            total = sum(len(h) for h in self._held.values())
            live = self._created - self._destroyed
            if not (total == len(self._owner_of) == live):
                raise AssertionError(
                    f"conservation: owners hold {total} chunk(s), ledger has {len(self._owner_of)}, "
                    f"created - destroyed = {live}"
                )
            if live > self._capacity:
                raise AssertionError(f"conservation: {live} live chunks above capacity {self._capacity}")
            backend_live = {c.handle_id for c in self._backend.live_chunks()}
            for owner, held in self._held.items():
                for hid, chunk in held.items():
                    if self._owner_of.get(hid) is not owner:
                        raise AssertionError(
                            f"exclusive ownership: {chunk} in {owner}'s set but ledger says {self._owner_of.get(hid)}"
                        )
                    if hid not in backend_live:
                        raise AssertionError(f"{chunk} held by {owner} was destroyed in the backend")
                    if owner is Owner.FREE and self._backend.mappings_of(chunk):
                        raise AssertionError(f"{chunk} is FREE but still mapped")
                ceiling = self._ceilings.get(owner)
                if ceiling is not None and len(held) > ceiling:
                    raise AssertionError(f"owner {owner} holds {len(held)} above its ceiling {ceiling}")

    def __repr__(self) -> str:
        use = ", ".join(f"{o}={n}" for o, n in self.usage().items() if n)
        return f"ChunkPool(capacity={self._capacity}, {use or 'empty'})"
