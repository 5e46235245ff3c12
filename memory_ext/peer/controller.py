"""The donor's loop: SwiftCache Alg. 1 on its own load (``DonationPolicy``) applied to its leases.

``on_demand(now, tokens)`` (the donor needs ``tokens`` of KV now) reclaims what SCALEUP says,
from the leases holding most first, and returns the chunks handed back now (owned by ``to``).
``revoked_chunks`` counts every chunk a reclaim took back, including those still under a
borrower's write fence, which reach their owner later (``PeerDonor(on_release=...)``): a reclaim
happened even when nothing came back at once.

``on_tick(now, supply)`` donates what SCALEDOWN says, spread over the leases (fewest units first),
after ``supply`` has made the chunks it needs available (a shared pool borrows them then). Work
moves in whole MEUs: ``region_units_per_meu`` region units each (the policy's unit is a whole
number of every lease's region units: ``chunk_aligned_unit`` makes it whole chunks, and an exact
region unit, lcm(block, chunk), divides it too). What the mechanism could not do
(no borrower, pool exhausted, a lease at its size cap) goes back to the policy's books, so the
policy never believes it lent memory it still has. A lease that ends gives its units back to the
books too (``PeerDonor(on_lost=controller.lease_lost)``).

Every lease must carry the borrower layout the policy was built for (``accept_layout``).

Pinned leases (a borrower's layer stream cache, HELLO ``pin_bytes``; docs/peer-kv.md, W2) hold
KV that exists nowhere else while the borrower runs: ``on_demand`` never reclaims them (the donor's
own demand is then met from ordinary leases only; what is left short stays short, as the policy's
``shortfall`` says), and ``on_tick`` fills them first, up to ``pin_bytes``, then lends to the others.
A pinned lease's units come back when its borrower leaves or dies (``lease_lost``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..policy.swiftcache import DonationPolicy, KVGeometry
from ..pool.ownership import Owner, PoolError
from .donor import PeerDonor
from .layout import PeerKVLayout

log = logging.getLogger(__name__)


def geometry_of(layout: PeerKVLayout) -> KVGeometry:
    """The policy's view of a borrower layout."""
    return KVGeometry(
        num_layers=layout.num_layers,
        block_size=layout.block_tokens,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype_bytes=layout.itemsize,
    )


class DonorController:
    def __init__(self, policy: DonationPolicy, master: PeerKVLayout, chunk_bytes: int):
        if not isinstance(policy, DonationPolicy):
            raise ValueError(f"policy must be a DonationPolicy, got {type(policy).__name__}")
        if policy.unit.master_block_bytes != master.block_bytes:
            raise ValueError(
                f"master: the policy's borrower blocks are {policy.unit.master_block_bytes} bytes, "
                f"the layout's {master.block_bytes}"
            )
        self.policy, self.master, self.chunk_bytes = policy, master, chunk_bytes
        self.region_units_per_meu = 0
        self.donor: PeerDonor | None = None
        self.revoked_chunks = 0

    def attach(self, donor: PeerDonor) -> None:
        """Drive ``donor``; one MEU must be a whole number of its region units for this layout."""
        unit_bytes = donor.unit_chunks_for(self.master.block_bytes) * self.chunk_bytes
        if self.policy.unit.meu_bytes % unit_bytes:
            raise ValueError(
                f"unit: the policy's MEU ({self.policy.unit.meu_bytes} bytes) is not a whole number of the "
                f"donor's {unit_bytes}-byte region units"
            )
        self.region_units_per_meu = self.policy.unit.meu_bytes // unit_bytes
        self.donor = donor

    def accept_layout(self, layout: PeerKVLayout) -> None:
        """``PeerDonor(accept_layout=...)``: only the borrower layout the policy was sized for."""
        self.master.check_same(layout)

    def lease_lost(self, lease_id: int, units: int) -> None:
        """``PeerDonor(on_lost=...)``: a lease ended with ``units`` region units; they are the donor's again."""
        if self.region_units_per_meu:
            self._unbook(units // self.region_units_per_meu)

    def _unbook(self, meus: int) -> None:
        if meus > 0:
            self.policy.lost(meus * self.policy.unit.meu_worker)

    def _leases(self) -> dict[int, int]:
        donor = self.donor
        if donor is None:
            return {}
        return {lid: donor.region(lid).units for lid in donor.leases()}

    def _pinned_room(self, lid: int, units: int) -> int | None:
        """Region units a pinned lease still wants (None: not pinned)."""
        want = self.donor.pin_bytes(lid)
        if not want:
            return None
        unit_bytes = self.donor.region(lid).unit_bytes
        return max(0, -(-want // unit_bytes) - units)

    def on_tick(self, now: float, supply: Callable[[int], object] | None = None) -> int:
        """SCALEDOWN: donate; returns the chunks donated. ``supply(chunks)`` is called once the
        policy has decided to donate, with the chunks it will ask of the pool (a shared pool's
        server borrows them from the arbiter there): memory is fetched for a decision, never
        before one."""
        leases = self._leases()
        if not leases:
            return 0  # nobody to lend to: decide nothing, so the policy's books stay true
        step = self.policy.on_tick(now)
        if not step.donate:
            return 0
        if supply is not None:
            supply(step.chunks)
        placed = 0
        for _ in range(step.decision.units):
            room = {lid: self._pinned_room(lid, u) for lid, u in leases.items()}
            wanting = [lid for lid, r in room.items() if r]  # pinned leases below their ask come first
            ordinary = sorted((lid for lid, r in room.items() if r is None), key=leases.get)
            for lid in wanting + ordinary:
                try:
                    self.donor.grow(lid, self.region_units_per_meu)
                except (PoolError, ValueError) as exc:
                    log.debug("peer donor: lease %d cannot grow: %s", lid, exc)
                    continue
                leases[lid] += self.region_units_per_meu
                placed += 1
                break
            else:
                break  # no lease could take one more MEU
        self._unbook(step.decision.units - placed)
        return placed * self.policy.unit.meu_bytes // self.policy.chunk_bytes

    def on_demand(self, now: float, tokens: int, *, to: Owner = Owner.FREE) -> list:
        """SCALEUP for the donor's current demand; returns the chunks handed back now (to ``to``)."""
        step = self.policy.on_demand(now, tokens)
        if not step.reclaim:
            return []
        out = []
        leases = {lid: u for lid, u in self._leases().items() if not self.donor.pin_bytes(lid)}
        done = 0
        for _ in range(step.decision.units):
            if not leases or max(leases.values()) < self.region_units_per_meu:
                break
            lid = max(leases, key=leases.get)
            out.extend(self.donor.reclaim(lid, self.region_units_per_meu, to=to))
            leases[lid] -= self.region_units_per_meu
            done += 1
        self.revoked_chunks += done * self.policy.unit.meu_bytes // self.chunk_bytes
        if done < step.decision.units:  # what pinned leases hold stays lent in the books too
            self.policy.still_lent((step.decision.units - done) * self.policy.unit.meu_worker)
        return out
