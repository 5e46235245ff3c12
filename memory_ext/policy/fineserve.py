"""FineServe decision logic (F1-F4) as plain objects: numbers in, decisions out.

Source: the FineServe paper (KV slab, two-level scheduler), sections 3.2, 5,
6.2 (Algorithm 1, Eq. 3) and 6.3 (Algorithm 2). Nothing here allocates or
maps memory, touches tensors or imports an engine; only stdlib is used.

F2  token / block sizes:   ``KVPrecision``, ``KVLayout``, ``token_kv_bytes``,
                           ``token_qparam_bytes``, ``kv_block_bytes``
F1  slab arithmetic:       ``slab_bytes``, ``blocks_per_slab``,
                           ``engine_block_id``, ``split_engine_block_id``;
                           ``SlabTable`` (the slab table of §5.2: FREE /
                           PARTIAL / FULL slabs keyed by block format)
F1+F2 on a pool of units:  ``kv_row_bytes``, ``slab_tokens``, ``SlabFormat``,
                           ``slab_format``, ``uniform_slab_units`` (memx's
                           slab: whole common units formatted for one model)
F3  global placement:      ``ModelDemand``, ``GpuCandidate``,
                           ``placement_score``, ``place_models``;
                           sizes to demands: ``base_footprint``,
                           ``model_demand``, ``smallest_batch_for_rate``;
                           pinned models + Alg. 1: ``place_with_pins``
Static* baseline (§7.1):   ``static_partition``
F4  local batching:        ``Request``, ``ChunkedPrefillModel``,
                           ``adaptive_batch``

Readings of the paper where it is not explicit are marked "READING:".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ._checks import check_int as _int

__all__ = [
    "KVPrecision",
    "FP16",
    "BF16",
    "FP8",
    "INT4",
    "precision_by_name",
    "KVLayout",
    "token_kv_bytes",
    "token_qparam_bytes",
    "kv_block_bytes",
    "slab_bytes",
    "blocks_per_slab",
    "engine_block_id",
    "split_engine_block_id",
    "SlabTable",
    "kv_row_bytes",
    "slab_tokens",
    "SlabFormat",
    "slab_format",
    "uniform_slab_units",
    "ModelDemand",
    "GpuCandidate",
    "CandidateScore",
    "PlacementResult",
    "PlacementInfeasible",
    "placement_score",
    "place_models",
    "base_footprint",
    "model_demand",
    "smallest_batch_for_rate",
    "PinnedPlacement",
    "place_with_pins",
    "static_partition",
    "Request",
    "ChunkedPrefillModel",
    "BatchDecision",
    "adaptive_batch",
]


# ---------------------------------------------------------------- validation


def _num(name: str, value, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None:
        if strict and not value > minimum:
            raise ValueError(f"{name} must be > {minimum}, got {value}")
        if not strict and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _name(name: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")
    return value


# ------------------------------------------------------- F2: precision sizes


@dataclass(frozen=True)
class KVPrecision:
    """Storage precision of the KV cache.

    ``bytes_per_elem`` is the paper's bytes(precision) (FP16 = 2, INT4 = 0.5).
    ``scale_bytes`` / ``zero_point_bytes`` are the per-token quantisation
    parameters, counted per token, per KV head on this rank, for K and for V
    separately (so a token carries ``heads_per_rank * 2 * (scale + zero)``
    parameter bytes per layer).
    """

    name: str
    bytes_per_elem: float
    scale_bytes: int = 0
    zero_point_bytes: int = 0

    def __post_init__(self):
        _name("name", self.name)
        _num("bytes_per_elem", self.bytes_per_elem, 0.0, strict=True)
        _int("scale_bytes", self.scale_bytes, 0)
        _int("zero_point_bytes", self.zero_point_bytes, 0)

    @property
    def qparam_bytes_per_head(self) -> int:
        return self.scale_bytes + self.zero_point_bytes


# READING: the paper gives no sizes for the quantisation parameters. It says
# only that KV-quantised models "e.g. QoQ" store per-token parameters such as
# scaling factors in each block, and (Fig. 5) that the FP8 model's token is
# half the FP16 token. We therefore take:
#   FP8 (W8A8KV8): 1 byte/elem, per-tensor static scale held outside the KV
#       blocks -> 0 per-token bytes (matches "half token size" of Fig. 5).
#       A per-token FP8 scheme is expressible as
#       KVPrecision("fp8", 1, scale_bytes=4) (one fp32 scale per head, K and V).
#   INT4 (QoQ KV4): 0.5 byte/elem, asymmetric per-token per-head quantisation
#       with one FP16 scale + one FP16 zero point for K and for V -> 4 bytes
#       per head per K/V per token.
FP16 = KVPrecision("fp16", 2)
BF16 = KVPrecision("bf16", 2)
FP8 = KVPrecision("fp8", 1)
INT4 = KVPrecision("int4", 0.5, scale_bytes=2, zero_point_bytes=2)

_PRESETS = {p.name: p for p in (FP16, BF16, FP8, INT4)}


def precision_by_name(name: str) -> KVPrecision:
    try:
        return _PRESETS[str(name).lower()]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(_PRESETS)}, got {name!r}") from None


@dataclass(frozen=True)
class KVLayout:
    """KV geometry of one model instance on one rank.

    READING: the paper's "#Heads" is the number of *KV* heads (what the cache
    stores; for GQA models such as Llama-3-8B that is 8, not 32). If TP
    exceeds the KV heads and is a multiple of them, engines replicate KV heads
    so each rank holds one; any other non-divisible pairing is rejected.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp: int = 1
    precision: KVPrecision = FP16

    def __post_init__(self):
        _int("num_layers", self.num_layers, 1)
        _int("num_kv_heads", self.num_kv_heads, 1)
        _int("head_dim", self.head_dim, 1)
        _int("tp", self.tp, 1)
        if not isinstance(self.precision, KVPrecision):
            raise ValueError(f"precision must be a KVPrecision, got {self.precision!r}")
        if self.num_kv_heads % self.tp and self.tp % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) and tp ({self.tp}) must divide one another")
        raw = self.heads_per_rank * self.head_dim * 2 * self.precision.bytes_per_elem
        if raw != int(raw):
            raise ValueError(
                f"precision bytes_per_elem {self.precision.bytes_per_elem} gives a "
                f"fractional token size {raw} for head_dim {self.head_dim}"
            )

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)


def _layers(layout: KVLayout, per_layer: bool) -> int:
    if not isinstance(per_layer, bool):
        raise ValueError(f"per_layer must be a bool, got {per_layer!r}")
    return 1 if per_layer else layout.num_layers


def token_kv_bytes(layout: KVLayout, per_layer: bool = True) -> int:
    """Paper's TokenSize = heads/TP x head_dim x 2 (K,V) x bytes(precision).

    The paper's formula has no layer factor, so ``per_layer=True`` (default)
    returns exactly it; ``per_layer=False`` multiplies by ``num_layers``.
    Excludes quantisation parameters (see ``token_qparam_bytes``).
    """
    per = layout.heads_per_rank * layout.head_dim * 2 * layout.precision.bytes_per_elem
    return int(per) * _layers(layout, per_layer)


def token_qparam_bytes(layout: KVLayout, per_layer: bool = True) -> int:
    """Per-token quantisation-parameter bytes (K and V, every head on the rank)."""
    per = layout.heads_per_rank * 2 * layout.precision.qparam_bytes_per_head
    return per * _layers(layout, per_layer)


def kv_block_bytes(layout: KVLayout, tokens_per_block: int, per_layer: bool = True) -> int:
    """KVblocksize = TokensPerBlock x TokenSize + Quant.Params.

    READING: Quant.Params are per token, so Quant.Params = TokensPerBlock x
    ``token_qparam_bytes``; no per-block constant is assumed.
    """
    _int("tokens_per_block", tokens_per_block, 1)
    return tokens_per_block * (token_kv_bytes(layout, per_layer) + token_qparam_bytes(layout, per_layer))


# --------------------------------------------------------- F1: slab numbers


def slab_bytes(block_sizes: Iterable[int], min_slab_bytes: int = 0) -> int:
    """Uniform slab size for one GPU.

    The paper: a multiple of the LCM of the co-located models' KV block sizes.
    READING: we take the *smallest* such multiple that is >= ``min_slab_bytes``
    (and at least one LCM).
    """
    sizes = list(block_sizes) if block_sizes is not None else []
    if not sizes:
        raise ValueError("block_sizes must name at least one block size")
    for i, s in enumerate(sizes):
        _int(f"block_sizes[{i}]", s, 1)
    _int("min_slab_bytes", min_slab_bytes, 0)
    lcm = 1
    for s in sizes:
        lcm = lcm * s // math.gcd(lcm, s)
    k = max(1, -(-min_slab_bytes // lcm))
    return k * lcm


def blocks_per_slab(slab_size: int, block_size: int) -> int:
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


# -------------------------------------- F1 + F2 on a pool of common units


def kv_row_bytes(layout: KVLayout) -> tuple[int, ...]:
    """Bytes of one token's row in each per-layer buffer: K of every layer, then
    V of every layer (how engines lay KV out). A row holds the rank's KV heads
    and, READING, their per-token quantisation parameters inline, so the rows
    add up to ``token_kv_bytes + token_qparam_bytes`` over all layers (F2)."""
    half = layout.heads_per_rank * layout.head_dim * layout.precision.bytes_per_elem
    if half != int(half):
        raise ValueError(f"precision bytes_per_elem {layout.precision.bytes_per_elem} gives a fractional K row {half}")
    row = int(half) + layout.heads_per_rank * layout.precision.qparam_bytes_per_head
    return (row,) * (2 * layout.num_layers)


def slab_tokens(row_bytes: Sequence[int], unit_bytes: int, page_tokens: int = 1) -> int:
    """F1's LCM rule where the common unit is a pool chunk: the fewest tokens, a
    multiple of ``page_tokens``, whose rows fill a whole number of units in
    every buffer (``tokens * row_bytes[i] % unit_bytes == 0`` for all i). A slab
    of that many tokens wastes no byte of its units and shares none."""
    _int("unit_bytes", unit_bytes, 1)
    tokens = _int("page_tokens", page_tokens, 1)
    rows = list(row_bytes)
    if not rows:
        raise ValueError("row_bytes must list at least one buffer")
    for i, rb in enumerate(rows):
        _int(f"row_bytes[{i}]", rb, 1)
        per_buffer = unit_bytes // math.gcd(unit_bytes, rb)  # tokens that fill whole units of this buffer
        tokens = tokens * per_buffer // math.gcd(tokens, per_buffer)
    return tokens


@dataclass(frozen=True)
class SlabFormat:
    """A slab formatted for one model's KV cell on a pool of ``unit_bytes`` units.

    ``tokens_per_slab`` tokens of every per-layer buffer (``row_bytes``) in
    ``slab_units`` whole units; a block is a page of ``page_tokens`` tokens
    (``block_bytes``), so ``blocks_per_slab`` pages per slab. ``waste_bytes``
    is what the slab's units hold beyond its tokens' rows (internal
    fragmentation of the format; 0 under ``slab_tokens``' rule).
    """

    key: str
    unit_bytes: int
    page_tokens: int
    row_bytes: tuple[int, ...]
    tokens_per_slab: int
    slab_units: int

    @property
    def bytes_per_token(self) -> int:
        return sum(self.row_bytes)

    @property
    def slab_bytes(self) -> int:
        return self.slab_units * self.unit_bytes

    @property
    def waste_bytes(self) -> int:
        return self.slab_bytes - self.tokens_per_slab * self.bytes_per_token

    @property
    def block_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token

    @property
    def blocks_per_slab(self) -> int:
        return self.tokens_per_slab // self.page_tokens


def slab_format(key: str, row_bytes: Sequence[int], unit_bytes: int, page_tokens: int = 1) -> SlabFormat:
    """The ``SlabFormat`` of a model whose buffers have ``row_bytes`` per token,
    sized by ``slab_tokens`` (each buffer's share rounded up to whole units,
    which under that rule rounds nothing)."""
    _name("key", key)
    tokens = slab_tokens(row_bytes, unit_bytes, page_tokens)
    units = sum(-(-tokens * rb // unit_bytes) for rb in row_bytes)
    return SlabFormat(key, unit_bytes, page_tokens, tuple(int(r) for r in row_bytes), tokens, units)


def uniform_slab_units(slab_units: Iterable[int]) -> int:
    """FineServe's literal slab for a co-located set: one size for every model,
    the LCM of their slabs' sizes in units (``SlabFormat.slab_units``), so each
    uniform slab holds whole slabs of any of them. memx does not need it (any
    unit serves any model's slab, see docs/memory-pool.md); it is reported to
    show the granularity it would impose."""
    units = list(slab_units)
    if not units:
        raise ValueError("slab_units must name at least one slab size")
    lcm = 1
    for i, u in enumerate(units):
        _int(f"slab_units[{i}]", u, 1)
        lcm = lcm * u // math.gcd(lcm, u)
    return lcm


# ----------------------------------------------------- F3: global placement


@dataclass(frozen=True)
class ModelDemand:
    """A model instance to place. ``base_footprint`` is F_M (bytes: weights +
    profiled average activations + KV); ``mu`` its profiled marginal memory
    efficiency (generated tokens per byte of extra KV, any consistent unit).
    DP replicas are passed as separate ModelDemand entries (paper §6.2)."""

    name: str
    base_footprint: float
    mu: float

    def __post_init__(self):
        _name("name", self.name)
        _num("base_footprint", self.base_footprint, 0.0)
        _num("mu", self.mu, 0.0)


@dataclass(frozen=True)
class GpuCandidate:
    """A placement candidate (one GPU, or one TP group); ``total_memory`` = T_G."""

    name: str
    total_memory: float

    def __post_init__(self):
        _name("name", self.name)
        _num("total_memory", self.total_memory, 0.0, strict=True)


@dataclass(frozen=True)
class CandidateScore:
    gpu: str
    feasible: bool
    k_rem: float  # K_rem(G') after charging M
    mean_mu: float  # mean mu over G'
    score: float  # mean_mu * k_rem, or -inf when infeasible


@dataclass(frozen=True)
class PlacementResult:
    order: tuple[str, ...]  # models in placement order (F_M desc)
    assignment: dict[str, str]  # model -> gpu, placed models only
    residents: dict[str, tuple[str, ...]]  # gpu -> models, in placement order
    k_rem: dict[str, float]  # gpu -> contested memory left
    unplaced: tuple[str, ...]  # models no candidate could hold
    scores: dict[str, tuple[CandidateScore, ...]] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return not self.unplaced

    def raise_if_infeasible(self) -> PlacementResult:
        if self.unplaced:
            raise PlacementInfeasible(self.unplaced)
        return self


class PlacementInfeasible(RuntimeError):
    def __init__(self, unplaced: Sequence[str]):
        self.unplaced = tuple(unplaced)
        super().__init__(f"no candidate GPU can hold base footprint of: {', '.join(self.unplaced)}")


MuFn = Callable[[str, tuple[str, ...]], float]
_NO_GROUP = object()  # the spread group of an instance that has none (equal to nothing)


def placement_score(
    total_memory: float,
    resident_footprints: Sequence[float],
    resident_mus: Sequence[float],
    new_footprint: float,
    new_mu: float,
) -> tuple[bool, float, float, float]:
    """Eq. 3 for one candidate: returns (feasible, k_rem, mean_mu, score).

    score(G|M) = (1/|G'|) * sum_{m in G'} mu_m * K_rem(G'), where G' = G + M
    and K_rem(G') = T_G - sum_{m in G'} F_m.

    READING: Alg. 1 line 5 writes K_rem(G) over the current residents, but
    Eq. 3 and its text use K_rem(G') "after charging base footprints"; we
    follow Eq. 3 (M's own F_M is charged). A candidate whose K_rem(G') < 0
    is infeasible (the paper requires placements within memory budgets);
    K_rem(G') == 0 is feasible with score 0.
    """
    _num("total_memory", total_memory, 0.0, strict=True)
    _num("new_footprint", new_footprint, 0.0)
    _num("new_mu", new_mu, 0.0)
    if len(resident_footprints) != len(resident_mus):
        raise ValueError("resident_footprints and resident_mus must have equal length")
    fs = [_num("resident_footprints", f, 0.0) for f in resident_footprints] + [new_footprint]
    mus = [_num("resident_mus", m, 0.0) for m in resident_mus] + [new_mu]
    k_rem = total_memory - sum(fs)
    mean_mu = sum(mus) / len(mus)
    if k_rem < 0:
        return False, k_rem, mean_mu, -math.inf
    return True, k_rem, mean_mu, mean_mu * k_rem


def place_models(
    models: Sequence[ModelDemand],
    gpus: Sequence[GpuCandidate],
    mu_fn: MuFn | None = None,
    spread: Mapping[str, Hashable] | None = None,
) -> PlacementResult:
    """Algorithm 1. Models sorted by F_M descending (ties keep input order);
    each goes to the feasible candidate with the highest Eq. 3 score (ties go
    to the earlier candidate in ``gpus``). A model no candidate can hold is
    listed in ``unplaced`` and placement continues with the next model.

    ``mu_fn(model_name, group_names)`` may supply mu_m(G') when the profile
    depends on the co-located set; otherwise each model's ``mu`` is used.

    ``spread`` (instance name -> group, e.g. the DP replicas of one model, which
    §6.2 places as separate instances): a feasible candidate holding no instance
    of the same group beats one that does, whatever their scores; among equals
    Eq. 3 decides. With one candidate, or when every feasible candidate already
    holds a sibling, replicas co-locate. Instances not in ``spread`` are unaffected.
    """
    models = list(models)
    gpus = list(gpus)
    if not gpus:
        raise ValueError("gpus must name at least one candidate")
    for m in models:
        if not isinstance(m, ModelDemand):
            raise ValueError(f"models must hold ModelDemand, got {m!r}")
    for g in gpus:
        if not isinstance(g, GpuCandidate):
            raise ValueError(f"gpus must hold GpuCandidate, got {g!r}")
    if len({m.name for m in models}) != len(models):
        raise ValueError("models names must be unique")
    if len({g.name for g in gpus}) != len(gpus):
        raise ValueError("gpus names must be unique")

    by_name = {m.name: m for m in models}
    spread = dict(spread or {})

    def apart(name: str, gpu: str) -> bool:
        """True when ``gpu`` holds no other instance of ``name``'s spread group."""
        if name not in spread:
            return True
        return all(spread.get(r, _NO_GROUP) != spread[name] for r in residents[gpu])

    def mu_of(name: str, group: tuple[str, ...]) -> float:
        if mu_fn is None:
            return by_name[name].mu
        return _num(f"mu_fn({name!r})", mu_fn(name, group), 0.0)

    ordered = sorted(models, key=lambda m: -m.base_footprint)  # stable
    residents: dict[str, list[str]] = {g.name: [] for g in gpus}
    assignment: dict[str, str] = {}
    unplaced: list[str] = []
    all_scores: dict[str, tuple[CandidateScore, ...]] = {}

    for m in ordered:
        best: CandidateScore | None = None
        row = []
        for g in gpus:
            group = tuple(residents[g.name]) + (m.name,)
            ok, k_rem, mean_mu, score = placement_score(
                g.total_memory,
                [by_name[r].base_footprint for r in residents[g.name]],
                [mu_of(r, group) for r in residents[g.name]],
                m.base_footprint,
                mu_of(m.name, group),
            )
            cs = CandidateScore(g.name, ok, k_rem, mean_mu, score)
            row.append(cs)
            if ok and (best is None or (apart(m.name, cs.gpu), cs.score) > (apart(m.name, best.gpu), best.score)):
                best = cs
        all_scores[m.name] = tuple(row)
        if best is None:
            unplaced.append(m.name)
            continue
        residents[best.gpu].append(m.name)
        assignment[m.name] = best.gpu

    k_left = {g.name: g.total_memory - sum(by_name[r].base_footprint for r in residents[g.name]) for g in gpus}
    return PlacementResult(
        order=tuple(m.name for m in ordered),
        assignment=assignment,
        residents={k: tuple(v) for k, v in residents.items()},
        k_rem=k_left,
        unplaced=tuple(unplaced),
        scores=all_scores,
    )


# ------------------------------------- F3: sizes to demands, pinned models


def base_footprint(
    weight_bytes: float, kv_bytes_per_token: float, kv_tokens: float = 0.0, activation_bytes: float = 0.0
) -> float:
    """F_M (§6.2): weights + activations + the KV of ``kv_tokens`` tokens."""
    _num("weight_bytes", weight_bytes, 0.0)
    _num("kv_bytes_per_token", kv_bytes_per_token, 0.0, strict=True)
    _num("kv_tokens", kv_tokens, 0.0)
    _num("activation_bytes", activation_bytes, 0.0)
    return weight_bytes + activation_bytes + kv_tokens * kv_bytes_per_token


def model_demand(
    name: str,
    weight_bytes: float,
    kv_bytes_per_token: float,
    kv_tokens: float = 0.0,
    activation_bytes: float = 0.0,
) -> ModelDemand:
    """The ``ModelDemand`` of a model from its sizes: F_M = ``base_footprint``;
    mu = 1 / KV bytes per token (tokens a byte of extra KV holds).

    READING: mu is the slope of Fig. 3 (cached tokens per unit of KV memory),
    taken as the inverse of the token size; only its ratios between models
    matter to Alg. 1 (Eq. 3 is scale-invariant in mu).
    """
    fm = base_footprint(weight_bytes, kv_bytes_per_token, kv_tokens, activation_bytes)
    return ModelDemand(name, fm, 1.0 / kv_bytes_per_token)


def smallest_batch_for_rate(rate: float, throughput: Callable[[int], float], max_batch: int) -> tuple[int, bool]:
    """§6.2: "F_M is measured at the smallest batch size whose profiled
    throughput meets M's expected request rate". ``throughput(b)`` is the
    profiled request rate at batch b (non-decreasing in b). Returns (b, met);
    when no b <= ``max_batch`` meets ``rate``, (max_batch, False) -- the paper
    then adds DP replicas, which is the caller's decision.
    """
    _num("rate", rate, 0.0)
    _int("max_batch", max_batch, 1)
    if rate == 0:
        return 1, True
    if throughput(max_batch) < rate:
        return max_batch, False
    lo, hi = 1, max_batch  # throughput(hi) >= rate
    while lo < hi:
        mid = (lo + hi) // 2
        if throughput(mid) >= rate:
            hi = mid
        else:
            lo = mid + 1
    return lo, True


@dataclass(frozen=True)
class PinnedPlacement:
    assignment: dict[str, str]  # every model that found a device -> its device
    alg1: PlacementResult  # Alg. 1 over the unpinned models and what the pins left
    left: dict[str, float]  # device -> memory after the pinned models' F_M
    candidates: tuple[GpuCandidate, ...]  # what Alg. 1 was offered (devices with memory left)
    overflow: tuple[tuple[str, str, float], ...]  # pinned (model, device, memory it had) that did not fit

    @property
    def feasible(self) -> bool:
        return not self.overflow and self.alg1.feasible


def place_with_pins(
    models: Sequence[ModelDemand], devices: Sequence[GpuCandidate], pinned: Mapping[str, str] | None = None
) -> PinnedPlacement:
    """Placement of ``models`` on ``devices``: each model named in ``pinned``
    (model -> device) is charged its F_M on that device first, in ``models``
    order (a model that does not fit is listed in ``overflow`` and not
    charged); the others go through ``place_models`` (Alg. 1) over the
    devices with memory left, in ``devices`` order. With no pins this is
    exactly ``place_models(models, devices)``.
    """
    models = list(models)
    devices = list(devices)
    pinned = dict(pinned or {})
    names = {d.name for d in devices}
    for m, d in pinned.items():
        if d not in names:
            raise ValueError(f"pinned[{m!r}] names unknown device {d!r}")
    left = {d.name: d.total_memory for d in devices}
    assignment: dict[str, str] = {}
    overflow = []
    for m in models:
        dev = pinned.get(m.name)
        if dev is None:
            continue
        if m.base_footprint > left[dev]:
            overflow.append((m.name, dev, left[dev]))
            continue
        left[dev] -= m.base_footprint
        assignment[m.name] = dev
    free = [m for m in models if m.name not in pinned]
    candidates = tuple(GpuCandidate(d.name, left[d.name]) for d in devices if left[d.name] > 0)
    if free and candidates:
        alg1 = place_models(free, candidates)
    else:
        order = tuple(m.name for m in sorted(free, key=lambda m: -m.base_footprint))
        alg1 = PlacementResult(order, {}, {}, {}, order)
    assignment.update(alg1.assignment)
    return PinnedPlacement(assignment, alg1, left, candidates, tuple(overflow))


# ---------------------------------------------------- Static* (§7.1)


def static_partition(total_memory: float, footprints: Mapping[str, float]) -> dict[str, float]:
    """Static* of §7.1: "GPU memory is statically partitioned per model,
    proportional to its required footprint (weights, activations, KV cache)".
    Returns model -> bytes of ``total_memory`` (each model's weights and
    activations come out of its own share; the rest of the share is its KV).
    """
    _num("total_memory", total_memory, 0.0)
    fs = {_name("footprints key", k): _num(f"footprints[{k!r}]", v, 0.0) for k, v in footprints.items()}
    if not fs:
        raise ValueError("footprints must name at least one model")
    tot = sum(fs.values())
    if tot <= 0:
        return {k: total_memory / len(fs) for k in fs}
    return {k: total_memory * v / tot for k, v in fs.items()}


# ------------------------------------------------- F4: local adaptive batch


@dataclass(frozen=True)
class Request:
    """A waiting request: ``arrival`` in seconds, ``prompt_tokens`` its
    prefill length (tokens still to prefill)."""

    rid: str
    arrival: float
    prompt_tokens: int

    def __post_init__(self):
        _name("rid", self.rid)
        _num("arrival", self.arrival)
        _int("prompt_tokens", self.prompt_tokens, 1)


@dataclass(frozen=True)
class ChunkedPrefillModel:
    """Linear chunked-prefill latency model (coefficients are profiled inputs).

    A batch's prompts (T tokens in all) are prefilled in chunks of at most
    ``chunk_tokens`` tokens; one chunk holding c tokens costs
    ``per_chunk_s + per_token_s * c``. Hence for a set R:

        TTFT(R) = ceil(T / chunk_tokens) * per_chunk_s + per_token_s * T
                  + per_request_s * |R|

    (``per_request_s`` is an optional per-request overhead, default 0.)
    TTFT of the empty set is 0.
    """

    chunk_tokens: int
    per_chunk_s: float
    per_token_s: float
    per_request_s: float = 0.0

    def __post_init__(self):
        _int("chunk_tokens", self.chunk_tokens, 1)
        _num("per_chunk_s", self.per_chunk_s, 0.0)
        _num("per_token_s", self.per_token_s, 0.0)
        _num("per_request_s", self.per_request_s, 0.0)

    def ttft(self, requests: Sequence[Request]) -> float:
        total = sum(r.prompt_tokens for r in requests)
        if total == 0:
            return 0.0
        chunks = -(-total // self.chunk_tokens)
        return chunks * self.per_chunk_s + self.per_token_s * total + self.per_request_s * len(requests)


@dataclass(frozen=True)
class BatchDecision:
    batch: tuple[Request, ...]  # S, in EDF order
    dropped: tuple[Request, ...]  # D: cannot meet deadline even alone
    removed_longest: tuple[Request, ...]  # taken out by lines 12-15 (stay waiting)
    trimmed: tuple[Request, ...]  # cut by N_max / T_max (stay waiting)
    remaining: tuple[Request, ...]  # W after the call, original order
    predicted_finish: float  # t + TTFT(batch); t when batch empty
    deadlines: dict[str, float]  # rid -> d_r


def adaptive_batch(
    waiting: Sequence[Request], now: float, slo: float, n_max: int, t_max: int, predictor: ChunkedPrefillModel
) -> BatchDecision:
    """Algorithm 2 (SLO-aware adaptive batching) for one model's queue.

    1. d_r = arrival + slo; drop r unless now + TTFT({r}) < d_r (strict, as
       in the paper).
    2. Sort survivors by d_r (EDF; ties by arrival, then queue order).
    3. While now + TTFT(S) >= d of S's front, remove the longest request.
       READING: "longest" = most prompt tokens (largest prefill cost); ties
       go to the later one in EDF order. The anchor itself may be removed.
    4. trim(S, N_max, T_max). READING: keep the longest EDF prefix with at
       most N_max requests and at most T_max prompt tokens; the first request
       that does not fit ends the batch (no later request jumps ahead of it).
    Trimming only shrinks S, so TTFT(S) keeps meeting every member's deadline.
    """
    _num("now", now)
    _num("slo", slo, 0.0, strict=True)
    _int("n_max", n_max, 1)
    _int("t_max", t_max, 1)
    if not isinstance(predictor, ChunkedPrefillModel):
        raise ValueError(f"predictor must be a ChunkedPrefillModel, got {predictor!r}")
    waiting = list(waiting)
    for r in waiting:
        if not isinstance(r, Request):
            raise ValueError(f"waiting must hold Request, got {r!r}")
    if len({r.rid for r in waiting}) != len(waiting):
        raise ValueError("waiting rid values must be unique")

    deadline = {r.rid: r.arrival + slo for r in waiting}
    pos = {r.rid: i for i, r in enumerate(waiting)}

    kept, dropped = [], []
    for r in waiting:
        (kept if now + predictor.ttft([r]) < deadline[r.rid] else dropped).append(r)

    s = sorted(kept, key=lambda r: (deadline[r.rid], r.arrival, pos[r.rid]))

    removed = []
    while s and not now + predictor.ttft(s) < deadline[s[0].rid]:
        longest = max(range(len(s)), key=lambda i: (s[i].prompt_tokens, i))
        removed.append(s.pop(longest))

    batch, trimmed, tokens = [], [], 0
    for i, r in enumerate(s):
        if len(batch) < n_max and tokens + r.prompt_tokens <= t_max:
            batch.append(r)
            tokens += r.prompt_tokens
        else:
            trimmed = s[i:]
            break

    gone = {r.rid for r in dropped} | {r.rid for r in batch}
    return BatchDecision(
        batch=tuple(batch),
        dropped=tuple(dropped),
        removed_longest=tuple(removed),
        trimmed=tuple(trimmed),
        remaining=tuple(r for r in waiting if r.rid not in gone),
        predicted_finish=now + predictor.ttft(batch),
        deadlines=deadline,
    )
