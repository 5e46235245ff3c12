"""The donated region (block-major, chunk-aligned units, PEER_DONATION, O(1) resize), its
generation table and the KV layout check."""

from __future__ import annotations

import pytest
import torch

from memory_ext.peer import DonatedRegion, GenerationTable, PeerKVLayout
from memory_ext.peer.region import exact_unit_chunks
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import host_backend

G = 1 << 16


@pytest.fixture
def pool():
    vmm = host_backend(G)
    p = ChunkPool(vmm, capacity_chunks=64)
    yield p
    p.check_invariants()
    vmm.close()


def test_layout_block_bytes_and_wire_round_trip():
    lay = PeerKVLayout(num_layers=3, block_tokens=16, num_kv_heads=2, head_dim=32, dtype="bfloat16", model="m")
    assert lay.block_shape == (3, 2, 16, 2, 32)
    assert lay.block_bytes == 3 * 2 * 16 * 2 * 32 * 2
    assert PeerKVLayout.from_wire(lay.to_wire()) == lay


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dtype": "float32"}, "layout.dtype"),
        ({"head_dim": 64}, "layout.head_dim"),
        ({"block_tokens": 32}, "page size"),
    ],
)
def test_layout_mismatch_names_the_field(change, field):
    base = dict(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=field):
        PeerKVLayout(**base).check_same(PeerKVLayout(**{**base, **change}))


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"num_layers": 0}, "num_layers"), ({"dtype": "float64"}, "dtype"), ({"head_dim": True}, "head_dim")],
)
def test_layout_bad_input(kw, field):
    base = dict(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=field):
        PeerKVLayout(**{**base, **kw})
    with pytest.raises(ValueError, match="unknown field"):
        PeerKVLayout.from_wire({**base, "rope": 1})


def test_exact_unit_is_lcm_of_block_and_chunk(pool):
    lay = PeerKVLayout(num_layers=3, block_tokens=16, num_kv_heads=2, head_dim=32)  # 12288-byte blocks
    assert exact_unit_chunks(lay.block_bytes, G) == 3  # lcm = 196608 bytes = 16 blocks
    r = DonatedRegion(pool, lay.block_bytes, max_units=4, unit_chunks=3)
    r.grow(1)
    assert r.unit_bytes == 196608 and r.num_blocks == 16 and r.max_blocks == 64
    r.close()


def test_chunk_units_hold_the_complete_blocks_and_straddlers_go_first(pool):
    bb = 12288  # 5.33 blocks a chunk: block 5 straddles chunks 0 and 1
    r = DonatedRegion(pool, bb, max_units=4)
    r.grow(1)
    assert r.num_blocks == 5  # 61440 of 65536 bytes used
    r.grow(1)
    assert r.num_blocks == 10 and r.blocks_of_unit(1) == range(5, 11)
    r.view(9).fill_(9)  # complete blocks of mapped chunks are usable, the straddler included
    r.view(5).fill_(5)
    gens = [r.generations.get(b) for b in range(11)]
    assert r.revoke_tail(1) == range(5, 10)  # block 5 is no longer complete: it goes too
    assert [r.generations.get(b) - g for b, g in enumerate(gens)] == [0] * 5 + [1] * 5 + [0]
    assert r.release_tail(fenced=lambda blocks: 5 in blocks) == []  # a write on block 5 holds chunk 1
    assert len(r.release_tail()) == 1 and r.physical_units == 1
    r.close()


def test_grow_and_shrink_are_chunk_moves_at_the_tail(pool):
    bb = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32).block_bytes  # 8192
    r = DonatedRegion(pool, bb, max_units=8)
    vmm = pool.backend
    r.grow(3)
    assert r.units == 3 and r.num_blocks == 24
    assert pool.usage()[Owner.PEER_DONATION] == 3
    # fill every block with its own pattern
    for b in range(r.num_blocks):
        r.view(b).fill_(b + 1)
    before = vmm.counters()
    r.grow(2)  # O(1): only the new unit's chunks are mapped; no existing byte moves
    after = vmm.counters()
    assert after["map_calls"] - before["map_calls"] == 2 * r.unit_chunks
    assert after["unmap_calls"] == before["unmap_calls"]
    for b in range(24):
        assert bool((r.view(b) == b + 1).all())
    gens = [r.generations.get(b) for b in range(r.num_blocks)]
    revoked = r.revoke_tail(2)
    assert revoked == range(24, 40) and r.units == 3 and r.physical_units == 5
    assert [r.generations.get(b) for b in revoked] == [g + 1 for g in gens[24:40]]
    assert [r.generations.get(b) for b in range(24)] == gens[:24]  # untouched blocks keep theirs
    before = vmm.counters()
    chunks = r.release_tail(Owner.KV)
    assert len(chunks) == 2 and vmm.counters()["unmap_calls"] - before["unmap_calls"] == 2
    assert pool.usage()[Owner.KV] == 2 and pool.usage()[Owner.PEER_DONATION] == 3
    for b in range(24):
        assert bool((r.view(b) == b + 1).all())
    pool.release(Owner.KV, chunks)
    r.close()
    assert pool.usage()[Owner.PEER_DONATION] == 0


def test_fenced_unit_is_kept_until_released(pool):
    r = DonatedRegion(pool, 8192, max_units=4)  # 8 blocks per unit
    r.grow(3)
    r.revoke_tail(2)  # units 1 and 2 revoked
    fenced_blocks = set(range(8, 16))  # a write still fences unit 1
    out = r.release_tail(fenced=lambda blocks: bool(fenced_blocks & set(blocks)))
    assert len(out) == 1 and r.physical_units == 2  # unit 2 went back, unit 1 waits
    with pytest.raises(ValueError, match="revoked unit"):
        r.grow(1)
    assert len(r.release_tail()) == 1 and r.physical_units == 1
    r.grow(1)
    r.close()


def test_grow_is_all_or_nothing_and_bounded(pool):
    r = DonatedRegion(pool, 8192, max_units=2)
    with pytest.raises(ValueError, match="max_units"):
        r.grow(3)
    small = ChunkPool(pool.backend, capacity_chunks=1)
    r2 = DonatedRegion(small, 8192, max_units=4)
    with pytest.raises(Exception, match="exhausted"):
        r2.grow(2)
    assert small.usage()[Owner.PEER_DONATION] == 0 and r2.units == 0
    r.close()
    r2.close()
    small.close()


def test_generation_table_shared_read_only():
    t = GenerationTable.create(10)
    fd = t.export_fd()
    ro = GenerationTable.open(fd, 10)
    assert [ro.get(b) for b in range(10)] == [1] * 10
    t.bump([3, 3, 7])
    assert ro.get(3) == 3 and ro.get(7) == 2 and ro.get(0) == 1
    with pytest.raises(PermissionError):
        ro.bump([0])
    with pytest.raises(ValueError, match="generations"):
        GenerationTable.open(t.export_fd(), 11)
    ro.close()
    t.close()
    assert torch.tensor(0).item() == 0
