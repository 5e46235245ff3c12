"""Which CPU cores each co-located engine of a device computes on, from who has work.

A CPU device's cores are split among its engines (each engine's own share, so two busy
engines never run their OpenMP threads on the same cores: oversubscribed OpenMP runs many
times slower). A static split leaves an engine on its share while its siblings sit idle —
on a GPU one busy model would use all SMs. The rule here lends idle engines' cores to the
busy ones and gives them back the moment their owner has work again.

Numbers in, decisions out (no I/O, no clock). Invariants:

* an idle engine keeps exactly its own share (it computes nothing; it needs its cores
  the moment it has work, without asking);
* a busy engine always has its own share, plus a near-equal part of the idle engines'
  cores (dealt round-robin in slot order, so every busy engine computes the same answer
  for every other);
* the busy engines' cores never overlap, and with every engine busy each has its share;
* the whole device (every sibling idle) is on offer only once every sibling has been idle for
  ``quiet_s`` (``siblings_quiet``): a sibling busy moments ago is likely to get its next request
  soon, which would meet the lender's threads on its cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ComputeShares", "ComputeShareError", "Offer", "cores_for", "offer", "siblings_quiet"]


class ComputeShareError(ValueError):
    """A bad share table; the message names the field."""


@dataclass(frozen=True)
class ComputeShares:
    """Each engine slot's own cores on one device (slot = engine's place in the launcher's order).
    Shares overlap only when the device has fewer cores than engines."""

    shares: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.shares:
            raise ComputeShareError("shares: at least one engine slot is needed")
        for slot, cores in enumerate(self.shares):
            if not cores:
                raise ComputeShareError(f"shares[{slot}]: an engine needs at least one core")
            for c in cores:
                if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                    raise ComputeShareError(f"shares[{slot}]: core {c!r} is not a core number")

    @classmethod
    def parse(cls, text: str) -> ComputeShares:
        """``"0,1;2,3"``: slot 0 computes on cores 0 and 1, slot 1 on 2 and 3."""
        try:
            return cls(tuple(tuple(int(c) for c in part.split(",")) for part in text.split(";")))
        except ValueError as e:
            if isinstance(e, ComputeShareError):
                raise
            raise ComputeShareError(f"shares: {text!r} is not 'cores;cores;...' (e.g. '0,1;2,3')") from None

    def render(self) -> str:
        return ";".join(",".join(map(str, cores)) for cores in self.shares)

    @property
    def slots(self) -> int:
        return len(self.shares)


def cores_for(slot: int, table: ComputeShares, busy: Sequence[bool]) -> tuple[int, ...]:
    """The cores engine ``slot`` computes on when ``busy[i]`` says which engines have work."""
    if not 0 <= slot < table.slots:
        raise ComputeShareError(f"slot: {slot} is not one of {table.slots} engine slots")
    if len(busy) != table.slots:
        raise ComputeShareError(f"busy: {len(busy)} flags for {table.slots} engine slots")
    own = table.shares[slot]
    if not busy[slot]:
        return own
    busy_slots = [i for i in range(table.slots) if busy[i]]
    spare = sorted({c for i in range(table.slots) if not busy[i] for c in table.shares[i]} - set(own))
    # every busy engine's own cores stay its own, even where shares overlap (fewer cores than engines)
    taken = {c for i in busy_slots for c in table.shares[i]}
    spare = [c for c in spare if c not in taken]
    mine = spare[busy_slots.index(slot) :: len(busy_slots)]
    return tuple(sorted(set(own) | set(mine)))


def siblings_quiet(slot: int, last_busy: Sequence[float], now: float, quiet_s: float) -> bool:
    """Whether every engine but ``slot`` has been idle for at least ``quiet_s`` at ``now``;
    ``last_busy[i]``: when engine ``i`` last had work (0: never)."""
    if not quiet_s >= 0:
        raise ComputeShareError(f"quiet_s: must be >= 0, got {quiet_s!r}")
    return all(t <= 0 or now - t >= quiet_s for i, t in enumerate(last_busy) if i != slot)


@dataclass(frozen=True)
class Offer:
    """What engine ``slot`` may compute on now (``offer``): ``cores`` (its own share when nothing
    more is on offer); ``whole_device``: every sibling is idle; ``quiet``: ... and has been for
    ``quiet_s``, so the idle siblings' cores are on offer (else only the own share)."""

    cores: tuple[int, ...]
    whole_device: bool
    quiet: bool


def offer(slot: int, table: ComputeShares, busy: Sequence[bool], last_busy: Sequence[float], now: float,
          quiet_s: float) -> Offer:  # fmt: skip
    """``cores_for`` with the quiet rule: while every sibling is idle, their cores are on offer only
    once each has been idle ``quiet_s`` (``siblings_quiet``); ``last_busy[i]``: when engine ``i``
    last had work (0: never)."""
    if len(last_busy) != table.slots:
        raise ComputeShareError(f"last_busy: {len(last_busy)} stamps for {table.slots} engine slots")
    cores = cores_for(slot, table, busy)
    whole = not any(b for i, b in enumerate(busy) if i != slot)
    quiet = whole and siblings_quiet(slot, last_busy, now, quiet_s)
    if whole and not quiet:
        cores = table.shares[slot]  # a sibling busy moments ago: its next request would meet our threads
    return Offer(cores, whole, quiet)
