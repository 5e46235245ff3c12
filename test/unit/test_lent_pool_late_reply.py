"""A late arbiter reply that arrives before its borrower has counted the timeout must not
leave the borrow 'outstanding' forever (the server would never borrow again; found by the
co-located weights test)."""

from __future__ import annotations

import os
import threading

from memory_ext.pool.arbiter_client import ArbiterError
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.warm_chunks import WarmChunks


class _RacingClient:
    """``borrow`` times out, and the late GRANT reaches the pool before ``borrow`` returns."""

    connected = True
    lost_reason = None

    def __init__(self, pool: LentPool, late: bool):
        self.pool, self.late = pool, late

    def borrow(self, n, timeout=None):
        if self.late:
            kept = self.pool._on_late_reply({"type": "GRANT", "req_id": 7}, [])
            assert kept is False  # nobody waits for it yet: the client hands it back
        raise ArbiterError("no reply within the timeout")


def _pool(late: bool) -> LentPool:
    pool = LentPool.__new__(LentPool)  # the bookkeeping only: no arbiter, no backend
    pool._lock = threading.Lock()
    pool._outstanding = pool._early_late_replies = 0
    pool._lost = pool._closed = False
    pool._private, pool._adopted = {}, 0
    pool.denied_total = pool.borrowed_total = pool.late_grants = 0
    pool.last_denied_available = 0
    pool.warm = WarmChunks()  # none warm: every borrow asks the arbiter
    pool.client = _RacingClient(pool, late)
    return pool


def test_a_reply_that_beats_the_timeout_bookkeeping_leaves_nothing_outstanding():
    pool = _pool(late=True)
    assert pool.borrow(4, wait=0.01) == 0
    assert not pool.outstanding  # before the fix: outstanding forever, every later borrow returned 0


def test_a_reply_still_on_its_way_is_outstanding():
    pool = _pool(late=False)
    assert pool.borrow(4, wait=0.01) == 0
    assert pool.outstanding
    pool._wake = lambda: None
    assert pool._on_late_reply({"type": "DENY", "req_id": 8, "available": 0}, []) is False
    assert not pool.outstanding


class _ReplyAtTheDeadline(threading.Event):
    """``wait`` times out just as the reply lands: the reader has already taken the waiter
    from the table when the requester looks (the window a loaded machine hits)."""

    def wait(self, timeout=None):
        super().wait(10.0)  # the reply is delivered ...
        return False  # ... but the requester's wait had already expired


def test_a_reply_landing_at_the_deadline_is_the_requesters_not_a_lost_late_reply(monkeypatch, tmp_path):
    """Before the fix the client raised 'no reply', the GRANT's chunks stayed held by nobody
    and the pool counted the borrow outstanding forever: that server never borrowed again
    (test_weights_colocated: the borrower's queue hung, the lender was never asked)."""
    from memory_ext.pool import arbiter_client
    from memory_ext.pool.arbiter import Arbiter
    from memory_ext.pool.arbiter_client import query_arbiter_status
    from memory_ext.vmm import host_backend

    g = 4 * os.sysconf("SC_PAGE_SIZE")
    sock = str(tmp_path / "a.sock")
    with Arbiter(sock, host_backend(g), 8):
        pool = LentPool(sock, "racer", host_backend(g))
        try:
            waiter = arbiter_client._Waiter
            monkeypatch.setattr(arbiter_client, "_Waiter", lambda: _late_waiter(waiter))
            assert pool.borrow(3, wait=0.05) == 3  # the reply is the requester's
            monkeypatch.setattr(arbiter_client, "_Waiter", waiter)
            assert not pool.outstanding and pool.pool.available() == 3
            assert pool.borrow(2, wait=5.0) == 2  # and it borrows again
            held = {c["name"]: c["held"] for c in query_arbiter_status(sock)["clients"]}
            assert held["racer"] == 5 == pool.pool.available()  # every granted chunk is in the pool
        finally:
            pool.close()


def _late_waiter(cls):
    w = cls()
    w.event = _ReplyAtTheDeadline()
    return w
