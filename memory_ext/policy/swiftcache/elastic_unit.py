"""W3: the block-major elastic cache and its minimum elastic unit (MEU), Eq. 6-9 (R3), and the
MEU aligned to the chunks of a pool (R9)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._checks import check_int as _int
from ._inputs import whole_bytes as _integral
from .geometry import KVGeometry


def block_elems(geom: KVGeometry) -> int:
    """Eq. 6/7: BE = L * B * H_kv * D_kv (one block, all layers, one of K/V)."""
    return geom.num_layers * geom.block_size * geom.num_kv_heads * geom.head_dim


def block_major_shape(geom: KVGeometry, n_blocks: int) -> tuple[int, int, int]:
    """Block-major layout (n_blocks, n_layers, block_elems_per_layer); resizing touches only the tail."""
    _int("n_blocks", n_blocks)
    return (n_blocks, geom.num_layers, geom.block_size * geom.num_kv_heads * geom.head_dim)


@dataclass(frozen=True)
class ElasticUnit:
    """Minimum elastic unit between the master and one worker (Eq. 8-9, R3)."""

    master_block_elems: int  # BE_m (Eq. 6)
    worker_block_elems: int  # BE_i (Eq. 7)
    lcm_elems: int  # Eq. 8, literal
    master_block_bytes: int  # whole block-major block, K and V, all layers
    worker_block_bytes: int
    meu_master: int  # MEU_m, master blocks per unit (Eq. 9)
    meu_worker: int  # MEU_i, worker blocks per unit (Eq. 9)
    meu_bytes: int  # bytes of one unit; == meu_master*master_block_bytes == meu_worker*worker_block_bytes

    def master_blocks(self, units: int) -> int:
        return _int("units", units) * self.meu_master

    def worker_blocks(self, units: int) -> int:
        return _int("units", units) * self.meu_worker

    def bytes_for(self, units: int) -> int:
        return _int("units", units) * self.meu_bytes


def _block_bytes(geom: KVGeometry, role: str) -> int:
    return _integral(f"{role} block bytes", 2 * block_elems(geom) * geom.dtype_bytes)


def min_elastic_unit(master: KVGeometry, worker: KVGeometry) -> ElasticUnit:
    """MEU of Eq. 6-9 (byte-aligned per R3)."""
    if not isinstance(master, KVGeometry):
        raise ValueError(f"master must be a KVGeometry, got {master!r}")
    if not isinstance(worker, KVGeometry):
        raise ValueError(f"worker must be a KVGeometry, got {worker!r}")
    be_m, be_i = block_elems(master), block_elems(worker)
    mb, wb = _block_bytes(master, "master"), _block_bytes(worker, "worker")
    lcm_bytes = math.lcm(mb, wb)
    return ElasticUnit(
        master_block_elems=be_m,
        worker_block_elems=be_i,
        lcm_elems=math.lcm(be_m, be_i),
        master_block_bytes=mb,
        worker_block_bytes=wb,
        meu_master=lcm_bytes // mb,
        meu_worker=lcm_bytes // wb,
        meu_bytes=lcm_bytes,
    )


def chunk_aligned_unit(unit: ElasticUnit, chunk_bytes: int) -> ElasticUnit:
    """The MEU scaled by the smallest factor that makes ``meu_bytes`` a whole number of chunks (R9)."""
    if not isinstance(unit, ElasticUnit):
        raise ValueError(f"unit must be an ElasticUnit, got {unit!r}")
    _int("chunk_bytes", chunk_bytes, minimum=1)
    f = math.lcm(unit.meu_bytes, chunk_bytes) // unit.meu_bytes
    if f == 1:
        return unit
    return ElasticUnit(
        master_block_elems=unit.master_block_elems,
        worker_block_elems=unit.worker_block_elems,
        lcm_elems=unit.lcm_elems,
        master_block_bytes=unit.master_block_bytes,
        worker_block_bytes=unit.worker_block_bytes,
        meu_master=unit.meu_master * f,
        meu_worker=unit.meu_worker * f,
        meu_bytes=unit.meu_bytes * f,
    )
