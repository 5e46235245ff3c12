"""The KV slab of one server: FineServe's F1 / F2 in memx's form (docs/memory-pool.md, "KV slab").

The pool's chunk is the common memory unit that every co-located server borrows from the
device's arbiter. A server's slab is one of its KV groups: ``slab_units`` chunks formatted for
this model's KV cell, holding ``tokens_per_slab`` tokens of every layer's K and V. Its size is
F1's LCM rule on the chunk (``memory_ext.policy.kv_format.slab_tokens``, the very function that
sizes the group in ``memory_ext.pool.layered_kv``), so a slab holds whole tokens and wastes no
byte of its chunks.

* ``cell_format(geometry, unit_bytes)``: at build, the KV cell (dtype, layers, KV heads x head
  dim) and its ``SlabFormat``.
* ``slab_status(kv, allocator)``: the status section. The slab view is a ``SlabTable`` snapshot,
  one slab per group: an unmapped group is FREE (its chunks are in the pool, for any model); a
  mapped one is PARTIAL or FULL by the pages upstream's allocator holds in it (pages that can
  never be allocated, upstream's padded page 0 and the tail past the logical capacity, count as
  held: ``dead_tokens``). Free pages inside mapped slabs are ``stranded``: memory only this
  server can use (FineServe's internal fragmentation, C2). Built on demand (O(free pages)),
  never on the request path.
"""

from __future__ import annotations

import torch

from memory_ext.policy.kv_format import KVLayout, KVPrecision, slab_format, token_kv_bytes
from memory_ext.policy.slab_table import SlabTable
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtypes_and_layers(geometry: dict) -> dict:
    return {"kv_dtype": _dtype_name(geometry["dtype"]), "store_dtype": _dtype_name(geometry["store_dtype"]),
            "layers": geometry["layers"]}  # fmt: skip


def cell_format(geometry: dict, unit_bytes: int):
    """``(cell, SlabFormat)`` of a pool from ``upstream.kv.pool_geometry`` (its ``layers`` and
    ``row_bytes`` those this server backs)."""
    if geometry["kind"] == "mla":
        return _mla_cell_format(geometry, unit_bytes)
    layers = geometry["layers"]
    cell = {**_dtypes_and_layers(geometry), "kv_heads": geometry["kv_heads"], "head_dim": geometry["head_dim"],
            "v_head_dim": geometry["v_head_dim"]}  # fmt: skip
    key = f"{cell['kv_dtype']} L{layers} {cell['kv_heads']}x{cell['head_dim']}"
    if cell["v_head_dim"] != cell["head_dim"]:
        key += f"/{cell['v_head_dim']}"
    fmt = slab_format(key, geometry["row_bytes"], unit_bytes, geometry["page_size"])
    if cell["v_head_dim"] == cell["head_dim"]:  # F2's TokenSize (per layer); K and V rows are equal
        itemsize = geometry["store_dtype"].itemsize
        layout = KVLayout(layers, cell["kv_heads"], cell["head_dim"],
                          precision=KVPrecision(cell["kv_dtype"], itemsize))  # fmt: skip
        cell["token_bytes_per_layer"] = token_kv_bytes(layout)
    else:
        cell["token_bytes_per_layer"] = geometry["k_row_bytes"] + geometry["v_row_bytes"]
    return cell, fmt


def _mla_cell_format(geometry: dict, unit_bytes: int):
    """The MLA cell: one latent row (``kv_lora_rank`` + ``qk_rope_head_dim`` values) per token and
    layer, no separate V (upstream reads V as the latent's first ``kv_lora_rank`` values)."""
    layers, rows = geometry["layers"], geometry["row_bytes"]
    cell = {**_dtypes_and_layers(geometry), "kv_lora_rank": geometry["kv_lora_rank"],
            "qk_rope_head_dim": geometry["qk_rope_head_dim"],
            "token_bytes_per_layer": rows[0] if rows else 0}  # fmt: skip
    key = f"{cell['kv_dtype']} L{layers} MLA {cell['kv_lora_rank']}+{cell['qk_rope_head_dim']}"
    return cell, slab_format(key, rows, unit_bytes, geometry["page_size"])


def dead_pages(kv: ElasticKV, group: int) -> int:
    """Pages of ``group`` that upstream never allocates (page 0, pages past the capacity)."""
    return kv.group_pages - kv.usable_pages(group)


def slab_table(kv: ElasticKV, allocator) -> SlabTable:
    """A ``SlabTable`` over the server's groups, filled from upstream's free list."""
    fmt = kv.slab
    table = SlabTable(kv.num_groups, fmt.slab_bytes)
    pages = up_kv.all_free_pages(allocator)
    free = [0] * kv.num_groups
    if pages is not None and pages.numel():
        free = torch.bincount(pages // kv.group_pages, minlength=kv.num_groups).tolist()
    for g in kv.buffers.mapped_groups():
        if g < kv.num_groups:
            table.adopt(fmt.key, fmt.block_bytes, g, kv.group_pages - free[g])
    return table


def slab_status(kv: ElasticKV, allocator) -> dict | None:
    """The ``elastic_kv.slab`` section of /memx/status (None before the build set a format)."""
    fmt = kv.slab
    if fmt is None:
        return None
    table = slab_table(kv, allocator)
    mapped = [g for g in kv.buffers.mapped_groups() if g < kv.num_groups]
    dead = sum(dead_pages(kv, g) for g in mapped) * kv.page_size
    stranded = table.stranded_blocks(fmt.key) * kv.page_size
    return {
        "format": fmt.key,
        **kv.cell,
        "bytes_per_token": fmt.bytes_per_token,
        "unit_bytes": fmt.unit_bytes,
        "tokens_per_slab": fmt.tokens_per_slab,
        "pages_per_slab": fmt.blocks_per_slab,
        "slab_units": fmt.slab_units,
        "slab_bytes": fmt.slab_bytes,
        "waste_bytes": fmt.waste_bytes,
        "slabs_total": kv.num_groups,
        "slabs": table.slab_counts(fmt.key),
        "used_tokens": table.used_blocks(fmt.key) * kv.page_size - dead,
        "stranded_tokens": stranded,
        "stranded_bytes": stranded * fmt.bytes_per_token,
        "dead_tokens": dead,
    }
