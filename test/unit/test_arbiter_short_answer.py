"""The arbiter replans a borrow when a donor answers its RECLAIM short
(``memory_ext.pool.arbiter.reclaim.replan_short_answer``): the donor's next REPORT says it has less
idle than it was asked for, so the rest is asked of the others at once instead of the borrow
waiting for chunks that will not come until the timeout."""

from __future__ import annotations

import os
import threading
import time
from functools import partial

import pytest

from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient, ArbiterError
from memory_ext.vmm import host_backend
from support.arbiter import socket_dir
from support.waiting import wait_until

G = 4 * os.sysconf("SC_PAGE_SIZE")
_wait = partial(wait_until, timeout=10.0, interval=0.01)


@pytest.fixture
def sock_path():
    with socket_dir("short-") as d:
        yield str(d / "arb.sock")


def _reported(arb: Arbiter, name: str, idle: int) -> bool:
    return any(c["name"] == name and c["idle"] == idle for c in arb.status()["clients"])


def test_a_short_answer_is_asked_of_the_others_at_once(sock_path):
    with Arbiter(sock_path, host_backend(G), 4, reclaim_timeout=5.0) as arb:
        stuck = ArbiterClient(sock_path, "stuck", host_backend(G), on_reclaim=lambda n: [])  # gives nothing now
        spare: list = []

        def give_spare(n: int) -> list:
            return [spare.pop() for _ in range(min(n, len(spare)))]

        holder = ArbiterClient(sock_path, "holder", host_backend(G), on_reclaim=give_spare)
        asker = ArbiterClient(sock_path, "asker", host_backend(G))
        got: list = []
        try:
            stuck.borrow(2)
            spare.extend(holder.borrow(2))
            stuck.report(2, 0, False)  # it believes it could give 2 (cache it will find in use)
            holder.report(0, 0, True)
            _wait(lambda: _reported(arb, "stuck", 2) and _reported(arb, "holder", 0), what="reports")
            t0 = time.monotonic()
            borrower = threading.Thread(target=lambda: got.append(asker.borrow(2, timeout=10.0)))
            borrower.start()
            _wait(lambda: stuck.reclaim_requests == [2], what="the reclaim of stuck")
            holder.report(2, 0, False)  # its work ended: 2 idle
            _wait(lambda: _reported(arb, "holder", 2), what="holder's report")
            assert not got and holder.reclaim_requests == []  # still counted on stuck
            stuck.report(0, 0, False)  # answered short: nothing it can give
            borrower.join(timeout=10.0)
            assert len(got[0]) == 2 and time.monotonic() - t0 < 4.0  # granted before the 5 s timeout
            assert holder.reclaim_requests == [2] and arb.stats["asks_withdrawn"] == 1
        finally:
            for c in (stuck, holder, asker):
                c.close(force=True)


def test_a_report_that_still_covers_the_ask_changes_nothing(sock_path):
    with Arbiter(sock_path, host_backend(G), 4, reclaim_timeout=0.5) as arb:
        slow = ArbiterClient(sock_path, "slow", host_backend(G), on_reclaim=lambda n: [])
        other = ArbiterClient(sock_path, "other", host_backend(G), on_reclaim=lambda n: [])
        asker = ArbiterClient(sock_path, "asker", host_backend(G))
        try:
            slow.borrow(2)
            other.borrow(2)
            slow.report(2, 0, False)
            other.report(0, 0, True)
            _wait(lambda: _reported(arb, "slow", 2) and _reported(arb, "other", 0), what="reports")
            outcome: list = []

            def borrow() -> None:
                try:
                    outcome.append(asker.borrow(2, timeout=5.0))
                except ArbiterError as exc:  # denied when the timeout passes: nobody answered
                    outcome.append(exc)

            borrower = threading.Thread(target=borrow)
            borrower.start()
            _wait(lambda: slow.reclaim_requests == [2], what="the reclaim")
            slow.report(3, 0, False)  # more idle than asked: it is still expected to answer
            borrower.join(timeout=10.0)
            assert isinstance(outcome[0], ArbiterError)  # waited for slow until the timeout
            assert other.reclaim_requests == [] and arb.stats["asks_withdrawn"] == 0
        finally:
            for c in (slow, other, asker):
                c.close(force=True)
