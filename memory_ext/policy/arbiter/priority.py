"""The priority rule of the node-wide memory arbiter (X1), as one planner shared by the
simulator's ledger (``ledger.MemoryArbiter``) and the live device arbiter
(``memory_ext.pool.arbiter``).

Priority rule
-------------
``request(key, nbytes)`` (a KV shortage, or a weights restore) is served
from memory that is already idle, cheapest first, never from memory in use:

1. ``FREE``      unallocated budget of the GPU;
2. ``RETURN``    idle KV of other owners holding more than their nominal --
   borrowed memory that sits idle goes back first -- at most their excess.
   The borrower keeps its headroom, unless the requester is *entitled*:
   below its own nominal (it lent memory) -- then every idle borrowed byte
   goes back as soon as it is idle;
3. ``IDLE_PEER`` idle KV of other owners that have no work at all (idle
   models), down to ``floor_fraction`` of each one's nominal KV, so that a
   model waking up can start at once;
4. ``SURPLUS``   idle KV beyond their headroom of other owners that do have
   work, down to the same floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .accounts import AccountKey, Kind, Tier


def floor_to(x: int, unit: int) -> int:
    """``x`` rounded down to a multiple of ``unit``."""
    return x - x % unit


def ceil_to(x: int, unit: int) -> int:
    """``x`` rounded up to a multiple of ``unit``."""
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Donor:
    """What the planner knows of one KV account: ``held``/``idle``/``headroom``/``unit`` as in
    ``Account``; ``nominal`` its static plan; ``owner_excess`` what its owner holds beyond its
    nominal on that GPU (all accounts); ``busy`` whether its owner has work."""

    key: AccountKey
    held: int
    idle: int
    headroom: int
    unit: int
    nominal: int
    owner_excess: int
    busy: bool


def lendable_bytes(
    d: Donor, tier: Tier, requester_owner: str | None, spent: int, entitled: bool, floor_fraction: float
) -> int:
    """Bytes a request by ``requester_owner`` may take from ``d`` by ``tier``, ``spent`` being
    what was already planned from it (module docstring, priority rule)."""
    if d.key.kind is not Kind.KV or d.key.owner == requester_owner:
        return 0
    idle, held = d.idle - spent, d.held - spent
    if tier is Tier.RETURN:
        keep = 0 if entitled else d.headroom
        cap = min(idle - keep, d.owner_excess - spent)
    elif tier in (Tier.IDLE_PEER, Tier.SURPLUS):
        if d.busy != (tier is Tier.SURPLUS):
            return 0
        floor = ceil_to(int(floor_fraction * d.nominal), d.unit)
        cap = min(idle - (d.headroom if d.busy else 0), held - floor)
    else:
        return 0
    return max(floor_to(cap, d.unit), 0)


def plan_takes(
    requester_owner: str,
    want: int,
    free: int,
    donors: Sequence[Donor],
    tiers: Sequence[Tier],
    entitled: bool,
    floor_fraction: float,
) -> tuple[int, list[tuple[Donor, int, Tier]]]:
    """The one answer to "where does ``want`` come from": ``free`` first (if ``Tier.FREE`` is in
    ``tiers``), then RETURN, IDLE_PEER, SURPLUS, each tier taking from the donors with the most
    lendable first (owner names break ties). Returns ``(gathered, [(donor, nbytes, tier)])``;
    ``gathered`` may fall short of ``want``. ``MemoryArbiter`` (simulator ledger) and the live
    device arbiter (``memory_ext.pool.arbiter``) both plan with it."""
    pool = free if Tier.FREE in tiers else 0
    takes: list[tuple[Donor, int, Tier]] = []
    spent: dict[AccountKey, int] = {}
    for tier in (Tier.RETURN, Tier.IDLE_PEER, Tier.SURPLUS):
        if tier not in tiers or pool >= want:
            continue
        scored = []
        for d in donors:
            cap = lendable_bytes(d, tier, requester_owner, spent.get(d.key, 0), entitled, floor_fraction)
            if cap > 0:
                scored.append((-cap, d.key.owner, d, cap))
        for _, _, d, cap in sorted(scored, key=lambda x: (x[0], x[1])):
            if pool >= want:
                break
            t = min(cap, ceil_to(want - pool, d.unit))
            takes.append((d, t, tier))
            spent[d.key] = spent.get(d.key, 0) + t
            pool += t
    return pool, takes
