"""The KV slab (FineServe F1 / F2 in memx's form): slab formats on a pool of common units, the
slab table snapshot of a server's groups over upstream's real allocator, and how status,
Prometheus and ``top`` show it. Numbers are worked by hand in the comments."""

import re
import time
import types

import pytest
import torch

from memory_ext.policy.kv_format import (
    FP8,
    FP16,
    INT4,
    KVLayout,
    kv_row_bytes,
    slab_format,
    slab_tokens,
    token_kv_bytes,
    token_qparam_bytes,
    uniform_slab_units,
)
from memory_ext.policy.slab_table import SlabTable
from memory_ext.pool import ChunkPool, LayeredKVBuffers
from memory_ext.pool.layered_kv import group_rows_for
from memory_ext.vmm import host_backend
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.elastic.slab import cell_format, slab_status
from sglang_memx.metrics import render_prometheus
from sglang_memx.top import render
from sglang_memx.upstream.kv import free_page_count

CHUNK = 4096
MiB = 1 << 20


# ------------------------------------------------------------------ formats (policy)


def test_formats_of_the_two_colocated_test_models():
    # A: float32, 2 layers, 2 KV heads x 16: a K (or V) row is 2*16*4 = 128 B -> 32 rows per 4 KiB chunk
    a = slab_format("A", [128] * 4, CHUNK)
    assert (a.tokens_per_slab, a.slab_units, a.bytes_per_token) == (32, 4, 512)
    assert a.slab_bytes == 32 * 512 == 16384 and a.waste_bytes == 0
    # B: bfloat16, 3 layers, 1 KV head x 32: a row is 64 B -> 64 rows per chunk, 6 buffers
    b = slab_format("B", [64] * 6, CHUNK)
    assert (b.tokens_per_slab, b.slab_units, b.bytes_per_token) == (64, 6, 384)
    assert b.slab_bytes == 64 * 384 and b.waste_bytes == 0
    # FineServe's one uniform slab for both: lcm(4, 6) = 12 chunks (3 of A's slabs, 2 of B's)
    assert uniform_slab_units([a.slab_units, b.slab_units]) == 12


def test_slab_holds_whole_tokens_and_wastes_nothing_for_any_row_size():
    for unit in (4096, 64 << 10, 2 * MiB):
        for rb in (2, 6, 64, 96, 320, 384, 1000, 2048, 4104, 6000):
            for page in (1, 4, 16, 64):
                f = slab_format("x", [rb] * 4, unit, page)
                assert f.tokens_per_slab % page == 0
                assert all(f.tokens_per_slab * r % unit == 0 for r in f.row_bytes)
                assert f.waste_bytes == 0 and f.slab_bytes == f.tokens_per_slab * f.bytes_per_token
                # the smallest such: half as many tokens (if still whole pages) would split a unit
                half = f.tokens_per_slab // 2
                if half % page == 0 and half:
                    assert any(half * r % unit for r in f.row_bytes)


@pytest.mark.parametrize(
    "row_bytes, multiple",
    [([64, 64], 1), ([384], 1), ([384, 256], 1), ([64], 128), ([8192], 1), ([6000], 1), ([96] * 6, 16)],
)
def test_the_group_is_the_slab(row_bytes, multiple):
    # the mechanism sizes its groups with the policy's rule: one code path
    assert group_rows_for(row_bytes, CHUNK, multiple) == slab_tokens(row_bytes, CHUNK, multiple)


def test_row_bytes_add_up_to_f2_token_size():
    for prec in (FP16, FP8, INT4):
        lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, precision=prec)
        rows = kv_row_bytes(lay)
        assert len(rows) == 64
        assert sum(rows) == token_kv_bytes(lay, per_layer=False) + token_qparam_bytes(lay, per_layer=False)
    # Llama-3-8B at 2 MiB chunks: each of the 64 buffers needs at least one chunk, so the
    # fp16 and fp8 slabs take the same 64 chunks (128 MiB): 1024 vs 2048 tokens
    f16 = slab_format("fp16", kv_row_bytes(KVLayout(32, 8, 128, precision=FP16)), 2 * MiB)
    f8 = slab_format("fp8", kv_row_bytes(KVLayout(32, 8, 128, precision=FP8)), 2 * MiB)
    assert (f16.tokens_per_slab, f16.slab_units) == (1024, 64) and (f8.tokens_per_slab, f8.slab_units) == (2048, 64)


def test_format_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="row_bytes"):
        slab_format("x", [], CHUNK)
    with pytest.raises(ValueError, match=r"row_bytes\[1\]"):
        slab_format("x", [64, 0], CHUNK)
    with pytest.raises(ValueError, match="unit_bytes"):
        slab_format("x", [64], 0)
    with pytest.raises(ValueError, match="page_tokens"):
        slab_format("x", [64], CHUNK, 0)
    with pytest.raises(ValueError, match="key"):
        slab_format("", [64], CHUNK)
    with pytest.raises(ValueError, match=r"slab_units\[0\]"):
        uniform_slab_units([0])
    with pytest.raises(ValueError, match="slab_units"):
        uniform_slab_units([])


# ------------------------------------------------------------------ SlabTable.adopt


def test_adopt_snapshots_slabs_and_alloc_free_continue_from_it():
    t = SlabTable(5, 4 * MiB)
    t.adopt("a", MiB, 3, 4)  # slab 3: all 4 blocks used
    t.adopt("a", MiB, 1, 1)
    t.adopt("a", MiB, 4, 0)
    assert (t.state(3), t.state(1), t.state(4), t.state(0)) == (t.FULL, t.PARTIAL, t.PARTIAL, t.FREE)
    assert t.slab_counts("a") == {"FREE": 2, "PARTIAL": 2, "FULL": 1, "empty": 1}
    assert t.used_blocks("a") == 5 and t.stranded_blocks("a") == 3 * 4 - 5
    assert t.alloc("a", MiB, 3) == [5, 6, 7]  # the lowest open slab (1), after its taken local 0
    t.free("a", [1 * 4 + 0, 3 * 4 + 2])  # adopted blocks are freed like allocated ones
    assert t.state(3) == t.PARTIAL and t.used_blocks("a") == 6
    assert t.release_empty("a") == 1 and t.state(4) == t.FREE  # the empty adopted slab goes back
    t.check()
    with pytest.raises(ValueError, match="not FREE"):
        t.adopt("a", MiB, 3, 0)
    with pytest.raises(ValueError, match="used"):
        t.adopt("a", MiB, 0, 5)
    with pytest.raises(ValueError, match="slab_id"):
        t.adopt("a", MiB, 5, 0)
    with pytest.raises(ValueError, match="block size"):
        t.adopt("a", 2 * MiB, 0, 0)


# ------------------------------------------------------------------ a server's slab view

GEOMETRY = {  # float32, 2 layers, 2 KV heads x 16 (test model A), page size 1
    "kind": "mha",
    "layers": 2,
    "row_bytes": [128] * 4,
    "kv_heads": 2,
    "head_dim": 16,
    "v_head_dim": 16,
    "k_row_bytes": 128,
    "v_row_bytes": 128,
    "page_size": 1,
    "dtype": torch.float32,
    "store_dtype": torch.float32,
}


def _server(num_tokens=1000, capacity_chunks=400):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    backend = host_backend(CHUNK)
    pool = ChunkPool(backend, capacity_chunks)
    layered = LayeredKVBuffers(pool, [128] * 4, num_tokens + 1, 1)
    kv = ElasticKV(layered, 1, num_tokens)
    kv.cell, kv.slab = cell_format(GEOMETRY, CHUNK)
    alloc = TokenToKVPoolAllocator(num_tokens, torch.float32, "cpu", types.SimpleNamespace(_memx_elastic=kv), True)
    kv.restrict_free_list(alloc)
    return kv, alloc


def test_cell_format_matches_the_groups_and_f2():
    kv, _ = _server()
    assert kv.slab.tokens_per_slab == kv.buffers.group_rows == 32
    assert kv.slab.slab_units == kv.buffers.chunks_per_group == 4
    assert kv.slab.key == "float32 L2 2x16"
    assert kv.cell["token_bytes_per_layer"] == 2 * 16 * 2 * 4 == 256  # heads x head_dim x 2 x bytes
    fp8 = dict(
        GEOMETRY, dtype=torch.float8_e5m2, store_dtype=torch.uint8, k_row_bytes=32, v_row_bytes=32, row_bytes=[32] * 4
    )
    cell, fmt = cell_format(fp8, CHUNK)
    assert cell["token_bytes_per_layer"] == 64 and fmt.bytes_per_token == 128 and fmt.tokens_per_slab == 128
    assert fmt.key == "float8_e5m2 L2 2x16" and cell["store_dtype"] == "uint8"


def test_slab_view_counts_full_partial_free_and_stranded_tokens():
    kv, alloc = _server()  # 1000 tokens, 32-token slabs: groups 0..31 (pages 0..1000)
    assert kv.num_groups == 32
    st = slab_status(kv, alloc)
    assert st["slabs"] == {"FREE": 31, "PARTIAL": 1, "FULL": 0, "empty": 0}  # group 0: padded page held
    assert st["dead_tokens"] == 1 and st["used_tokens"] == 0 and st["stranded_tokens"] == 31
    kv.grow(alloc, 31 + 32 * 3)  # groups 0..3 mapped
    got = alloc.alloc(31 + 32 * 2 + 5)  # fills groups 0-2, 5 tokens of group 3 (lowest pages first)
    assert got is not None
    st = slab_status(kv, alloc)
    assert st["slabs"] == {"FREE": 28, "PARTIAL": 1, "FULL": 3, "empty": 0}
    assert st["used_tokens"] == 31 + 64 + 5 and st["stranded_tokens"] == 27 == free_page_count(alloc)
    assert st["stranded_bytes"] == 27 * 512 and st["bytes_per_token"] == 512
    alloc.free(got[40:60])  # 20 pages of group 1 free: it is PARTIAL now, its free pages stranded
    st = slab_status(kv, alloc)
    assert st["slabs"]["FULL"] == 2 and st["slabs"]["PARTIAL"] == 2 and st["stranded_tokens"] == 47
    alloc.free(torch.cat([got[:40], got[60:]]))
    kv.shrink(alloc)
    st = slab_status(kv, alloc)
    assert st["slabs"] == {"FREE": 31, "PARTIAL": 1, "FULL": 0, "empty": 0} and st["used_tokens"] == 0


def test_slab_view_counts_the_tail_past_capacity_as_dead():
    kv, alloc = _server(num_tokens=1000)
    kv.grow(alloc, 1000)  # every group: the last one (31) holds pages 992..1000 of 992..1023
    assert kv.buffers.num_mapped == 32
    st = slab_status(kv, alloc)
    assert st["dead_tokens"] == 1 + (1024 - 1001) and st["stranded_tokens"] == 1000
    assert alloc.alloc(1000) is not None
    st = slab_status(kv, alloc)
    assert st["slabs"]["FULL"] == 32 and st["stranded_tokens"] == 0 and st["used_tokens"] == 1000


# ------------------------------------------------------------------ status, metrics, top

SLAB = {
    "format": "float32 L2 2x16",
    "kv_dtype": "float32",
    "store_dtype": "float32",
    "layers": 2,
    "kv_heads": 2,
    "head_dim": 16,
    "v_head_dim": 16,
    "token_bytes_per_layer": 256,
    "bytes_per_token": 512,
    "unit_bytes": 4096,
    "tokens_per_slab": 32,
    "pages_per_slab": 32,
    "slab_units": 4,
    "slab_bytes": 16384,
    "waste_bytes": 0,
    "slabs_total": 32,
    "slabs": {"FREE": 28, "PARTIAL": 1, "FULL": 3, "empty": 0},
    "used_tokens": 100,
    "stranded_tokens": 27,
    "stranded_bytes": 27 * 512,
    "dead_tokens": 1,
}


def _rank(slab, pool="p0"):
    return {
        "dp_rank": 0,
        "pool_name": pool,
        "kv_pool": {"capacity_tokens": 1000, "used_tokens": 100, "available_tokens": 900, "evictable_tokens": 0},
        "requests": {"running": 1, "waiting": 0},
        "elastic_kv": {
            "mapped_bytes": 65536, "logical_bytes": 524288, "groups_mapped": 4, "pool_capacity_bytes": 1 << 20,
            "owners_bytes": {"kv": 65536}, "groups_mapped_total": 4, "groups_unmapped_total": 0, "grow_refused": 0,
            "map_seconds": 0.0, "unmap_seconds": 0.0, "max_map_seconds": 0.0, "max_unmap_seconds": 0.0,
            "chunk_bytes": 4096, "backend": {}, "slab": slab,
        },
    }  # fmt: skip


def test_prometheus_shows_the_slab_format_and_counts():
    text = render_prometheus({"schedulers": [_rank(SLAB)]})
    lab = 'dp_rank="0",format="float32 L2 2x16",pool="p0"'
    assert f"memx_kv_slab_bytes_per_token{{{lab}}} 512" in text
    assert f"memx_kv_slab_tokens{{{lab}}} 32" in text and f"memx_kv_slab_bytes{{{lab}}} 16384" in text
    assert f"memx_kv_slab_waste_bytes{{{lab}}} 0" in text
    assert f'memx_kv_slabs{{{lab},state="FULL"}} 3' in text and f'memx_kv_slabs{{{lab},state="FREE"}} 28' in text
    assert f"memx_kv_slab_stranded_bytes{{{lab}}} 13824" in text
    assert "# TYPE memx_kv_slabs gauge" in text
    assert "memx_kv_slab" not in render_prometheus({"schedulers": [_rank(None)]})


def test_top_shows_each_servers_slab_and_the_uniform_slab_of_the_pool():
    other = dict(SLAB, format="bfloat16 L3 1x32", bytes_per_token=384, tokens_per_slab=64, slab_units=6)
    pool = {"name": "p0", "socket": "/x", "budget": 100, "created": 10, "free": 2, "floor": 0, "pending": 0,
            "granularity": 4096, "clients": []}  # fmt: skip
    snap = {
        "time": time.time(),
        "pools": [pool],
        "servers": [
            {"url": "http://a", "status": {"schedulers": [_rank(SLAB)]}},
            {"url": "http://b", "status": {"schedulers": [_rank(other)]}},
        ],
    }
    frame = render(snap)
    assert re.search(r"slab float32 L2 2x16: 512 B/token, 32 tokens = 4 chunk\(s\).*waste 0 B", frame)
    assert "FULL 3 PARTIAL 1 FREE 28, stranded 27 tok" in frame
    assert "slab bfloat16 L3 1x32: 384 B/token, 64 tokens = 6 chunk(s)" in frame
    assert "one uniform slab for all would be 12" in frame


def test_a_snapshot_reads_as_the_simulators_table():
    """The server's view (``adopt`` with per-slab counts) and the simulator's (``alloc`` / ``free``)
    give the same states, counts and stranded blocks for the same slab contents."""
    import random

    rnd = random.Random(7)
    for _ in range(20):
        sim = SlabTable(12, 4 * MiB)
        held = {"a": [], "b": []}
        for _ in range(40):
            key = rnd.choice("ab")
            bs = MiB if key == "a" else 2 * MiB
            if held[key] and rnd.random() < 0.4:
                k = rnd.randint(1, len(held[key]))
                gone, held[key] = held[key][:k], held[key][k:]
                sim.free(key, gone)
            else:
                got = sim.alloc(key, bs, rnd.randint(1, 5))
                held[key] += got or []
        snap = SlabTable(12, 4 * MiB)
        for sid in range(12):
            key = sim.key_of(sid)
            if key is not None:
                bs = MiB if key == "a" else 2 * MiB
                snap.adopt(key, bs, sid, sim.used_in(sid))
        for key in ("a", "b"):
            if key in sim.keys():
                assert snap.slab_counts(key) == sim.slab_counts(key)
                assert snap.stranded_blocks(key) == sim.stranded_blocks(key)
                assert snap.used_blocks(key) == sim.used_blocks(key)
        assert [snap.state(s) for s in range(12)] == [sim.state(s) for s in range(12)]
        snap.check()
