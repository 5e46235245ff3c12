"""A crashed pool arbiter is started again by its survivors (``restart_arbiter``), who then
adopt what they kept; an arbiter stopped on purpose is not restarted."""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import pytest

from memory_ext.pool import Owner
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import query_arbiter_status
from memory_ext.pool.lent_pool import LentPool
from memory_ext.vmm import host_backend
from sglang_memx.config import MemxConfig
from sglang_memx.elastic.shared_pool import ensure_arbiter, restart_crashed_arbiter
from support.arbiter import socket_dir
from support.waiting import wait_until

G = 4 * os.sysconf("SC_PAGE_SIZE")


_wait = partial(wait_until, timeout=20.0, interval=0.02)


@pytest.fixture
def pool_dir():
    with socket_dir("arbr-") as d:
        yield d
        for pid_file in d.glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError, OSError):
                pass


def _config(pool_dir: Path) -> MemxConfig:
    budget_gb = 8 * G / (1 << 30)
    return MemxConfig(elastic_kv=True, pool="r", pool_budget_gb=budget_gb, pool_dir=str(pool_dir),
                      chunk_kb=max(4, G >> 10)).validate()  # fmt: skip


def test_a_survivor_restarts_a_sigkilled_arbiter_and_adopts_what_it_kept(pool_dir):
    cfg = _config(pool_dir)
    sock = ensure_arbiter(cfg, G)
    first = int((pool_dir / "r.pid").read_text())
    vmm = host_backend(G)
    lent = LentPool(sock, "survivor", vmm, timeout=5.0, restart_arbiter=lambda: restart_crashed_arbiter(cfg, G))
    try:
        assert lent.borrow(3) == 3
        used = lent.pool.acquire(Owner.KV, 2)
        os.kill(first, signal.SIGKILL)
        _wait(lambda: not lent.client.connected, what="the client to see the arbiter gone")
        _wait(lambda: lent.maybe_rejoin(), what="the survivor to restart the arbiter and rejoin")
        second = int((pool_dir / "r.pid").read_text())
        assert second != first
        st = query_arbiter_status(sock)
        assert st["budget"] == 8 and sum(c["held"] for c in st["clients"]) == 3  # the 3 kept chunks, adopted
        assert sum(c["held"] for c in st["clients"]) + st["free"] + st["budget"] - st["created"] == st["budget"]
        arb = lent.status()["arbiter"]
        assert arb["connected"] is True and arb["rejoins"] == 1
        assert lent.borrow(2) == 2  # borrowing works again, from the new arbiter
        lent.pool.release(Owner.KV, used)
    finally:
        lent.close()
        vmm.close()
    assert vmm.live_chunks() == []


def test_an_arbiter_stopped_on_purpose_is_not_restarted(pool_dir):
    cfg = _config(pool_dir)
    ensure_arbiter(cfg, G)
    pid = int((pool_dir / "r.pid").read_text())
    os.kill(pid, signal.SIGTERM)  # as `sglang-memx pool stop` and serve's shutdown do
    _wait(lambda: not (pool_dir / "r.pid").exists(), what="the arbiter to remove its pid file")
    assert restart_crashed_arbiter(cfg, G) is False
    assert not (pool_dir / "r.pid").exists() and not (pool_dir / "r.sock").exists()


def test_a_live_arbiter_is_never_replaced(pool_dir):
    cfg = _config(pool_dir)
    ensure_arbiter(cfg, G)
    pid = int((pool_dir / "r.pid").read_text())
    assert restart_crashed_arbiter(cfg, G) is False
    assert int((pool_dir / "r.pid").read_text()) == pid


@pytest.mark.parametrize("outcome", ["refuses", "raises"])
def test_a_restart_that_fails_leaves_the_survivor_private(outcome, caplog):
    with socket_dir("arbr-") as d:
        sock = str(d / "arb.sock")
        arb = Arbiter(sock, host_backend(G), 6).start()
        vmm = host_backend(G)
        calls = []

        def restart():
            calls.append(1)
            if outcome == "raises":
                raise RuntimeError("no budget")
            return False

        lent = LentPool(sock, "survivor", vmm, timeout=5.0, restart_arbiter=restart)
        try:
            assert lent.borrow(2) == 2
            arb.stop()
            _wait(lambda: not lent.client.connected)
            assert lent.maybe_rejoin() is False and calls == [1]
            assert lent.status()["arbiter"]["connected"] is False and lent.borrow(1) == 0
            if outcome == "raises":
                assert any("could not restart the arbiter" in r.getMessage() for r in caplog.records)
        finally:
            lent.close()
            vmm.close()
