"""The shared host link (Select-N §4.5): one interval per client streaming weights over it.

The pool's processes stream weights over one host link. ``LINK`` carries a client's
demand (``policy.select_n.GpuDemand``); the arbiter keeps the last active one per
client and answers with the interval ``policy.select_n.LinkCoordinator`` picks jointly
for every active demand, at the slowest link bandwidth any of them measured (the
simulator's coordinator is the same object). A client's demand goes with it when it
withdraws (``active`` false) or disconnects.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...policy.select_n import GpuDemand, LinkCoordinator
from .records import ClientRecord, policy_owner


def join_link(client: ClientRecord, msg: dict, clients: Iterable[ClientRecord]) -> tuple[str, int]:
    """Record ``client``'s active LINK demand ``msg`` (already checked) and let the coordinator pick
    the interval of every client on the link; returns the reason of the answer and how many share it.
    When nothing fits with ``client`` in, it streams nothing more and the others keep theirs."""
    n, times = msg["num_layers"], msg["iter_times"]
    own_interval = msg["min_interval"] or n + 1
    client.link = GpuDemand(policy_owner(client), n, msg["layer_bytes"], times[own_interval - 1], msg["min_interval"],
                            None, iter_times={i + 1: t for i, t in enumerate(times)})  # fmt: skip
    client.link_bytes_per_s = float(msg["link_bytes_per_s"])
    others = [c for c in clients if c is not client and c.link is not None]
    bandwidth = min([client.link_bytes_per_s] + [c.link_bytes_per_s for c in others])
    decision = LinkCoordinator(bandwidth).decide(client.link, [c.link for c in others])
    if decision.accepted:
        for c in [client] + others:
            c.link_interval = decision.intervals[c.link.name]
        reason = f"{len(others) + 1} on the link, {decision.total_rate / bandwidth:.0%} of it"
    else:
        client.link_interval = None
        reason = decision.reason
    return reason, len(others) + 1
