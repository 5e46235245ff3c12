"""What the arbiter keeps of each connected client and of each waiting borrow, and the name a client
has as an owner of the node policy."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from ...policy.select_n import GpuDemand


@dataclass
class ClientRecord:
    """One connection: who it is (after HELLO), the chunks it holds and what it last reported."""

    cid: int
    sock: socket.socket
    peer_pid: int
    name: str | None = None
    pid: int | None = None
    held: dict[int, str] = field(default_factory=dict)  # arbiter chunk id -> owner label
    asked: int = 0  # outstanding RECLAIM chunks not yet returned
    idle: int | None = None  # last REPORT: chunks it could give back now (None: never reported)
    headroom: int = 0  # last REPORT: idle chunks its own queue wants to keep
    busy: bool = True  # last REPORT: whether it has work
    link: GpuDemand | None = None  # last active LINK demand
    link_bytes_per_s: float = 0.0  # the link bandwidth that client measured
    link_interval: int | None = None  # last interval the coordinator gave it
    adopted: int = 0  # chunks it kept from an earlier arbiter, booked here without fds (ADOPT)

    @property
    def holding(self) -> int:
        """Chunks this client holds: lent here plus adopted."""
        return len(self.held) + self.adopted

    def status_row(self) -> dict:
        """This client's entry in a STATUS reply."""
        by_owner: dict[str, int] = {}
        for o in self.held.values():
            by_owner[o] = by_owner.get(o, 0) + 1
        return {
            "client_id": self.cid,
            "name": self.name,
            "pid": self.pid,
            "peer_pid": self.peer_pid,
            "held": self.holding,
            "adopted": self.adopted,
            "by_owner": by_owner,
            "asked": self.asked,
            "idle": self.idle,
            "headroom": self.headroom,
            "busy": self.busy,
            "link_interval": self.link_interval if self.link is not None else None,
        }


@dataclass
class PendingBorrow:
    """A BORROW waiting (FIFO) for reclaimed chunks until ``deadline`` (monotonic seconds)."""

    client: ClientRecord
    req_id: int
    n: int
    owner: str
    deadline: float


def policy_owner(c: ClientRecord) -> str:
    """A client as a policy owner: its name (ties between equal donors break by name, as in the
    simulator's ledger) made unique by its id."""
    return f"{c.name}#{c.cid}"
