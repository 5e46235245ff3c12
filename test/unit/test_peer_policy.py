"""The donor's decisions (SwiftCache Alg. 1 on a chunk-aligned MEU, with a donation cap):
memory_ext.policy.swiftcache.chunk_aligned_unit / DonationPolicy / scale_down(max_donated_blocks)."""

from __future__ import annotations

import math

import pytest

from memory_ext.peer import PeerKVLayout
from memory_ext.policy.swiftcache import (
    DonationPolicy,
    KVGeometry,
    ScaleAction,
    chunk_aligned_unit,
    min_elastic_unit,
    scale_down,
)

CHUNK = 1 << 16
MASTER = KVGeometry(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32)  # 8192-byte blocks
WORKER = KVGeometry(num_layers=3, block_size=16, num_kv_heads=2, head_dim=32)  # 12288-byte blocks


def test_chunk_aligned_unit_is_the_smallest_common_multiple():
    raw = min_elastic_unit(MASTER, WORKER)
    assert raw.meu_bytes == math.lcm(8192, 12288) == 24576
    u = chunk_aligned_unit(raw, CHUNK)
    assert u.meu_bytes == math.lcm(8192, 12288, CHUNK) == 196608
    assert (u.meu_master, u.meu_worker) == (raw.meu_master * 8, raw.meu_worker * 8) == (24, 16)
    assert u.meu_master * u.master_block_bytes == u.meu_worker * u.worker_block_bytes == u.meu_bytes
    assert chunk_aligned_unit(u, CHUNK) is u  # already aligned


def test_policy_unit_is_whole_units_of_the_donated_region():
    """What the policy moves is always a whole number of the region's elastic units."""
    lay = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32)
    region_unit = math.lcm(lay.block_bytes, CHUNK)
    u = chunk_aligned_unit(min_elastic_unit(MASTER, WORKER), CHUNK)
    assert u.meu_bytes % region_unit == 0


def test_scale_down_cap():
    d = scale_down(100, 16, 4, 6, [], donated_blocks=10, max_donated_blocks=21)
    assert d.action is ScaleAction.SCALE_DOWN and d.units == 2 and d.donated_blocks_after == 18
    assert d.reason == "release MEUs up to the donation cap"
    d = scale_down(100, 16, 4, 6, [], donated_blocks=20, max_donated_blocks=21)
    assert d.action is ScaleAction.NONE and d.reason == "donation cap reached"
    uncapped = scale_down(100, 16, 4, 6, [], donated_blocks=20)
    assert uncapped.units == 25
    with pytest.raises(ValueError, match="max_donated_blocks needs donated_blocks"):
        scale_down(100, 16, 4, 6, [], max_donated_blocks=8)


def test_donor_donates_when_idle_and_reclaims_on_demand():
    pol = DonationPolicy(
        WORKER, MASTER, chunk_bytes=CHUNK, kv_tokens=16 * 160, max_donate_bytes=10 * 196608, window_s=10
    )
    unit = pol.unit
    # idle: Alg. 1 SCALEDOWN gives everything the window did not need, up to the cap (10 units)
    step = pol.on_tick(0.0)
    assert step.donate and step.decision.units == 10
    assert step.chunks == 10 * unit.meu_bytes // CHUNK == 30
    assert step.master_blocks == 10 * unit.meu_master
    assert pol.donated_chunks == 30 and pol.policy.current_blocks == 160 - 160
    assert pol.on_tick(1.0).action is ScaleAction.NONE  # capped
    # a request of 40 worker blocks: SCALEUP reclaims ceil(40 / 16) = 3 units at once
    step = pol.on_demand(2.0, 16 * 40)
    assert step.reclaim and step.decision.units == 3 and step.chunks == 9
    assert pol.policy.current_blocks == 48 and pol.donated_chunks == 21
    # while that request is in the window, nothing above it is donated back...
    assert pol.on_tick(5.0).action is ScaleAction.NONE
    # ...after the window, the surplus over min_tokens goes again (cap allows 3 units)
    step = pol.on_tick(13.0)
    assert step.donate and step.decision.units == 3 and pol.donated_chunks == 30
    pol.lost(pol.policy.donated_blocks)  # borrower died: all of it is the donor's again
    assert pol.donated_chunks == 0 and pol.policy.current_blocks == 160


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_aligned_unit(min_elastic_unit(MASTER, WORKER), 0)
    with pytest.raises(ValueError, match="kv_tokens"):
        DonationPolicy(WORKER, MASTER, chunk_bytes=CHUNK, kv_tokens=-1)
    with pytest.raises(ValueError, match="max_donate_bytes"):
        DonationPolicy(WORKER, MASTER, chunk_bytes=CHUNK, kv_tokens=100, max_donate_bytes=-5)
    with pytest.raises(ValueError, match="unit"):
        chunk_aligned_unit("x", CHUNK)
