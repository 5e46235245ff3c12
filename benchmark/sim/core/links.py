"""Interconnect links with fair-share (processor-sharing) bandwidth.

A ``Link`` is one direction of one physical link (host->GPU PCIe or C2C,
GPU->host, a GPU's NVLink egress). All transfers active on a link at the
same time progress at ``bandwidth / n_active`` each; when one starts or ends
the others speed up or slow down at once. This is the max-min fair share of
a single bottleneck; it ignores per-transfer latency, protocol overhead and
cross-link interaction (a transfer occupies exactly one link).

Invariants: bytes are conserved (a transfer completes exactly when its bytes
have been served); at every instant the summed rate of active transfers
equals the link bandwidth (or 0 when idle).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .events import EventLoop

__all__ = ["Link", "Transfer", "LinkSet"]

_EPS_BYTES = 1e-6


@dataclass
class Transfer:
    nbytes: float
    on_done: Callable[[float], None] | None
    started: float
    remaining: float = field(init=False)
    finished: float | None = None

    def __post_init__(self) -> None:
        self.remaining = float(self.nbytes)


class Link:
    """One direction of a link; ``bandwidth`` in bytes/s."""

    def __init__(self, name: str, bandwidth: float, loop: EventLoop) -> None:
        if bandwidth <= 0:
            raise ValueError(f"link {name}: bandwidth must be > 0, got {bandwidth}")
        self.name, self.bandwidth, self.loop = name, float(bandwidth), loop
        self.active: list[Transfer] = []
        self._last = 0.0
        self._version = 0
        self.bytes_done = 0.0
        self.busy_s = 0.0

    def start(self, nbytes: float, on_done: Callable[[float], None] | None = None) -> Transfer:
        """Begin moving ``nbytes``; ``on_done(t)`` fires when it completes."""
        now = self.loop.now
        self._advance(now)
        tr = Transfer(nbytes, on_done, now)
        if nbytes <= 0:
            tr.finished = now
            if on_done:
                self.loop.at(now, on_done, now)
            return tr
        self.active.append(tr)
        self._reschedule(now)
        return tr

    def rate(self) -> float:
        """Current per-transfer rate in bytes/s (bandwidth if idle)."""
        return self.bandwidth / max(len(self.active), 1)

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0 and self.active:
            served = dt * self.bandwidth / len(self.active)
            for tr in self.active:
                tr.remaining -= served
            self.busy_s += dt
            self.bytes_done += dt * self.bandwidth
        self._last = now

    def _reschedule(self, now: float) -> None:
        self._version += 1
        if not self.active:
            return
        first = min(tr.remaining for tr in self.active)
        self.loop.at(now + max(first, 0.0) * len(self.active) / self.bandwidth, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later start/finish
        now = self.loop.now
        self._advance(now)
        done = [tr for tr in self.active if tr.remaining <= _EPS_BYTES * max(tr.nbytes, 1.0)]
        if not done:  # float drift: finish the closest one
            done = [min(self.active, key=lambda tr: tr.remaining)]
        for tr in done:
            self.active.remove(tr)
            self.bytes_done += tr.remaining  # drift correction keeps bytes exact
            tr.remaining = 0.0
            tr.finished = now
        self._reschedule(now)
        for tr in done:
            if tr.on_done:
                tr.on_done(now)


class LinkSet:
    """Named links of one node. Default names (per GPU ``g``):
    ``h2d:g`` and ``d2h:g`` (host link, PCIe or C2C), ``nvlink:g`` (egress)."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.links: dict[str, Link] = {}

    def add(self, name: str, bandwidth: float) -> Link:
        if name in self.links:
            raise ValueError(f"link {name!r} already exists")
        self.links[name] = link = Link(name, bandwidth, self.loop)
        return link

    def __getitem__(self, name: str) -> Link:
        return self.links[name]

    def __contains__(self, name: str) -> bool:
        return name in self.links

    def summary(self) -> dict[str, dict]:
        return {
            n: {"bandwidth_gbps": l.bandwidth / 1e9, "bytes": l.bytes_done, "busy_s": l.busy_s}
            for n, l in self.links.items()
        }
