"""The block geometry of a borrower's KV in a peer region, and the compatibility check.

A *block* is ``block_tokens`` tokens of every layer's K and V, contiguous, in the order
``(layer, k_or_v, token, head, dim)`` (block-major, SwiftCache §3.4): resizing a region by
whole blocks never moves another block's bytes. ``block_bytes`` is its size.

A layout travels as a JSON object (``to_wire`` / ``from_wire``); ``check_same`` refuses a
peer whose layout differs, naming the first field that differs (dtype, head_dim, page size
...), so KV of two geometries is never mixed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ..policy._checks import check_int

#: element size of the KV dtypes a layout may name
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class PeerKVLayout:
    """KV geometry of one model (heads already divided by TP); ``model`` tags whose KV it is."""

    num_layers: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    model: str = ""

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, minimum=1)
        check_int("block_tokens", self.block_tokens, minimum=1)
        check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=1)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.model, str) or len(self.model) > 256:
            raise ValueError(f"model must be a string of at most 256 characters, got {self.model!r:.80}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, 2, block_tokens, kv_heads, head_dim)``: index 0 of dim 1 is K, 1 is V."""
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj) -> PeerKVLayout:
        if not isinstance(obj, dict):
            raise ValueError(f"layout: expected a JSON object, got {type(obj).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(obj) - names
        if unknown:
            raise ValueError(f"layout: unknown field(s) {sorted(unknown)}")
        try:
            return cls(**obj)
        except TypeError as exc:
            raise ValueError(f"layout: {exc}") from None

    def check_same(self, other: PeerKVLayout) -> None:
        """Raise ValueError naming the first field in which ``other`` differs."""
        if not isinstance(other, PeerKVLayout):
            raise ValueError(f"layout: expected a PeerKVLayout, got {type(other).__name__}")
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                label = "page size (block_tokens)" if f.name == "block_tokens" else f.name
                raise ValueError(f"layout.{f.name}: incompatible KV layout, {label} {theirs!r} != {mine!r}")
