"""``memory_ext.policy.keep_warm``: what a server keeps from the shared pool, by its recent peak."""

import math

import pytest

from memory_ext.policy.keep_warm import KeepWarm, WarmSpares


@pytest.mark.parametrize(
    "window, seen, now, in_use, keep",
    [
        # case: (window_s, [(time, chunks in use)], now, in use now, chunks kept)
        (2.0, [], 0.0, 0, 0),  # nothing seen: nothing kept
        (2.0, [(0.0, 8)], 0.5, 2, 6),  # a peak 0.5 s ago: its chunks beyond what is used now stay
        (2.0, [(0.0, 8)], 2.0, 2, 6),  # the window's edge still counts
        (2.0, [(0.0, 8)], 2.01, 2, 0),  # past the window: everything spare goes back
        (2.0, [(0.0, 8), (1.5, 5)], 3.0, 1, 4),  # the older, higher peak expired; the newer one holds
        (2.0, [(0.0, 3), (1.0, 9), (1.2, 4)], 2.5, 4, 5),  # the highest within the window
        (2.0, [(0.0, 8)], 1.0, 10, 0),  # using more than the peak now: nothing extra kept
        (0.0, [(0.0, 8)], 0.0, 2, 6),  # window 0: only this instant's peak ...
        (0.0, [(0.0, 8)], 0.001, 2, 0),  # ... gone a moment later (the rule before keep-warm)
    ],
)
def test_keep_is_the_recent_peak_beyond_what_is_in_use(window, seen, now, in_use, keep):
    warm = KeepWarm(window)
    for t, chunks in seen:
        warm.observe(t, chunks)
    assert warm.keep(now, in_use) == keep


def test_observing_now_then_asking_keeps_nothing_beyond_a_steady_use():
    """Steady use at one level keeps nothing extra; a dip keeps the level for the window."""
    warm = KeepWarm(1.0)
    for i in range(10):
        warm.observe(i * 0.1, 4)
        assert warm.keep(i * 0.1, 4) == 0
    warm.observe(1.0, 1)
    assert warm.keep(1.0, 1) == 3
    warm.observe(2.5, 1)
    assert warm.keep(2.5, 1) == 0


def test_memory_stays_bounded_over_many_observations():
    warm = KeepWarm(0.5)
    for i in range(10_000):
        warm.observe(i * 0.01, (i * 7919) % 13)
    assert len(warm._peaks) <= 51  # one entry per observation inside the window at most
    assert warm.peak(100.0) == max((i * 7919) % 13 for i in range(9950, 10_000))


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: KeepWarm(-1.0), "window_s"),
        (lambda: KeepWarm(math.inf), "window_s"),
        (lambda: KeepWarm(True), "window_s"),
        (lambda: KeepWarm(1.0).observe(0.0, -1), "in_use"),
        (lambda: KeepWarm(1.0).observe(math.nan, 1), "now"),
        (lambda: KeepWarm(1.0).keep(0.0, 1.5), "in_use"),
    ],
)
def test_bad_numbers_are_refused_naming_the_field(build, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        build()


def test_time_going_backwards_is_refused():
    warm = KeepWarm(1.0)
    warm.observe(5.0, 1)
    with pytest.raises(ValueError, match="^now"):
        warm.observe(4.0, 1)


def test_warm_spares_keeps_kv_and_activation_apart():
    spares = WarmSpares(2.0)
    spares.observe(0.0, 8, 3)
    assert spares.status(1.0) == {"window_s": 2.0, "recent_peak_kv_chunks": 8, "recent_peak_activation_chunks": 3}
    assert (spares.kv_keep(1.0, 5), spares.activation_keep(1.0)) == (3, 3)
    assert (spares.kv_keep(2.5, 5), spares.activation_keep(2.5)) == (0, 0)


def test_a_window_of_zero_keeps_nothing():
    """0 is the rule before keep-warm: spare KV and the finished forward's activation go back at once."""
    spares = WarmSpares(0.0)
    spares.observe(0.0, 8, 3)
    assert (spares.kv_keep(0.0, 8), spares.activation_keep(0.0)) == (0, 0)
