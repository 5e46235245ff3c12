"""Node-wide memory arbiter (X1): the single owner of every GPU's memory
budget, granting and reclaiming memory between the mechanisms of the five
papers (Oneiros weight remapping, Select-N layer offload, eLLM activation
ballooning, SwiftCache peer lending, and plain KV sharing between co-located
models).

Numbers in, decisions out: nothing here allocates, maps or moves memory. The
engine reports how much of each account is idle and which models have work;
the arbiter answers with a ``Grant`` saying how many bytes the requester
gets and which accounts give them up; the engine applies it (shrinks the
donors' pools, grows the requester's). The ledger is updated when the
decision is returned, so the engine must apply every grant it receives.
Standard library only.

Modules: ``accounts`` (accounts, tiers, grants), ``priority`` (the priority rule: one planner
shared with the live device arbiter), ``ledger`` (``MemoryArbiter``); this package re-exports
their public names.
"""

from .accounts import DEFAULT_TIERS, Account, AccountKey, Grant, Kind, PriorityViolation, Take, Tier
from .ledger import MemoryArbiter
from .priority import Donor, lendable_bytes, plan_takes

__all__ = [
    "Donor",
    "lendable_bytes",
    "plan_takes",
    "Kind",
    "Tier",
    "AccountKey",
    "Account",
    "Take",
    "Grant",
    "MemoryArbiter",
    "PriorityViolation",
    "DEFAULT_TIERS",
]
