"""The remap controller's KV signal (``memory_ext.policy.remap_signal``): a table of cases, bad input."""

from __future__ import annotations

import pytest

from memory_ext.policy.remap_signal import ArbiterSupply, KvSignal, free_kv_groups

G = 64  # token rows per KV group


def _signal(**kw) -> KvSignal:
    base = dict(available_tokens=5 * G, evictable_tokens=2 * G, demand_tokens=3 * G, group_tokens=G)
    base.update(kw)
    return KvSignal(**base)


ARBITER = ArbiterSupply(free_chunks=40, ranks=1, chunks_per_group=4)  # 10 groups free at the arbiter
TWO_RANKS = ArbiterSupply(free_chunks=40, ranks=2, chunks_per_group=4)  # 5 groups each


@pytest.mark.parametrize(
    "signal, arbiter, groups",
    [
        (_signal(), None, 4),  # 5 free + 2 evictable - 3 needed
        (_signal(demand_tokens=3 * G + 1), None, 3),  # a part-group need takes the group
        (_signal(demand_tokens=10 * G), None, 0),  # more needed than held: no negative count
        (_signal(parked_on_host=True), None, 0),  # KV waits on the host: pressure
        (_signal(admission_refused=True, waiting=True), ARBITER, 0),  # the head was refused: pressure
        (_signal(), ARBITER, 4),  # no layer lent: the arbiter's memory is not this pool's to restore into
        (_signal(layers_lent=True), ARBITER, 14),  # one rank, layers lent: all of it counts
        (_signal(layers_lent=True, running=True), ARBITER, 14),  # one rank borrows urgently when short
        (_signal(layers_lent=True, waiting=True), ARBITER, 4),  # a restore never competes with admission
        (_signal(layers_lent=True), TWO_RANKS, 9),  # ranks: each its share, nothing running
        (_signal(layers_lent=True, running=True), TWO_RANKS, 4),  # ranks with a request running: none
        (_signal(layers_lent=True), ArbiterSupply(41, 2, 4), 9),  # a share of whole groups only
    ],
)  # fmt: skip
def test_free_groups_after_the_demand(signal, arbiter, groups):
    assert free_kv_groups(signal, arbiter) == groups


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: _signal(available_tokens=-1), "available_tokens"),
        (lambda: _signal(evictable_tokens=1.5), "evictable_tokens"),
        (lambda: _signal(demand_tokens=-3), "demand_tokens"),
        (lambda: _signal(group_tokens=0), "group_tokens"),
        (lambda: ArbiterSupply(-1, 1, 4), "free_chunks"),
        (lambda: ArbiterSupply(4, 0, 4), "ranks"),
        (lambda: ArbiterSupply(4, 1, 0), "chunks_per_group"),
    ],
)  # fmt: skip
def test_bad_input_names_the_field(build, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        build()
