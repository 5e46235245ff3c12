"""The arbiter's ledger of one device's chunks (package docstring, "Ledger and invariants"): every
chunk created, which are FREE, which client holds each, and the clients with what they adopted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...vmm.base import PhysicalChunk, VmmBackend
from .records import ClientRecord


class ArbiterInvariantError(AssertionError):
    pass


@dataclass
class ChunkLedger:
    """Chunks of one device lent to connected clients. Invariant (``check``): every created chunk
    is FREE or held by exactly one client, and ``created + adopted <= budget``."""

    backend: VmmBackend
    budget: int
    chunks: dict[int, PhysicalChunk] = field(default_factory=dict)  # every chunk created, by handle id
    free: list[int] = field(default_factory=list)  # LIFO: most recently returned first
    holder: dict[int, int] = field(default_factory=dict)  # chunk id -> client id
    clients: dict[int, ClientRecord] = field(default_factory=dict)

    def adopted_total(self) -> int:
        return sum(c.adopted for c in self.clients.values())

    def created(self) -> int:
        """Chunks counted against the budget: created here, or adopted."""
        return len(self.chunks) + self.adopted_total()

    def available_now(self) -> int:
        return len(self.free) + self.budget - self.created()

    def check(self) -> None:
        """Raise ``ArbiterInvariantError`` if an invariant is broken."""
        free = set(self.free)
        if len(free) != len(self.free):
            raise ArbiterInvariantError("a chunk is listed FREE twice")
        seen = set(free)
        for c in self.clients.values():
            for cid in c.held:
                if cid in seen:
                    raise ArbiterInvariantError(f"chunk {cid} is held twice (or held and free)")
                if self.holder.get(cid) != c.cid:
                    raise ArbiterInvariantError(f"chunk {cid}: holder map disagrees")
                seen.add(cid)
        held = sum(len(c.held) for c in self.clients.values())
        if len(self.holder) != held:
            raise ArbiterInvariantError(f"holder map has {len(self.holder)} entries, clients hold {held}")
        if seen != set(self.chunks):
            raise ArbiterInvariantError(f"chunks neither free nor held: {sorted(set(self.chunks) - seen)}")
        adopted = self.adopted_total()
        if held + len(self.free) != len(self.chunks) or len(self.chunks) + adopted > self.budget:
            raise ArbiterInvariantError(
                f"held {held} + free {len(self.free)} != created {len(self.chunks)} "
                f"(adopted {adopted}, budget {self.budget})"
            )
        live = {c.handle_id for c in self.backend.live_chunks()}
        if not set(self.chunks) <= live:
            raise ArbiterInvariantError("a pooled chunk was destroyed in the backend")
