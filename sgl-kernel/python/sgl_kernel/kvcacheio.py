"""KV-cache row copies between a host pool and a device pool, in plain torch.

Upstream's hierarchical cache (``HostKVCache`` and its subclasses) moves token
rows between the device KV pool and a host copy of it with these ops. Each op
copies, for every ``i``, the row of token ``src_indices[i]`` in the source to
the row of token ``dst_indices[i]`` in the destination. They differ only in how
a token's row is found in each pool:

* *layer first* (``lf``): one tensor per layer, token ``t``'s row starts at
  byte ``t * item_size`` (the device pool, and the host pool's ``layer_first``
  layout). ``item_size`` = bytes of one token of one layer
  (``head_num * head_dim * itemsize``, or ``kv_cache_dim * itemsize`` for MLA).
* *page first* (``pf``): one tensor for all layers, token ``t`` of layer ``l``
  at byte ``t * layout_dim + l * item_size`` (host ``page_first``;
  ``layout_dim = item_size * num_layers``).
* *page head* (``ph``): host ``page_head`` tensor of shape
  ``(pages, head_num, page_size, num_layers, head_dim)``; token ``t`` lives in
  page ``t // page_size`` at slot ``t % page_size``, one chunk per head.
* ``direct`` variants take tensors and index their leading dims instead of
  bytes: layer-first tensors are ``(tokens, ...)``, page-first-direct tensors
  are ``(pages, num_layers, page_size, ...)``.

The ``*_all_layer`` ops read their per-layer side from a *pointer table*: a 1-D
``uint64``/``int64`` tensor of ``data_ptr()`` values, one per layer, as
upstream's pools build them. A pointer table must live on the CPU and its
addresses must be host memory: the portable kernels dereference them through
``ctypes``, which is only possible for host addresses (on the hosts this
package is meant for, every pool is in host memory). A list of per-layer
tensors is accepted in place of a pointer table.

Index tensors may be int32 or int64 on any device. Indices are trusted like
the CUDA kernels trust them: with tensors, out-of-range rows raise; with raw
pointers, the caller guarantees the rows exist. ``block_quota`` and
``num_warps_per_block`` are CUDA launch parameters, accepted and ignored.
Duplicate destination indices leave one of the candidate rows (unspecified which).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from sgl_kernel._unsupported import define_unsupported

__all__ = [
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_embedding_ranges_direct",
    "copy_all_layer_kv_cache_cpu",
]

# Where bytes live: a tensor (its storage, from its first element) or a raw host address.
Memory = torch.Tensor | int
LayerTable = torch.Tensor | Sequence[torch.Tensor]


# ------------------------------------------------------------ byte addressing
def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last one."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _byte_view(mem: Memory, offset: int, sizes: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """A uint8 tensor aliasing ``mem`` with the given byte ``sizes``/``strides``,
    starting ``offset`` bytes after ``mem``'s first byte. Bounds-checked for tensors."""
    sizes, strides = tuple(int(s) for s in sizes), tuple(int(s) for s in strides)
    if isinstance(mem, torch.Tensor):
        needed = offset + sum((s - 1) * st for s, st in zip(sizes, strides)) + 1
        if all(sizes) and needed > _span_bytes(mem):
            raise IndexError(
                f"a KV row index reaches byte {needed} of a tensor spanning "
                f"{_span_bytes(mem)} bytes (shape {tuple(mem.shape)})"
            )
        storage = mem.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=mem.device).set_(storage, 0, (storage.nbytes(),), (1,))
        start = mem.storage_offset() * mem.element_size() + offset
        return flat.as_strided(sizes, strides, start)
    if any(s == 0 for s in sizes):
        return torch.empty(sizes, dtype=torch.uint8)
    span = sum((s - 1) * st for s, st in zip(sizes, strides)) + 1
    raw = (ctypes.c_uint8 * span).from_address(int(mem) + offset)
    return torch.frombuffer(raw, dtype=torch.uint8).as_strided(sizes, strides, 0)


def _rows(mem: Memory, count: int, stride: int, width: int, offset: int = 0) -> torch.Tensor:
    """``count`` rows of ``width`` bytes, ``stride`` bytes apart, from ``offset``."""
    return _byte_view(mem, offset, (count, width), (stride, 1))


def _long(idx: torch.Tensor, device) -> torch.Tensor:
    return idx.reshape(-1).to(device=device, dtype=torch.int64)


def _extent(idx: torch.Tensor) -> int:
    """Number of rows needed to address every index in ``idx``."""
    return int(idx.max()) + 1 if idx.numel() else 0


def _check_pair(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"src_indices has {src_indices.numel()} entries, dst_indices {dst_indices.numel()}")


def _copy_rows(dst: torch.Tensor, dst_indices, src: torch.Tensor, src_indices) -> None:
    values = src.index_select(0, _long(src_indices, src.device)).to(dst.device)
    dst.index_copy_(0, _long(dst_indices, dst.device), values)


def _layers(table: LayerTable, num_layers: int) -> list[Memory]:
    """Per-layer memory handles from a pointer table or a sequence of tensors."""
    if isinstance(table, torch.Tensor):
        if table.dim() != 1 or table.dtype not in (torch.uint64, torch.int64):
            raise TypeError("a pointer table must be a 1-D uint64/int64 tensor of data_ptr() values")
        if table.device.type != "cpu":
            raise NotImplementedError(
                f"sgl_kernel.kvcacheio: a pointer table on {table.device} addresses device "
                "memory; the portable kernels can only dereference host (CPU) addresses. "
                "Pass per-layer tensors instead."
            )
        handles: list[Memory] = [int(p) for p in table.tolist()]
    else:
        handles = list(table)
    if len(handles) < num_layers:
        raise ValueError(f"expected {num_layers} layers, got {len(handles)}")
    return handles[:num_layers]


# ---------------------------------------------------------- per-row layouts
def _lf_rows(mem: Memory, idx: torch.Tensor, item_size: int) -> torch.Tensor:
    return _rows(mem, _extent(idx), item_size, item_size)


def _pf_rows(mem: Memory, idx: torch.Tensor, layer_id: int, item_size: int, layout_dim: int) -> torch.Tensor:
    return _rows(mem, _extent(idx), layout_dim, item_size, offset=layer_id * item_size)


def _ph_view(
    mem: Memory, idx: torch.Tensor, layer_id: int, item_size: int, layout_dim: int, page_size: int, head_num: int
) -> torch.Tensor:
    """(pages, page_size, head_num, head_bytes) view of one layer of a page_head buffer."""
    if item_size % head_num or layout_dim % item_size:
        raise ValueError("item_size must split into head_num heads and divide layout_dim")
    head_bytes = item_size // head_num
    num_layers = layout_dim // item_size
    pages = (int(idx.max()) // page_size + 1) if idx.numel() else 0
    return _byte_view(
        mem,
        layer_id * head_bytes,
        (pages, page_size, head_num, head_bytes),
        (page_size * layout_dim, num_layers * head_bytes, page_size * num_layers * head_bytes, 1),
    )


def _page_slot(idx: torch.Tensor, page_size: int, device):
    flat = _long(idx, device)
    return flat // page_size, flat % page_size


def _copy_lf_to_lf(src: Memory, dst: Memory, src_indices, dst_indices, item_size: int) -> None:
    _copy_rows(_lf_rows(dst, dst_indices, item_size), dst_indices, _lf_rows(src, src_indices, item_size), src_indices)


# ------------------------------------------------------------ MHA, by bytes
def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """One layer, layer-first to layer-first: copy K and V token rows
    (``item_size`` bytes each) ``src[src_indices[i]] -> dst[dst_indices[i]]``."""
    _check_pair(src_indices, dst_indices)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy_lf_to_lf(src, dst, src_indices, dst_indices, item_size)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """Layer ``layer_id`` from a page-first host buffer (whole K / V buffers,
    token rows ``src_layout_dim`` bytes apart) into a layer-first device layer."""
    _check_pair(src_indices, dst_indices)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(
            _lf_rows(dst, dst_indices, item_size),
            dst_indices,
            _pf_rows(src, src_indices, layer_id, item_size, src_layout_dim),
            src_indices,
        )


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """Layer ``layer_id`` from a page-head host buffer
    ``(pages, head_num, page_size, num_layers, head_dim)`` into a layer-first
    device layer whose token rows are ``(head_num, head_dim)``."""
    _check_pair(src_indices, dst_indices)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        view = _ph_view(src, src_indices, layer_id, item_size, src_layout_dim, page_size, head_num)
        page, slot = _page_slot(src_indices, page_size, view.device)
        values = view[page, slot].reshape(-1, item_size)
        rows = _lf_rows(dst, dst_indices, item_size)
        rows.index_copy_(0, _long(dst_indices, rows.device), values.to(rows.device))


def transfer_kv_all_layer(
    src_k_layers: LayerTable,
    dst_k_layers: LayerTable,
    src_v_layers: LayerTable,
    dst_v_layers: LayerTable,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All ``num_layers`` layers, layer-first to layer-first; each side is a
    pointer table (or list) of per-layer K / V buffers."""
    _check_pair(src_indices, dst_indices)
    for src_table, dst_table in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for src, dst in zip(_layers(src_table, num_layers), _layers(dst_table, num_layers)):
            _copy_lf_to_lf(src, dst, src_indices, dst_indices, item_size)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: LayerTable,
    dst_k: torch.Tensor,
    src_v_layers: LayerTable,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers from layer-first device buffers (pointer tables) into a
    page-first host buffer (token rows ``dst_layout_dim`` bytes apart)."""
    _check_pair(src_indices, dst_indices)
    for src_table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer_id, src in enumerate(_layers(src_table, num_layers)):
            _copy_rows(
                _pf_rows(dst, dst_indices, layer_id, item_size, dst_layout_dim),
                dst_indices,
                _lf_rows(src, src_indices, item_size),
                src_indices,
            )


def transfer_kv_all_layer_lf_ph(
    src_k_layers: LayerTable,
    dst_k: torch.Tensor,
    src_v_layers: LayerTable,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers from layer-first device buffers (pointer tables) into a
    page-head host buffer ``(pages, head_num, page_size, num_layers, head_dim)``."""
    _check_pair(src_indices, dst_indices)
    for src_table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer_id, src in enumerate(_layers(src_table, num_layers)):
            rows = _lf_rows(src, src_indices, item_size)
            values = rows.index_select(0, _long(src_indices, rows.device))
            view = _ph_view(dst, dst_indices, layer_id, item_size, dst_layout_dim, page_size, head_num)
            page, slot = _page_slot(dst_indices, page_size, view.device)
            view[page, slot] = values.to(view.device).reshape(-1, head_num, item_size // head_num)


# ------------------------------------------------------------ MLA, by bytes
def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int | None = None,
    num_warps_per_block: int = 32,
) -> None:
    """One layer of a single-buffer (MLA-style) pool, layer-first to layer-first:
    rows of ``item_size`` bytes. Upstream also uses it for Mamba state rows."""
    _check_pair(src_indices, dst_indices)
    _copy_lf_to_lf(src, dst, src_indices, dst_indices, item_size)


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int | None = None,
    num_warps_per_block: int = 32,
) -> None:
    """Layer ``layer_id`` of a page-first single-buffer host pool into a
    layer-first device layer."""
    _check_pair(src_indices, dst_indices)
    _copy_rows(
        _lf_rows(dst, dst_indices, item_size),
        dst_indices,
        _pf_rows(src, src_indices, layer_id, item_size, src_layout_dim),
        src_indices,
    )


def transfer_kv_all_layer_mla(
    src_layers: LayerTable,
    dst_layers: LayerTable,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers of a single-buffer pool, layer-first to layer-first, both
    sides given as pointer tables (or lists)."""
    _check_pair(src_indices, dst_indices)
    for src, dst in zip(_layers(src_layers, num_layers), _layers(dst_layers, num_layers)):
        _copy_lf_to_lf(src, dst, src_indices, dst_indices, item_size)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: LayerTable,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 32,
) -> None:
    """All layers of a single-buffer pool from layer-first device buffers
    (pointer table) into a page-first host buffer."""
    _check_pair(src_indices, dst_indices)
    for layer_id, src in enumerate(_layers(src_layers, num_layers)):
        _copy_rows(
            _pf_rows(dst, dst_indices, layer_id, item_size, dst_layout_dim),
            dst_indices,
            _lf_rows(src, src_indices, item_size),
            src_indices,
        )


# --------------------------------------------------- direct (tensor indexing)
def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """For each pair of tensors, ``dst[dst_indices[i]] = src[src_indices[i]]``
    along dim 0 (rows may be any shape; the two must have equal row sizes).
    ``page_size`` is a batching hint upstream; it does not change the result."""
    _check_pair(src_indices, dst_indices)
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destination layers")
    for src, dst in zip(src_layers, dst_layers):
        values = src.index_select(0, _long(src_indices, src.device))
        dst.index_copy_(
            0, _long(dst_indices, dst.device), values.to(dst.device).reshape((values.shape[0],) + tuple(dst.shape[1:]))
        )


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Layer ``layer_id`` from page-first-direct host tensors
    ``(pages, num_layers, page_size, ...)`` into layer-first device tensors
    ``(tokens, ...)``: host token ``t`` is ``src[t // page_size, layer_id, t % page_size]``."""
    _check_pair(src_indices, dst_indices)
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} source buffers but {len(dst_ptrs)} destination buffers")
    for src, dst in zip(src_ptrs, dst_ptrs):
        page, slot = _page_slot(src_indices, page_size, src.device)
        values = src[page, layer_id, slot]
        dst.index_copy_(
            0, _long(dst_indices, dst.device), values.to(dst.device).reshape((values.shape[0],) + tuple(dst.shape[1:]))
        )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """All layers from layer-first device tensors into page-first-direct host
    tensors. ``src_ptrs`` lists every layer of ``dst_ptrs[0]`` first, then every
    layer of ``dst_ptrs[1]`` (e.g. all K layers then all V layers), so
    ``num_layers = len(src_ptrs) // len(dst_ptrs)``."""
    _check_pair(src_indices, dst_indices)
    if not dst_ptrs or len(src_ptrs) % len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} source layers do not split over {len(dst_ptrs)} buffers")
    num_layers = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        page, slot = _page_slot(dst_indices, page_size, dst.device)
        for layer_id in range(num_layers):
            src = src_ptrs[j * num_layers + layer_id]
            values = src.index_select(0, _long(src_indices, src.device))
            dst[page, layer_id, slot] = values.to(dst.device).reshape((values.shape[0],) + tuple(dst.shape[3:]))


def transfer_embedding_ranges_direct(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_starts: list[int],
    dst_starts: list[int],
    lengths: list[int],
) -> None:
    """Copy contiguous ranges along dim 0:
    ``dst[dst_starts[i] : dst_starts[i] + lengths[i]] = src[src_starts[i] : ... + lengths[i]]``."""
    if not len(src_starts) == len(dst_starts) == len(lengths):
        raise ValueError("src_starts, dst_starts and lengths must have equal lengths")
    for s, d, n in zip(src_starts, dst_starts, lengths):
        s, d, n = int(s), int(d), int(n)
        if n:
            dst[d : d + n].copy_(src[s : s + n])


def copy_all_layer_kv_cache_cpu(
    data_ptrs: LayerTable,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Move slots inside the device KV pool, for every buffer of it.

    ``data_ptrs[b]`` is the base of buffer ``b`` (pointer table or tensors) and
    ``strides[b]`` its row size in bytes; for each ``i`` row ``src_loc[i]`` is
    copied onto row ``tgt_loc[i]``. All source rows are read before any target
    row is written, so overlapping source/target sets are safe.
    """
    _check_pair(src_loc, tgt_loc)
    row_bytes = [int(s) for s in strides.reshape(-1).tolist()]
    if not src_loc.numel():
        return
    count = max(_extent(src_loc), _extent(tgt_loc))
    for base, stride in zip(_layers(data_ptrs, len(row_bytes)), row_bytes):
        rows = _rows(base, count, stride, stride)
        _copy_rows(rows, tgt_loc, rows, src_loc)


# Upstream names for KV-cache movement without a portable implementation:
# the pinned-memory device pointer query and the DeepSeek-V4 / sparse-MLA /
# XPU cache movers.
UNSUPPORTED = (
    "get_device_accessible_ptr",
    "load_cache_to_device_buffer_mla",
    "load_cache_to_device_buffer_dsv4_mla",
    "transfer_cache_dsv4_mla",
    "store_cache_xpu",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ += list(UNSUPPORTED)
