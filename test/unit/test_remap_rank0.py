"""Remappable weights at tensor parallel size > 1 (``weights.remap.rank0_decision``): every rank
applies rank 0's decision, read from one fixed-length row (action, slots, how many layers streamed,
which), whatever this rank decided from its own timings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memory_ext.policy.oneiros import Action
from sglang_memx.weights.remap import rank0_decision

KEYS = [f"layer{i}" for i in range(4)]


def _weights():
    return SimpleNamespace(layer_keys=KEYS, n_layers=4, last_reason="own")


@pytest.mark.parametrize(
    "own,rank0",
    [((Action.HOLD, [], 0), (Action.REMAP, ["layer1", "layer3"], 2)),
     ((Action.REMAP, ["layer0", "layer1", "layer2"], 2), (Action.RESTORE, ["layer2"], 1)),
     ((Action.RESTORE, [], 0), (Action.HOLD, [], 0))],
)  # fmt: skip
def test_every_rank_applies_rank0s_decision(own, rank0):
    rows = []

    def from_rank0(row):  # the broadcast: this rank's row goes in, rank 0's comes out
        rows.append(row)
        return _row_of(rank0)

    w = _weights()
    assert rank0_decision(w, from_rank0, *own) == rank0
    assert len(rows[0]) == 3 + len(KEYS)  # one length on every rank: the broadcast's shape
    assert w.last_reason.startswith("rank 0's decision")


def test_rank0_itself_keeps_its_own_reason():
    w = _weights()
    decision = (Action.REMAP, ["layer2"], 1)
    assert rank0_decision(w, lambda row: row, *decision) == decision
    assert w.last_reason == "own"


def _row_of(decision):
    action, streamed, slots = decision
    row = [list(Action).index(action), slots, len(streamed)] + [KEYS.index(k) for k in streamed]
    return row + [-1] * (3 + len(KEYS) - len(row))
