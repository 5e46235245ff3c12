"""When spare chunks go back to the arbiter (``memory_ext.policy.spare_hold``), table-driven."""

from __future__ import annotations

import pytest

from memory_ext.policy.spare_hold import SpareHold


@pytest.mark.parametrize(
    "hold_s,iterations,expected",
    [
        # never busy: nothing to hold for, spare chunks go at once
        (1.0, [(False, 0.0), (False, 5.0)], [True, True]),
        # busy: held; idle shorter than the hold: held; idle for the hold: given back
        (1.0, [(True, 0.0), (False, 0.5), (False, 0.99), (False, 1.0), (False, 3.0)],
         [False, False, False, True, True]),
        # back to work within the hold restarts it from the last busy iteration
        (1.0, [(True, 0.0), (False, 0.8), (True, 0.9), (False, 1.5), (False, 2.0)],
         [False, False, False, False, True]),
        # hold 0: the first idle iteration gives back, a busy one never does
        (0.0, [(True, 0.0), (True, 0.1), (False, 0.1), (True, 0.2)], [False, False, True, False]),
    ],
)  # fmt: skip
def test_gives_back_only_after_hold_s_without_work(hold_s, iterations, expected):
    rule = SpareHold(hold_s)
    assert [rule.observe(busy, now) for busy, now in iterations] == expected
    assert rule.status() == {"hold_s": hold_s, "held_iterations": expected.count(False)}


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1", None, True])
def test_bad_hold_names_the_field(bad):
    with pytest.raises(ValueError, match="hold_s"):
        SpareHold(bad)
