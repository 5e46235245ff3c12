"""Layer stream cache (W2) against a real donor in this process: a forward over resident and streamed
layers gives the same KV as all layers local; the donor never reclaims a pinned lease; the donor's
death breaks the cache with a named error and leaves nothing mapped; the layer split from plan_lsc."""

from __future__ import annotations

import os

import pytest
import torch

from memory_ext.peer import LayerStreamCache, LayerStreamLost, PeerDonor, PeerKVLayout, PeerLink
from memory_ext.peer.controller import DonorController, geometry_of
from memory_ext.peer.lsc import plane_bytes
from memory_ext.policy.swiftcache import DonationPolicy, KVGeometry, plan_layer_stream, plan_lsc
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import host_backend, private_dir
from support.waiting import wait_until as support_wait_until

G = 1 << 16
LAYERS, HEADS, DIM, ROWS = 4, 2, 8, 512
LAYOUT = PeerKVLayout(num_layers=LAYERS, block_tokens=16, num_kv_heads=HEADS, head_dim=DIM, dtype="float32", model="m")
ROW_BYTES = HEADS * DIM * 4


def wait_until(cond, timeout=5.0):
    support_wait_until(cond, timeout, interval=0.002)


@pytest.fixture
def env(tmp_path):
    donor_vmm = host_backend(G)
    pool = ChunkPool(donor_vmm, capacity_chunks=64)
    path = private_dir(tmp_path / "s") + "/donor.sock"
    lost = []  # controllers to tell when a lease ends (PeerDonor(on_lost=...), as the server wires it)
    donor = PeerDonor(pool, path, max_bytes_per_lease=32 * G, name="d",
                      on_lost=lambda lease, units: [c.lease_lost(lease, units) for c in lost])  # fmt: skip
    donor.lost = lost
    borrower_vmm = host_backend(G)
    yield donor, pool, path, borrower_vmm
    donor.close()
    wait_until(lambda: borrower_vmm.ranges() == [])
    pool.check_invariants()
    assert pool.usage()[Owner.PEER_DONATION] == 0
    donor_vmm.close()
    borrower_vmm.close()


def pinned_link(donor, path, vmm, streamed):
    need = len(streamed) * plane_bytes(ROWS, ROW_BYTES, ROW_BYTES)
    link = PeerLink(path, "b", LAYOUT, vmm, pin_bytes=need)
    lease = donor.wait_for_lease()
    assert donor.pin_bytes(lease) == need
    units = -(-need // G) + 1  # whole blocks of the last unit may straddle
    donor.grow(lease, units)
    wait_until(lambda: link.usable_bytes >= need)
    return link, lease


def staging():
    return torch.zeros(ROWS, HEADS, DIM), torch.zeros(ROWS, HEADS, DIM)


def test_forward_over_streamed_layers_equals_all_local(env):
    """Three steps of a 'forward' (each layer reads its used rows and writes new ones) give, for
    every layer, the same K/V as buffers that are all local; the staging buffer is shared."""
    donor, pool, path, vmm = env
    streamed = [1, 2, 3]
    link, _ = pinned_link(donor, path, vmm, streamed)
    sk, sv = staging()
    lsc = LayerStreamCache(link, streamed, sk, sv)
    ref_k = [torch.zeros(ROWS, HEADS, DIM) for _ in range(LAYERS)]
    ref_v = [torch.zeros(ROWS, HEADS, DIM) for _ in range(LAYERS)]
    mine_k = [ref_k[0].clone()] + [sk] * 3  # layer 0 resident, 1..3 alias the staging buffer
    mine_v = [ref_v[0].clone()] + [sv] * 3
    g = torch.Generator().manual_seed(1)
    used = torch.empty(0, dtype=torch.int64)
    for step, n_new in enumerate((40, 7, 1)):
        free = torch.tensor(sorted(set(range(1, ROWS)) - set(used.tolist())), dtype=torch.int64)
        new = free[torch.randperm(len(free), generator=g)[:n_new]]
        used = torch.cat([used, new])
        for layer in range(LAYERS):
            if lsc.streams(layer):
                lsc.load(layer, used)
            k_new, v_new = torch.randn(n_new, HEADS, DIM, generator=g), torch.randn(n_new, HEADS, DIM, generator=g)
            for bufs_k, bufs_v in ((ref_k, ref_v), (mine_k, mine_v)):
                bufs_k[layer][new] = k_new  # the attention writes the new tokens
                bufs_v[layer][new] = v_new
            # what the attention reads: every used row of this layer
            assert torch.equal(mine_k[layer][used], ref_k[layer][used]), (step, layer)
            assert torch.equal(mine_v[layer][used], ref_v[layer][used]), (step, layer)
            if lsc.streams(layer):
                lsc.store(layer, new)
    st = lsc.status()
    assert st["layers_loaded"] == 9 and st["layers_stored"] == 9
    assert st["rows_stored"] == 3 * 48 and st["bytes_loaded"] == 3 * (40 + 47 + 48) * 2 * ROW_BYTES
    # the staging buffer holds one layer only: the donor's planes hold every streamed layer
    for layer in streamed:
        lsc.load(layer, used)
        assert torch.equal(sk[used], ref_k[layer][used]) and torch.equal(sv[used], ref_v[layer][used])
    link.close()


def test_lease_too_small_is_named(env):
    donor, pool, path, vmm = env
    link = PeerLink(path, "b", LAYOUT, vmm, pin_bytes=G)
    lease = donor.wait_for_lease()
    donor.grow(lease, 1)
    wait_until(lambda: link.usable_bytes > 0)
    sk, sv = staging()
    with pytest.raises(ValueError, match="pin_bytes"):
        LayerStreamCache(link, [1, 2], sk, sv)
    with pytest.raises(ValueError, match="streamed"):
        LayerStreamCache(link, [], sk, sv)
    link.close()


def test_donor_never_reclaims_a_pinned_lease(env):
    """The controller fills the pinned lease first and reclaims only from ordinary leases; what only
    the pinned lease holds stays lent in the policy's books."""
    donor, pool, path, vmm = env
    geometry = geometry_of(LAYOUT)
    policy = DonationPolicy(geometry, geometry, chunk_bytes=G, kv_tokens=64 * 16 * 16, window_s=1.0)
    ctl = DonorController(policy, LAYOUT, G)
    ctl.attach(donor)
    donor.lost.append(ctl)
    need = 2 * plane_bytes(ROWS, ROW_BYTES, ROW_BYTES)  # 4 chunks
    link = PeerLink(path, "lsc", LAYOUT, vmm, pin_bytes=need)
    pinned = donor.wait_for_lease()
    assert ctl.on_tick(0.0) > 0  # idle: donates; the pinned lease gets its ask first
    assert donor.region(pinned).units * G >= need
    wait_until(lambda: link.usable_bytes >= need - LAYOUT.block_bytes)
    lent_before = policy.donated_chunks
    back = ctl.on_demand(0.5, 64 * 16 * 16)  # the donor now needs everything it has
    assert back == []  # only the pinned lease holds memory: nothing reclaimed
    assert donor.region(pinned).units * G >= need
    assert policy.donated_chunks == lent_before  # the books still say it is lent
    link.close()
    wait_until(lambda: donor.leases() == [])
    assert policy.donated_chunks == 0  # the lease ended: the units are the donor's again


def test_ordinary_lease_is_reclaimed_pinned_kept(env):
    donor, pool, path, vmm = env
    geometry = geometry_of(LAYOUT)
    policy = DonationPolicy(geometry, geometry, chunk_bytes=G, kv_tokens=64 * 16 * 16, window_s=1.0)
    ctl = DonorController(policy, LAYOUT, G)
    ctl.attach(donor)
    pinned_link_ = PeerLink(path, "lsc", LAYOUT, vmm, pin_bytes=2 * G)
    pinned = donor.wait_for_lease()
    ordinary_link = PeerLink(path, "tier", LAYOUT, vmm)
    wait_until(lambda: len(donor.leases()) == 2)
    ordinary = next(lid for lid in donor.leases() if lid != pinned)
    ctl.on_tick(0.0)
    assert donor.region(pinned).units == 2  # its ask, no more
    assert donor.region(ordinary).units > 2  # the rest went to the ordinary lease
    ctl.on_demand(0.5, 64 * 16 * 16)
    assert donor.region(pinned).units == 2 and donor.region(ordinary).units == 0
    pinned_link_.close()
    ordinary_link.close()


def test_donor_death_breaks_the_cache_and_leaves_nothing(env):
    donor, pool, path, vmm = env
    link, _ = pinned_link(donor, path, vmm, [2, 3])
    sk, sv = staging()
    lsc = LayerStreamCache(link, [2, 3], sk, sv)
    rows = torch.arange(1, 33)
    lsc.store(2, rows)
    fds_before = len(os.listdir("/proc/self/fd"))
    donor.close()  # the donor stops: every lease closed
    wait_until(lambda: link.closed)
    with pytest.raises(LayerStreamLost, match="gone"):
        lsc.load(2, rows)
    assert lsc.broken is not None
    with pytest.raises(LayerStreamLost):
        lsc.store(3, rows)  # stays broken
    assert link.imported_chunks() == 0 and vmm.ranges() == []
    assert len(os.listdir("/proc/self/fd")) <= fds_before


def test_plan_layer_stream_follows_plan_lsc():
    geom = KVGeometry(num_layers=8, block_size=16, num_kv_heads=2, head_dim=8, dtype_bytes=4)
    b = 2 * 2 * 8 * 4  # K+V of one token, one layer
    local = 1024 * 8 * b  # a stock server holds 1024 tokens
    # a donor lending 8 x as much: every layer streams, capacity = 8 x stock (the paper's bound)
    p = plan_layer_stream(geom, local, [8 * local])
    assert p.lsc == plan_lsc(geom, local, [8 * local])
    assert p.baseline_tokens == 1024
    assert (p.resident_layers, p.streamed_layers, p.staging_layers) == (0, 8, 1)
    assert p.capacity_tokens == 8 * 1024 == p.lsc.max_context_tokens
    assert p.local_bytes <= local and p.peer_bytes <= 8 * local
    # the paper's worked example (L=10, K_master=100 blocks, workers 9 + 8 full-layer blocks)
    geom10 = KVGeometry(num_layers=10, block_size=16, num_kv_heads=2, head_dim=8, dtype_bytes=4)
    mb = 16 * b
    p10 = plan_layer_stream(geom10, 100 * mb, [9 * 10 * mb, 8 * 10 * mb])
    assert p10.lsc.max_context_blocks == 25 and p10.baseline_tokens == 10 * 16
    assert p10.capacity_tokens <= 25 * 16 and p10.capacity_tokens % 16 == 0
    assert p10.local_bytes <= 100 * mb and p10.peer_bytes <= 170 * mb
    assert p10.capacity_tokens == 24 * 16 and p10.resident_layers == 3  # 4 layers x 24 blocks local
    # no donation: nothing streams, the stock capacity
    p0 = plan_layer_stream(geom, local, [0])
    assert (p0.streamed_layers, p0.staging_layers, p0.capacity_tokens) == (0, 0, 1024)
    with pytest.raises(ValueError, match="staging_layers"):
        plan_layer_stream(geom, local, [local], staging_layers=0)
