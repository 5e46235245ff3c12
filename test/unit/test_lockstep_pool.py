"""``LockstepLentPool`` (``memory_ext.pool.lockstep_pool``) against a real in-process arbiter: FREE
changes only in the engine's own calls. A late grant waits warm (a plain ``LentPool`` adopts it into
FREE from the client's thread); ``shed`` takes FREE chunks out at once, back to the arbiter while it
is connected and destroyed while it is lost (a plain pool's warm chunks come back to FREE on loss, a
lockstep pool's are destroyed); the pending reclaim can be read without taking it, and taken in part."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from memory_ext.vmm import host_backend
from support.arbiter import socket_dir
from support.waiting import wait_until

G = 4 * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def sock_path():
    with socket_dir("lockstep-") as d:
        yield str(d / "arb.sock")


@contextlib.contextmanager
def _engine_and_peer(sock_path: str, budget: int):
    """A lockstep pool ("engine") and another client of the same in-process arbiter of ``budget`` chunks."""
    with Arbiter(sock_path, host_backend(G), budget):
        lent = LockstepLentPool(sock_path, "engine", host_backend(G), warm_hold_s=60.0, ranks=2)
        peer = ArbiterClient(sock_path, "peer", host_backend(G))
        try:
            yield lent, peer
        finally:
            peer.close(force=True)
            lent.close()


def _late_grant(lent: LentPool, n: int) -> None:
    """A grant of ``n`` booked chunks that lands after its borrower stopped waiting."""
    assert lent.borrow(n) == n
    chunks = lent.pool.disown(n)
    lent._outstanding += 1  # the borrower timed out and counted it
    assert lent._on_late_reply({"type": "GRANT", "req_id": 1}, chunks) is True


@pytest.mark.parametrize("kind,free_after,warm_after", [(LentPool, 2, 0), (LockstepLentPool, 0, 2)])
def test_a_late_grant_waits_warm_in_a_lockstep_pool(sock_path, kind, free_after, warm_after):
    with Arbiter(sock_path, host_backend(G), 8):
        extra = {"ranks": 2} if kind is LockstepLentPool else {}
        lent = kind(sock_path, "engine", host_backend(G), warm_hold_s=60.0, **extra)
        try:
            _late_grant(lent, 2)
            assert lent.pool.available() == free_after and len(lent.warm) == warm_after
            assert lent.late_grants == 1 and lent.borrowed_total == 4
            if kind is LockstepLentPool:  # the next borrow takes it without a round trip
                asked = []
                real = lent.client.borrow
                lent.client.borrow = lambda n, timeout=None: asked.append(n) or real(n, timeout=timeout)
                assert lent.borrow(2) == 2 and asked == [] and lent.pool.available() == 2
        finally:
            lent.close()


def test_shed_returns_the_chunks_to_the_arbiter_at_once_while_it_is_connected(sock_path):
    """Not warm: warm chunks stay booked to this rank, and the rank that is short must be able to
    borrow them at the next tick."""
    with _engine_and_peer(sock_path, 8) as (lent, watcher):
        assert lent.shed(0) == 0 and lent.borrow(3) == 3
        assert lent.shed(2) == 2
        assert lent.pool.available() == 1 and len(lent.warm) == 0

        def engine_holds() -> int:
            return next(c["held"] for c in watcher.status()["clients"] if c["name"] == "engine")

        wait_until(lambda: engine_holds() == 1, timeout=5.0, what="the shed chunks back at the arbiter", interval=0.01)
        assert len(watcher.borrow(7, timeout=5.0)) == 7  # another client gets them
        assert lent.shed(5) == 1 and lent.pool.available() == 0  # at most what FREE has


def test_a_lost_arbiter_destroys_the_warm_chunks_and_shed_destroys_kept_ones(sock_path):
    arbiter = Arbiter(sock_path, host_backend(G), 8)
    arbiter.__enter__()
    lent = LockstepLentPool(sock_path, "engine", host_backend(G), warm_hold_s=60.0, ranks=2)
    try:
        assert lent.borrow(4) == 4 and lent.shed(1) == 1
        arbiter.__exit__(None, None, None)
        wait_until(lambda: lent.client.lost_reason is not None, timeout=5.0, interval=0.01)
        assert lent.pending_reclaim == 0  # sees the loss: the warm chunk is destroyed, not adopted
        assert lent.pool.available() == 3 and len(lent.warm) == 0 and len(lent._private) == 3
        assert lent.shed(2) == 2 and lent.pool.available() == 1 and len(lent._private) == 1
        assert lent.give_back(1) == 0  # a plain give-back keeps them while lost
    finally:
        lent.close()


def test_the_pending_reclaim_is_read_without_taking_it_and_taken_in_part(sock_path):
    with _engine_and_peer(sock_path, 4) as (lent, asker):
        assert lent.borrow(4) == 4  # FREE: only the engine's thread may answer
        got: list = []
        t = threading.Thread(target=lambda: got.extend(asker.borrow(3, timeout=10.0)))
        t.start()
        wait_until(lambda: lent.pending_reclaim == 3, timeout=5.0, interval=0.01)
        assert lent.pending_reclaim == 3  # reading it takes nothing
        assert lent.take_pending_reclaim(at_most=2) == 2 and lent.pending_reclaim == 1
        assert lent.give_back(2) == 2
        assert lent.take_pending_reclaim(at_most=5) == 1 and lent.give_back(1) == 1
        t.join(10.0)
        assert len(got) == 3
        asker.give_back(got)


def test_a_late_grant_owed_to_a_reclaim_goes_straight_back_and_free_is_untouched(sock_path):
    """A late grant that lands while a RECLAIM is owed (``warm.owed``) is given back from the client's
    thread at once, neither kept warm nor adopted into FREE."""
    with _engine_and_peer(sock_path, 8) as (lent, watcher):
        assert lent.borrow(4) == 4
        assert lent.warm.take_for_reclaim(2) == [] and lent.warm.owed == 2  # asked for 2, nothing warm to pay
        returned = lent.returned_total
        _late_grant(lent, 2)
        assert lent.pool.available() == 4 and len(lent.warm) == 0 and lent.warm.owed == 0
        assert lent.returned_total == returned + 2 and lent.warm.owed_paid_at_once == 2

        def engine_holds() -> int:
            return next(c["held"] for c in watcher.status()["clients"] if c["name"] == "engine")

        wait_until(lambda: engine_holds() == 4, timeout=5.0, what="the owed chunks back at the arbiter", interval=0.01)
