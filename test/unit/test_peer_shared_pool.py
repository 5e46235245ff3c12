"""The peer tier over a shared pool: the donor's chunks come from the arbiter (LentPool), it
donates some of them, and the arbiter's books never see the donation (the chunks stay the
donor's); reclaimed chunks can go back to the arbiter, and the borrower keeps no mapping of them."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from memory_ext.peer import PeerDonor, PeerKVLayout, PeerKVTier
from memory_ext.pool import Owner
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.lent_pool import LentPool
from memory_ext.vmm import host_backend

G = 1 << 16
LAYOUT = PeerKVLayout(num_layers=2, block_tokens=16, num_kv_heads=2, head_dim=32, model="m")  # 8 blocks a chunk


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def test_donation_of_arbiter_chunks():
    d = tempfile.mkdtemp(prefix="peer-", dir="/tmp")  # short AF_UNIX paths; mkdtemp makes it 0700
    arb_path, donor_path = os.path.join(d, "p.sock"), os.path.join(d, "p.peer.donor.sock")
    donor_vmm, borrower_vmm = host_backend(G), host_backend(G)
    with Arbiter(arb_path, host_backend(G), 8) as arb:
        lent = LentPool(arb_path, "donor", donor_vmm)
        assert lent.borrow(4) == 4
        donor = PeerDonor(lent.pool, donor_path, max_bytes_per_lease=4 * G)
        tier = PeerKVTier(LAYOUT)
        link = tier.connect(donor_path, "borrower", borrower_vmm)
        try:
            lease = donor.wait_for_lease()
            donor.grow(lease, 2)
            wait_until(lambda: link.num_blocks == 16)
            g = torch.Generator().manual_seed(0)
            pages = [torch.randn(LAYOUT.block_shape, generator=g).half() for _ in range(12)]
            tokens = list(range(12 * 16))
            assert tier.store(tokens, pages) == 12
            out = [torch.empty_like(p) for p in pages]
            assert tier.load(tokens, out) == 12 and all(torch.equal(a, b) for a, b in zip(pages, out))
            [client] = [c for c in lent.client.status()["clients"] if c["name"] == "donor"]
            assert client["held"] == 4  # the arbiter counts the donated chunks as the donor's, once
            assert lent.pool.usage()[Owner.PEER_DONATION] == 2
            # the donor takes its memory back and returns it to the arbiter
            wait_until(lambda: all(le["fences"] == 0 for le in donor.status()["leases"]))
            assert len(donor.reclaim(lease, 2)) == 2
            wait_until(lambda: link.imported_chunks() == 0)  # the borrower maps none of them any more
            assert lent.give_back(4) == 4
            status = lent.client.status()
            assert status["free"] == 4 and status["created"] == 4  # no chunk was created for the donation
            assert tier.load(tokens, out) == 0  # entries gone with the reclaim: recompute
            arb.check_invariants()
        finally:
            tier.close()
            donor.close()
            lent.close()
    donor_vmm.close()
    borrower_vmm.close()
    for p in os.listdir(d):
        os.unlink(os.path.join(d, p))
    os.rmdir(d)
