"""The KV signal the remap controller observes (Oneiros Alg. 1 line 3, "running out of KV cache
blocks"), from numbers the engine reads: KV groups left once the queue and the running requests
got what they need.

Numbers in, a count out; no clock, no I/O (``sglang_memx.weights.remap`` reads the scheduler,
the allocator, the radix cache and the arbiter, then asks ``free_kv_groups``).

Invariants:

* Pressure reads as 0 groups: KV parked in the host buffer (it waits for device room), or the
  engine refused the queue head for want of KV.
* Supply is what KV could hold now: free and mappable rows plus unreferenced cached prefixes.
* What the arbiter could lend counts (the lent layers' memory may have gone to a peer, which gives
  it back when it no longer needs it) only while layers are lent and nothing waits (a restore
  never competes with admission for the arbiter's memory); for tensor parallel ranks only their
  share (the ranks split it) and only while no request runs: a rank borrows in its tick only, so
  no urgent borrow would rescue a running request's decode step if a restore bet its memory on a
  borrow the arbiter then cannot fund (seen in CI: a request aborted for want of KV at ``--tp 2``).
  One rank (``ranks == 1``) counts it whole: its decode step borrows urgently when short.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_ext.policy._checks import check_int

__all__ = ["ArbiterSupply", "KvSignal", "free_kv_groups"]


@dataclass(frozen=True)
class ArbiterSupply:
    """What a shared pool's arbiter could lend at once, as this rank sees it."""

    free_chunks: int  # chunks the arbiter could lend now (polled)
    ranks: int  # tensor parallel ranks sharing it (1: one process)
    chunks_per_group: int  # chunks behind one KV group

    def __post_init__(self) -> None:
        check_int("free_chunks", self.free_chunks, 0)
        check_int("ranks", self.ranks, 1)
        check_int("chunks_per_group", self.chunks_per_group, 1)


@dataclass(frozen=True)
class KvSignal:
    """One iteration's numbers (tokens are KV token rows)."""

    available_tokens: int  # free or mappable now
    evictable_tokens: int  # held only by unreferenced cached prefixes
    demand_tokens: int  # the next prefill batch's admission need + the running requests' remaining decode
    group_tokens: int  # token rows of one KV group
    parked_on_host: bool = False  # requests' KV waits in the host buffer
    admission_refused: bool = False  # the engine refused the waiting head for want of KV
    waiting: bool = False  # requests wait
    running: bool = False  # requests are admitted (running or mid-prefill)
    layers_lent: bool = False  # some weight layer's memory is lent to KV

    def __post_init__(self) -> None:
        for name in ("available_tokens", "evictable_tokens", "demand_tokens"):
            check_int(name, getattr(self, name), 0)
        check_int("group_tokens", self.group_tokens, 1)


def free_kv_groups(signal: KvSignal, arbiter: ArbiterSupply | None = None) -> int:
    """KV groups left after the demand (module docstring); ``arbiter`` None: a private pool."""
    if signal.parked_on_host or signal.admission_refused:
        return 0
    supply = signal.available_tokens + signal.evictable_tokens
    if arbiter is not None and signal.layers_lent and not signal.waiting:
        if arbiter.ranks == 1 or not signal.running:
            share = arbiter.free_chunks // arbiter.ranks
            supply += share // arbiter.chunks_per_group * signal.group_tokens
    return max(0, supply - signal.demand_tokens) // signal.group_tokens
