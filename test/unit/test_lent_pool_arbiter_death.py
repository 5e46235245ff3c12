"""A pool's arbiter dies under its clients (issue 18, faults): the survivors fall back to a
private budget of the chunks they hold, and rejoin a new arbiter by adopting them.

The first test SIGKILLs a real arbiter process; the others stop an in-process one (its
sockets close under the clients just the same) and start a new one on the same path.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import partial

import pytest

from memory_ext.pool import Owner
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient
from memory_ext.pool.lent_pool import LentPool
from memory_ext.vmm import host_backend
from support.arbiter import arbiter_process, socket_dir
from support.waiting import wait_until

PAGE = os.sysconf("SC_PAGE_SIZE")
G = 4 * PAGE
_wait = partial(wait_until, timeout=10.0, interval=0.01)


@pytest.fixture
def sock_path():
    with socket_dir("arbd-") as d:
        yield str(d / "arb.sock")


def _fill(vmm, chunk, value: int):
    """Map ``chunk``, write ``value`` over it, read it back, unmap (the memory is usable)."""
    vr = vmm.reserve(G)
    try:
        vmm.map(vr, 0, chunk)
        view = vmm.tensor_view(vr, 0, G)
        view.fill_(value)
        assert int(view.sum()) == value * G
        del view
        vmm.unmap(vr, 0)
    finally:
        vmm.release(vr)


def _lost_pool(sock_path, *, budget=8, borrow=4):
    """A LentPool that borrowed ``borrow`` chunks, one of them in use (KV), whose in-process
    arbiter was then stopped; returns (pool, backend, [chunk in use])."""
    arb = Arbiter(sock_path, host_backend(G), budget).start()
    vmm = host_backend(G)
    lent = LentPool(sock_path, "survivor", vmm, timeout=5.0)
    assert lent.borrow(borrow) == borrow
    used = lent.pool.acquire(Owner.KV, 1)
    arb.stop()  # closes every client's socket, as the kernel does when the process dies
    _wait(lambda: not lent.client.connected, what="the client to see the arbiter gone")
    return lent, vmm, used


def test_sigkilled_arbiter_process_leaves_a_private_budget_and_one_warning(sock_path, caplog):
    vmm = host_backend(G)
    flags = ("--budget-chunks", "8", "--granularity-kib", str(G >> 10))
    try:
        with arbiter_process(sock_path, *flags) as proc:
            lent = LentPool(sock_path, "survivor", vmm, timeout=5.0)
            assert lent.borrow(5) == 5
            assert lent.status()["arbiter"]["connected"] is True
            used = lent.pool.acquire(Owner.KV, 2)
            _fill(vmm, used[0], 7)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            _wait(lambda: not lent.client.connected, what="the client to see the arbiter gone")
            denied = lent.denied_total
            with caplog.at_level(logging.WARNING, logger="memory_ext.pool.lent_pool"):
                assert lent.borrow(2, wait=0.1) == 0  # no raise, no hang
                assert lent.borrow(1) == 0
                assert lent.available_now() == 0
                assert lent.give_back() == 0  # the 3 FREE chunks stay
                assert lent.report(3, 0, False) is False
                st = lent.status()
            warnings = [r for r in caplog.records if "lost the arbiter" in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
            assert "survivor" in warnings[0].getMessage() and "5 chunk(s)" in warnings[0].getMessage()
            assert lent.denied_total == denied + 2
            arb = st["arbiter"]
            assert arb["connected"] is False and arb["private_budget_chunks"] == 5
            assert arb["lost_reason"] and arb["lost_at"] <= time.time()
            assert st["held_chunks"] == 5
            assert lent.pool.usage()[Owner.FREE] == 3
            more = lent.pool.acquire(Owner.KV, 3)  # the engine still allocates from what it kept
            for c in used + more:
                _fill(vmm, c, 3)
            lent.pool.release(Owner.KV, used + more)
            assert lent.maybe_rejoin() is False  # nothing answers on the socket
            lent.close()
            assert vmm.live_chunks() == []  # nothing leaked
    finally:
        vmm.close()


def test_a_pending_reclaim_and_an_outstanding_borrow_are_dropped_on_loss(sock_path):
    arb = Arbiter(sock_path, host_backend(G), 4).start()
    vmm = host_backend(G)
    lent = LentPool(sock_path, "survivor", vmm, timeout=5.0)
    lent._on_reclaim(2)  # as if the arbiter had asked
    with lent._lock:
        lent._outstanding = 1  # as if a borrow had timed out waiting for its reply
    arb.stop()
    _wait(lambda: not lent.client.connected)
    assert lent.take_pending_reclaim() == 0
    assert not lent.outstanding
    assert lent.status()["pending_reclaim"] == 0
    lent.close()
    vmm.close()


def test_a_survivor_rejoins_a_new_arbiter_and_adopts_what_it_kept(sock_path):
    lent, vmm, used = _lost_pool(sock_path, budget=8, borrow=4)
    assert lent.status()["arbiter"]["private_budget_chunks"] == 4
    lent._next_rejoin = 0.0
    assert lent.maybe_rejoin() is False  # no arbiter yet (the socket file is gone)
    arb = Arbiter(sock_path, host_backend(G), 8).start()
    try:
        lent._next_rejoin = 0.0
        assert lent.maybe_rejoin() is True
        st = lent.status()["arbiter"]
        assert st["connected"] is True and st["adopted_chunks"] == 4 and st["private_budget_chunks"] == 0
        assert st["rejoins"] == 1
        books = arb.status()
        [me] = books["clients"]
        assert (me["held"], me["adopted"]) == (4, 4)
        assert books["created"] == 4 and books["free"] == 0  # held 4 + free 0 + uncreated 4 == budget 8
        arb.check_invariants()
        # a newcomer can have only the rest of the budget
        other_vmm = host_backend(G)
        other = ArbiterClient(sock_path, "restarted", other_vmm, timeout=5.0)
        assert len(other.borrow(4)) == 4
        assert lent.available_now() == 0  # the budget is fully held
        other.close()
        other_vmm.close()
        assert lent.borrow(2) == 2  # a later borrow works
        _fill(vmm, used[0], 9)  # the kept chunk in use is still good
        st = arb.status()
        assert (st["clients"][0]["held"], st["created"], st["free"]) == (6, 8, 2)  # the newcomer's 4 went back
        # giving back: kept chunks are destroyed locally and RELEASEd, lent ones RETURNed
        n = lent.give_back()
        assert n == 5  # 3 kept FREE + 2 lent
        arb.check_invariants()
        st = arb.status()
        assert st["clients"][0]["held"] == 1 and st["clients"][0]["adopted"] == 1
        assert st["created"] == st["free"] + 1  # the FREE ones plus the adopted chunk in use
        lent.pool.release(Owner.KV, used)
        lent.close()  # the last adopted chunk leaves the books with the connection
        _wait(lambda: not arb.status()["clients"], what="the arbiter to drop the survivor")
        st = arb.status()
        assert st["adopted"] == 0 and st["created"] == st["free"]
        arb.check_invariants()
        assert vmm.live_chunks() == []
    finally:
        arb.stop()
        vmm.close()


def test_adoption_is_partial_when_a_restarted_server_took_the_budget_first(sock_path):
    lent, vmm, used = _lost_pool(sock_path, budget=6, borrow=4)
    arb = Arbiter(sock_path, host_backend(G), 6).start()
    other_vmm = host_backend(G)
    try:
        other = ArbiterClient(sock_path, "restarted", other_vmm, timeout=5.0)
        taken = other.borrow(5)  # the restarted server was faster: 1 chunk of the budget is left
        lent._next_rejoin = 0.0
        assert lent.maybe_rejoin() is True
        st = lent.status()["arbiter"]
        assert (st["adopted_chunks"], st["private_budget_chunks"]) == (1, 3)
        arb.check_invariants()
        assert arb.status()["created"] == 6  # never above the budget in the books
        assert lent.borrow(1, wait=0.5) == 0  # unbooked kept chunks: no more memory
        # giving back destroys unbooked kept chunks first (no RELEASE): the over-commit shrinks
        assert lent.give_back(2) == 2
        assert lent.status()["arbiter"]["private_budget_chunks"] == 1
        [me] = [c for c in arb.status()["clients"] if c["name"] == "survivor"]
        assert (me["adopted"], me["held"]) == (1, 1)
        other.give_back(taken[:3])  # room again: the next tick adopts the rest
        lent._next_rejoin = 0.0
        assert lent.maybe_rejoin() is False  # already connected; adoption retried
        st = lent.status()["arbiter"]
        assert (st["adopted_chunks"], st["private_budget_chunks"]) == (2, 0)
        books = arb.status()
        assert sum(c["held"] for c in books["clients"]) + books["free"] + (6 - books["created"]) == 6
        arb.check_invariants()
        assert lent.borrow(1) == 1
        other.close()
        lent.pool.release(Owner.KV, used)
        lent.close()
        _wait(lambda: not arb.status()["clients"], what="the arbiter to drop both")
        assert arb.status()["adopted"] == 0
        assert vmm.live_chunks() == []
    finally:
        arb.stop()
        other_vmm.close()
        vmm.close()
