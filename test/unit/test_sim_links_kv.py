"""Simulator: fair-share links and the paged KV pool with prefix cache."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.sim.core.events import EventLoop  # noqa: E402
from benchmark.sim.core.kvcache import KVCache  # noqa: E402
from benchmark.sim.core.links import Link  # noqa: E402


def _run(loop):
    while loop.step():
        pass


def test_two_transfers_started_together_share_bandwidth():
    loop = EventLoop()
    link = Link("l", 1e9, loop)
    done = {}
    link.start(1e9, lambda t: done.__setitem__("a", t))
    link.start(2e9, lambda t: done.__setitem__("b", t))
    _run(loop)
    assert done["a"] == pytest.approx(2.0)  # 0.5 GB/s each until a is done
    assert done["b"] == pytest.approx(3.0)  # then b alone at 1 GB/s
    assert link.bytes_done == pytest.approx(3e9)


def test_late_transfer_slows_the_running_one():
    loop = EventLoop()
    link = Link("l", 1e9, loop)
    done = {}
    link.start(1e9, lambda t: done.__setitem__("a", t))
    loop.at(0.5, lambda: link.start(1e9, lambda t: done.__setitem__("b", t)))
    _run(loop)
    assert done["a"] == pytest.approx(1.5)
    assert done["b"] == pytest.approx(2.0)


def test_n_equal_transfers_finish_together_at_n_times_alone():
    loop = EventLoop()
    link = Link("l", 2e9, loop)
    ends = []
    for _ in range(5):
        link.start(1e9, ends.append)
    _run(loop)
    assert ends == pytest.approx([2.5] * 5)
    assert link.busy_s == pytest.approx(2.5)


def test_kv_allocate_is_all_or_nothing_and_bounded():
    kv = KVCache(10, 16)
    assert kv.allocate(7) and kv.free == 3
    assert not kv.allocate(4) and kv.private == 7
    kv.free_private(7)
    assert kv.free == 10
    kv.check()


def test_prefix_publish_match_and_lru_eviction_leaf_first():
    kv = KVCache(6, 4)
    assert kv.allocate(3)
    keys = [("s", 0), ("s", 1), ("s", 2)]
    kv.publish(keys)  # private -> cached, one ref each
    assert kv.private == 0 and kv.cached == 3 and kv.used == 3
    kv.release_cached(keys)
    assert kv.used == 0 and kv.available == 6
    assert kv.match(iter(keys)) == 3  # a later request hits all three
    kv.release_cached(keys)
    # need 5 blocks: 3 free + evict 2, deepest first -> ("s", 0) survives
    assert kv.allocate(5)
    assert list(kv.refs) == [("s", 0)] and kv.evicted == 2
    assert kv.match(iter(keys)) == 1
    kv.check()


def test_referenced_blocks_are_never_evicted_and_resize_respects_use():
    kv = KVCache(4, 4)
    kv.allocate(2)
    kv.publish([("a", 0), ("a", 1)])
    assert not kv.allocate(3)  # both cached blocks are referenced
    assert kv.resize(1) == 2  # cannot shrink below blocks in use
    assert kv.resize(8) == 8 and kv.allocate(6)
    kv.check()
    with pytest.raises(AssertionError):
        kv.free_private(7)
