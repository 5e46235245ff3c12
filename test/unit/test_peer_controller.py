"""The donor's loop (memory_ext.peer.controller): Alg. 1 decisions applied to real leases, and
the policy's books kept equal to what is really lent."""

from __future__ import annotations

import time

import pytest
import torch

from memory_ext.peer import HostCopier, PeerDonor, PeerKVLayout, PeerKVTier
from memory_ext.peer.controller import DonorController, geometry_of
from memory_ext.policy.swiftcache import DonationPolicy, KVGeometry
from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import host_backend, private_dir

G = 1 << 16
MASTER = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32, model="m")  # 8 KiB blocks
DONOR = KVGeometry(num_layers=4, block_size=64, num_kv_heads=2, head_dim=32)  # 64 KiB = one chunk per block


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def make(tmp_path, capacity):
    vmm, bvmm = host_backend(G), host_backend(G)
    pool = ChunkPool(vmm, capacity_chunks=capacity)
    policy = DonationPolicy(
        DONOR, geometry_of(MASTER), chunk_bytes=G, kv_tokens=16 * 64, max_donate_bytes=6 * G, window_s=10
    )
    ctl = DonorController(policy, MASTER, G)
    path = private_dir(tmp_path / "s") + "/d.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=16 * G, accept_layout=ctl.accept_layout, on_lost=ctl.lease_lost)
    ctl.attach(donor)
    return vmm, bvmm, pool, policy, ctl, donor, path


def test_donate_when_idle_reclaim_on_demand_and_books_follow(tmp_path):
    vmm, bvmm, pool, policy, ctl, donor, path = make(tmp_path, capacity=32)
    try:
        assert ctl.region_units_per_meu == 1 and policy.unit.meu_master == 8
        assert ctl.on_tick(0.0) == 0 and policy.donated_chunks == 0  # nobody borrows yet
        tier = PeerKVTier(MASTER)
        link = tier.connect(path, "b", bvmm)
        lease = donor.wait_for_lease()
        assert ctl.on_tick(0.5) == 6  # idle: everything, up to the 6-chunk cap
        assert donor.region(lease).units == 6 and policy.donated_chunks == 6
        wait_until(lambda: link.num_blocks == 48)
        g = torch.Generator().manual_seed(0)
        pages = [torch.randn(MASTER.block_shape, generator=g).half() for _ in range(40)]
        assert tier.store(list(range(40 * 16)), pages) == 40
        wait_until(lambda: all(le["fences"] == 0 for le in donor.status()["leases"]))
        # the donor's own load: 13 of its blocks -> SCALEUP takes 3 MEUs back at once
        back = ctl.on_demand(1.0, 13 * 64, to=Owner.KV)
        assert len(back) == 3 and pool.usage()[Owner.KV] == 3
        assert donor.region(lease).units == 3 and policy.donated_chunks == 3
        wait_until(lambda: link.num_blocks == 24)
        pool.release(Owner.KV, back)
        assert ctl.on_tick(2.0) == 0  # that demand is still in the window
        assert ctl.on_tick(20.0) == 3 and policy.donated_chunks == 6  # window passed: lend again
        link.close()
        wait_until(lambda: not donor.leases())
        assert policy.donated_chunks == 0 and policy.policy.current_blocks == 16  # books follow the loss
        assert pool.usage()[Owner.PEER_DONATION] == 0
    finally:
        donor.close()
        pool.check_invariants()
        vmm.close()
        bvmm.close()


def test_memory_is_supplied_only_for_a_decision_to_donate(tmp_path):
    """``supply`` (a shared pool's borrow) is asked for the chunks of a decision to donate, after
    it: not without a borrower, not while the last demand is in the window."""
    vmm, bvmm, pool, policy, ctl, donor, path = make(tmp_path, capacity=32)
    asked = []
    try:
        assert ctl.on_tick(0.0, supply=asked.append) == 0 and asked == []  # nobody borrows yet
        tier = PeerKVTier(MASTER)
        tier.connect(path, "b", bvmm)
        donor.wait_for_lease()
        assert ctl.on_tick(0.5, supply=asked.append) == 6 and asked == [6]
        pool.release(Owner.KV, ctl.on_demand(1.0, 13 * 64, to=Owner.KV))  # 3 back, the demand in the window
        assert ctl.on_tick(2.0, supply=asked.append) == 0 and asked == [6]  # no decision: nothing asked
        assert ctl.on_tick(20.0, supply=asked.append) == 3 and asked == [6, 3]
        tier.close()
    finally:
        donor.close()
        pool.check_invariants()
        vmm.close()
        bvmm.close()


def test_what_cannot_be_placed_stays_the_donors(tmp_path):
    vmm, bvmm, pool, policy, ctl, donor, path = make(tmp_path, capacity=4)
    try:
        tier = PeerKVTier(MASTER)
        tier.connect(path, "b", bvmm)
        donor.wait_for_lease()
        assert ctl.on_tick(0.0) == 4  # the policy wanted 6; the pool had 4
        assert policy.donated_chunks == 4 and policy.policy.current_blocks == 12
        other = PeerKVLayout(num_layers=2, block_tokens=32, num_kv_heads=2, head_dim=32, model="m")
        with pytest.raises(ValueError, match="layout.block_tokens"):
            PeerKVTier(other).connect(path, "x", bvmm)
        tier.close()
    finally:
        donor.close()
        vmm.close()
        bvmm.close()


def test_a_reclaim_under_a_write_fence_counts_though_its_chunks_come_back_later(tmp_path):
    """A reclaim while the borrower writes to the tail: nothing comes back at once, yet the chunk
    is revoked (``revoked_chunks``), and reaches the pool when the write ends."""
    vmm, bvmm, pool, policy, ctl, donor, path = make(tmp_path, capacity=32)
    late = []
    donor._on_release = lambda lease_id, chunks: late.extend(chunks)
    try:
        tier = PeerKVTier(MASTER)
        link = tier.connect(path, "b", bvmm)
        lease = donor.wait_for_lease()
        assert ctl.on_tick(0.5) == 6
        wait_until(lambda: link.num_blocks == 48)
        seen = {}

        class ReclaimWhileWriting(HostCopier):
            def copy(self, dst, src):
                if "back" not in seen:
                    seen["back"] = ctl.on_demand(1.0, 16 * 64 - 8)  # all but one free block: one MEU back
                dst.copy_(src)

        link.copier = ReclaimWhileWriting()
        g = torch.Generator().manual_seed(1)
        tier.store(list(range(48 * 16)), [torch.randn(MASTER.block_shape, generator=g).half() for _ in range(48)])
        assert seen["back"] == [] and ctl.revoked_chunks >= 1  # fenced: later, yet reclaimed
        assert donor.region(lease).units == 6 - ctl.revoked_chunks
        wait_until(lambda: len(late) == ctl.revoked_chunks)
        assert pool.usage()[Owner.PEER_DONATION] == 6 - ctl.revoked_chunks
        link.close()
    finally:
        donor.close()
        pool.check_invariants()
        vmm.close()
        bvmm.close()
