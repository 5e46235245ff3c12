"""``LentPool``'s warm chunks (``memory_ext.pool.warm_chunks``) and its wake pipe, against a real
in-process arbiter: a spare chunk given up warm comes back to the next borrow without a round trip,
goes to another client's reclaim at once (the engine's thread never asked), and returns to the
arbiter when its hold ends, when the pool closes or, kept, when the arbiter is lost."""

from __future__ import annotations

import os
import select
import time

import pytest

from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.warm_chunks import WarmChunks
from memory_ext.vmm import host_backend
from support.arbiter import socket_dir
from support.waiting import wait_until

G = 4 * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def sock_path():
    with socket_dir("warm-") as d:
        yield str(d / "arb.sock")


def _readable(fd: int) -> bool:
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(0))


def _held_by(arbiter_client: ArbiterClient, name: str) -> int:
    return next(c["held"] for c in arbiter_client.status()["clients"] if c["name"] == name)


def test_the_holder_takes_all_or_nothing_for_a_borrow_and_expires_after_its_hold():
    warm = WarmChunks(hold_s=1.0)
    warm.put(["a", "b", "c"], now=10.0)
    assert warm.take_exactly(4) == [] and len(warm) == 3  # a borrow is all or nothing
    assert warm.take_exactly(2) == ["b", "c"] and warm.reused_total == 2
    assert warm.take_expired(10.5) == [] and warm.take_expired(11.0) == ["a"] and len(warm) == 0
    warm.put(["d", "e"], now=20.0)
    assert warm.take_for_reclaim(5) == ["d", "e"] and warm.reclaimed_total == 2
    assert warm.take_for_reclaim(0) == [] and warm.take_expired(99.0) == []
    with pytest.raises(ValueError, match="hold_s"):
        WarmChunks(-1.0)


def test_chunks_a_reclaim_still_waits_for_are_never_kept_warm():
    warm = WarmChunks(hold_s=60.0)
    warm.put(["a", "b"], now=0.0)
    assert warm.take_for_reclaim(5) == ["a", "b"] and warm.owed == 3  # two answered at once, three owed
    assert warm.put(["c", "d"], now=1.0) == ["c", "d"] and len(warm) == 0 and warm.owed == 1
    assert warm.put(["e", "f"], now=2.0) == ["e"] and len(warm) == 1 and warm.owed == 0
    assert warm.put(["g"], now=3.0) == [] and len(warm) == 2 and warm.owed_paid_at_once == 3
    assert warm.take_for_reclaim(4) == ["f", "g"] and warm.owed == 2
    warm.paid(1)  # a give-back by another way
    assert warm.owed == 1
    warm.paid(5)
    assert warm.owed == 0  # never below zero
    assert warm.take_for_reclaim(2) == [] and warm.owed == 2
    assert warm.take_all() == [] and warm.owed == 0  # the arbiter is gone or the client leaves
    brief = WarmChunks(hold_s=60.0, owed_for_s=0.05)  # a debt lapses: the arbiter forgot the ask by then
    assert brief.take_for_reclaim(3) == [] and brief.owed == 3
    time.sleep(0.06)
    assert brief.owed == 0 and brief.put(["h"], now=0.0) == [] and len(brief) == 1
    with pytest.raises(ValueError, match="owed_for_s"):
        WarmChunks(1.0, owed_for_s=0)


def test_a_reclaim_the_engine_answered_short_is_paid_before_anything_is_kept_warm(sock_path):
    """A RECLAIM that found nothing warm and that the engine's thread could not answer in full
    (``answer_reclaim`` gives back only its spare chunks) leaves the arbiter waiting for this
    client's chunks: the next spare chunks go straight back instead of waiting out a hold, so the
    waiting borrow is granted now, not when the hold ends (2026-12-06: a busy server waited ~1.3 s)."""
    import threading

    with Arbiter(sock_path, host_backend(G), 4):
        lent = LentPool(sock_path, "engine", host_backend(G), warm_hold_s=60.0)
        asker = ArbiterClient(sock_path, "asker", host_backend(G))
        got = []
        try:
            assert lent.borrow(4) == 4  # in the engine's pool, not warm: only the engine's thread may return them
            borrower = threading.Thread(target=lambda: got.append(asker.borrow(3, timeout=10.0)))
            borrower.start()
            wait_until(lambda: lent.status()["pending_reclaim"] == 3, timeout=5.0, interval=0.01)
            assert lent.take_pending_reclaim() == 3 and lent.warm.owed == 3  # answered with nothing now
            t0 = time.monotonic()
            assert lent.give_back(4, wait=False, warm=True) == 4  # the spare chunks, later
            borrower.join(timeout=10.0)
            assert len(got[0]) == 3 and time.monotonic() - t0 < 5.0  # not after the 60 s hold
            assert len(lent.warm) == 1 and lent.warm.owed == 0 and lent.returned_total == 3
            assert _held_by(asker, "engine") == 1
            asker.give_back(got[0])
        finally:
            asker.close(force=True)
            lent.close()


def test_a_warm_chunk_serves_the_next_borrow_without_asking_the_arbiter(sock_path):
    with Arbiter(sock_path, host_backend(G), 8):
        lent = LentPool(sock_path, "engine", host_backend(G), warm_hold_s=60.0)
        watcher = ArbiterClient(sock_path, "watcher", host_backend(G))
        try:
            assert lent.borrow(3) == 3
            assert lent.give_back(3, wait=False, warm=True) == 3
            assert lent.pool.available() == 0 and len(lent.warm) == 3 and lent.returned_total == 0
            assert _held_by(watcher, "engine") == 3  # still booked as the engine's
            asked = []
            real = lent.client.borrow
            lent.client.borrow = lambda n, timeout=None: asked.append(n) or real(n, timeout=timeout)
            assert lent.borrow(2) == 2 and asked == [] and lent.pool.available() == 2
            assert lent.borrow(2) == 2 and asked == [2]  # one warm chunk left: not enough, the arbiter lends
            assert lent.status()["warm_reused_total"] == 2
            # without warm (the default), the chunks go back at once
            assert lent.give_back(2) == 2 and len(lent.warm) == 1
        finally:
            watcher.close(force=True)
            lent.close()


def test_a_reclaim_takes_warm_chunks_at_once_without_the_engines_thread(sock_path):
    with Arbiter(sock_path, host_backend(G), 4):
        lent = LentPool(sock_path, "engine", host_backend(G), warm_hold_s=60.0)
        asker = ArbiterClient(sock_path, "asker", host_backend(G))
        try:
            assert lent.borrow(4) == 4 and lent.give_back(4, warm=True) == 4
            # the engine never runs a tick here: the reclaim thread returns the warm chunks itself
            chunks = asker.borrow(3, timeout=5.0)
            assert len(chunks) == 3
            assert len(lent.warm) == 1 and lent.take_pending_reclaim() == 0 and lent.returned_total == 3
            assert lent.status()["warm_reclaimed_total"] == 3 and not _readable(lent.wake_fd)
            asker.give_back(chunks)
        finally:
            asker.close(force=True)
            lent.close()


def test_warm_chunks_go_back_when_the_hold_ends_and_when_the_pool_closes(sock_path):
    with Arbiter(sock_path, host_backend(G), 8):
        watcher = ArbiterClient(sock_path, "watcher", host_backend(G))
        lent = LentPool(sock_path, "engine", host_backend(G), warm_hold_s=0.2)
        try:
            assert lent.borrow(2) == 2 and lent.give_back(2, warm=True) == 2
            assert lent.expire_warm() == 0 and len(lent.warm) == 2  # the hold has not passed
            time.sleep(0.25)
            assert lent.expire_warm() == 2 and len(lent.warm) == 0 and lent.returned_total == 2
            wait_until(lambda: _held_by(watcher, "engine") == 0, timeout=5.0, interval=0.01)
            wait_until(lambda: lent.status()["returns_in_flight"] == 0, timeout=5.0, interval=0.01)  # ACKed
            lent.client._returning[999] = ["x", "y"]  # a RETURN whose ACK has not come: the status counts it
            assert lent.status()["returns_in_flight"] == 2
            del lent.client._returning[999]
            assert lent.borrow(3) == 3 and lent.give_back(3, warm=True) == 3
        finally:
            lent.close()
        wait_until(lambda: not any(c["name"] == "engine" for c in watcher.status()["clients"]), timeout=5.0,
                   interval=0.01)  # fmt: skip
        assert watcher.status()["free"] + watcher.status()["budget"] - watcher.status()["created"] == 8
        watcher.close(force=True)


def test_a_lost_arbiter_leaves_the_warm_chunks_kept_in_the_engines_pool(sock_path):
    arbiter = Arbiter(sock_path, host_backend(G), 4)
    arbiter.__enter__()
    lent = LentPool(sock_path, "engine", host_backend(G), warm_hold_s=60.0)
    try:
        assert lent.borrow(3) == 3 and lent.give_back(1, warm=True) == 1
        arbiter.__exit__(None, None, None)
        wait_until(lambda: lent.client.lost_reason is not None, timeout=5.0, interval=0.01)
        assert lent.borrow(1) == 0  # lost: the private budget only
        assert lent.pool.available() == 3 and len(lent.warm) == 0  # the warm one is kept, in FREE
        assert lent.give_back(1, warm=True) == 0  # nothing goes while lost
    finally:
        lent.close()


def test_draining_reads_the_wake_pipe_only_after_a_wake_up(sock_path, monkeypatch):
    """Every scheduler iteration drains; without a wake-up written since, no system call is made,
    and a wake-up written between two drains is never left in the pipe (a sleeping engine would
    otherwise find its pipe readable forever)."""
    from memory_ext.pool import lent_pool

    with Arbiter(sock_path, host_backend(G), 4):
        lent = LentPool(sock_path, "drainer", host_backend(G))
        try:
            lent.drain_wakeups()  # whatever the connection wrote
            reads = []
            real_read = lent_pool.os.read
            monkeypatch.setattr(lent_pool.os, "read", lambda fd, n: reads.append(fd) or real_read(fd, n))
            assert lent.drain_wakeups() == 0 and reads == []
            lent._wake()
            lent._wake()
            assert _readable(lent.wake_fd)
            assert lent.drain_wakeups() == 2 and not _readable(lent.wake_fd) and reads
            reads.clear()
            assert lent.drain_wakeups() == 0 and reads == []
        finally:
            lent.close()
