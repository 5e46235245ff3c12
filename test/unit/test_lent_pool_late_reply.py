"""A late arbiter reply that arrives before its borrower has counted the timeout must not
leave the borrow 'outstanding' forever (the server would never borrow again; found by the
co-located weights test)."""

from __future__ import annotations

import threading

from memory_ext.pool.arbiter_client import ArbiterError
from memory_ext.pool.lent_pool import LentPool


class _RacingClient:
    """``borrow`` times out, and the late GRANT reaches the pool before ``borrow`` returns."""

    connected = True

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
    pool.denied_total = pool.borrowed_total = pool.late_grants = 0
    pool.last_denied_available = 0
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
