"""FineServe F2 (KV token and block sizes) and F1+F2 on a pool of common units (slab formats).

Source: the FineServe paper, sections 3.2 and 5. Plain numbers in, sizes out: nothing here
allocates, maps memory, touches tensors or imports an engine; only stdlib is used.

F2  token / block sizes:   ``KVPrecision``, ``KVLayout``, ``token_kv_bytes``,
                           ``token_qparam_bytes``, ``kv_block_bytes``
F1+F2 on a pool of units:  ``kv_row_bytes``, ``slab_tokens``, ``SlabFormat``,
                           ``slab_format``, ``uniform_slab_units`` (memx's
                           slab: whole common units formatted for one model)

Invariant: ``sum(kv_row_bytes(layout)) == token_kv_bytes(layout, False) +
token_qparam_bytes(layout, False)``; a ``slab_format`` slab wastes no byte of its units.
Readings of the paper where it is not explicit are marked "READING:".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._checks import check_int as _int
from ._checks import check_name as _name
from ._checks import check_num as _num

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
    "kv_row_bytes",
    "slab_tokens",
    "SlabFormat",
    "slab_format",
    "uniform_slab_units",
]


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
