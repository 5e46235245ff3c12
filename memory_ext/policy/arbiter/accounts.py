"""The vocabulary of the node-wide memory arbiter (X1): accounts, tiers and grants.

Accounts
--------
Memory of GPU ``g`` is split into accounts ``AccountKey(g, owner, kind)``:

* ``weights``    resident weights of a model. Left only by explicit
  decisions of the weight policies (Oneiros REMAP, Select-N offload), never
  taken by ``request``; at least ``floor`` bytes (one layer) always stay.
* ``activation`` an instance's activation reserve. Only its own KV may
  borrow it (eLLM inflation) and give it back (deflation), by ``move``.
* ``kv``         an instance's KV pool. Its *idle* part (free + evictable
  blocks, reported by the engine) is the only part anyone can take.
* ``peer``       memory of ``g`` lent to a model on another GPU (SwiftCache
  peer cache). Given back only by the lender's own SCALEUP (``move``); a
  cache, so it is never "in use".
* free           ``budget - sum(held)``: memory nobody holds.

Every account has a ``unit`` (bytes: it receives, and ``request`` takes
from it, only whole multiples), ``held``, ``idle`` (as last reported: bytes
not in use, 0 <= idle <= held), ``headroom`` (as last reported: idle bytes a
model with work wants to keep for itself) and ``nominal`` (held when opened:
the static plan). An owner's *nominal* on ``g`` is the sum of its accounts'
nominals there; its *excess* is ``held - nominal`` (> 0 when it holds memory
of others, < 0 when it lent some).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class Kind(str, enum.Enum):
    WEIGHTS = "weights"
    ACTIVATION = "activation"
    KV = "kv"
    PEER = "peer"


class Tier(str, enum.Enum):
    """Where granted memory came from (``request`` tiers in priority order,
    then the explicit moves)."""

    FREE = "free"
    RETURN = "return"
    IDLE_PEER = "idle_peer"
    SURPLUS = "surplus"
    REMAP = "remap"
    OWN = "own"
    OFFLOAD = "offload"
    LEND = "lend"
    RECLAIM = "reclaim"


DEFAULT_TIERS: tuple[Tier, ...] = (Tier.FREE, Tier.RETURN, Tier.IDLE_PEER, Tier.SURPLUS)


class PriorityViolation(ValueError):
    """A move that the priority rule forbids (e.g. a remap while idle memory remains)."""


class AccountKey(NamedTuple):
    gpu: int
    owner: str
    kind: Kind


@dataclass
class Account:
    key: AccountKey
    held: int
    unit: int
    floor: int
    nominal: int
    idle: int = 0
    headroom: int = 0


@dataclass(frozen=True)
class Take:
    """``nbytes`` taken from ``source`` (None: the free budget) by ``tier``."""

    source: AccountKey | None
    nbytes: int
    tier: Tier


@dataclass(frozen=True)
class Grant:
    """Answer to a request or move. ``granted`` bytes were added to ``key``;
    the engine must shrink every ``takes`` source that is an account by its
    ``nbytes``. Bytes taken beyond ``granted`` (unit rounding) went to free."""

    key: AccountKey
    asked: int
    granted: int
    takes: tuple[Take, ...]
    reason: str

    @property
    def shortfall(self) -> int:
        return max(self.asked - self.granted, 0)

    def taken_from(self, source: AccountKey) -> int:
        return sum(t.nbytes for t in self.takes if t.source == source)
