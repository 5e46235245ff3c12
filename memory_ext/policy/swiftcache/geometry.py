"""KV geometry of a model and its byte sizes (Eq. 1-3): the block of one layer, the master
blocks a worker can hold, the single-layer blocks of the master."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_int as _int
from ._inputs import number as _num
from ._inputs import whole_bytes as _integral


@dataclass(frozen=True)
class KVGeometry:
    """KV shape of one model on one GPU (heads already divided by TP)."""

    num_layers: int
    block_size: int  # tokens per block (B)
    num_kv_heads: int  # H_kv
    head_dim: int  # D_kv
    dtype_bytes: float = 2  # d_type; 0.5 for INT4, 1 for FP8, 2 for FP16/BF16

    def __post_init__(self) -> None:
        _int("num_layers", self.num_layers, minimum=1)
        _int("block_size", self.block_size, minimum=1)
        _int("num_kv_heads", self.num_kv_heads, minimum=1)
        _int("head_dim", self.head_dim, minimum=1)
        _num("dtype_bytes", self.dtype_bytes)


def layer_block_bytes(geom: KVGeometry) -> int:
    """Eq. 1: M_block = 2 * B * H_kv * D_kv * d_type (K and V of one block, one layer)."""
    return _integral(
        "layer block bytes (Eq. 1)",
        2 * geom.block_size * geom.num_kv_heads * geom.head_dim * geom.dtype_bytes,
    )


def worker_full_layer_blocks(worker_cache_bytes: int, m_block_bytes: int, num_layers: int) -> int:
    """Eq. 2: K_i = floor(C_worker_i / (M_block * L)), master full-layer blocks a worker can hold."""
    _int("worker_cache_bytes", worker_cache_bytes)
    _int("m_block_bytes", m_block_bytes, minimum=1)
    _int("num_layers", num_layers, minimum=1)
    return worker_cache_bytes // (m_block_bytes * num_layers)


def master_single_layer_blocks(master_cache_bytes: int, m_block_bytes: int) -> int:
    """Eq. 3: K_master = floor(C_master / M_block)."""
    _int("master_cache_bytes", master_cache_bytes)
    _int("m_block_bytes", m_block_bytes, minimum=1)
    return master_cache_bytes // m_block_bytes
