"""The shared host link through the arbiter (Select-N §4.5): every active server's LINK
demand goes through the same ``LinkCoordinator`` the simulator runs; the server's cap
follows the answer."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from memory_ext.policy.interval_manager import demand_from_timings
from memory_ext.policy.select_n import LinkCoordinator
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient, ArbiterError
from memory_ext.pool.lent_pool import LentPool
from memory_ext.vmm import host_backend

G = 4 * os.sysconf("SC_PAGE_SIZE")
N, LAYER = 8, 1_000_000
T_C, T_TR = 1e-3, 1e-3  # one layer's compute and copy: alone, streaming every layer fills the link
BW = LAYER / T_TR


@pytest.fixture
def sock_path():
    d = tempfile.mkdtemp(prefix="arb-", dir="/tmp")
    yield os.path.join(d, "arb.sock")
    for p in Path(d).iterdir():
        p.unlink()
    os.rmdir(d)


def _demand(name, slo_s=1.0, t_c=T_C):
    return demand_from_timings(name, N, LAYER, t_c, T_TR, slo_s, 2)


def _send(client, d, active=True, bw=BW):
    return client.link(active=active, num_layers=d.num_layers, layer_bytes=d.layer_bytes, link_bytes_per_s=bw,
                       min_interval=d.min_interval, iter_times=[d.iter_times[i] for i in range(1, N + 2)])  # fmt: skip


def _intervals(arb):
    return {c["name"]: c["link_interval"] for c in arb.status()["clients"]}


def test_the_arbiter_decides_as_the_link_coordinator_and_shares_the_link(sock_path):
    with Arbiter(sock_path, host_backend(G), 4) as arb:
        a, b = (ArbiterClient(sock_path, n, host_backend(G)) for n in ("a", "b"))
        try:
            da, db = _demand("a"), _demand("b", t_c=2e-3)
            alone = _send(a, da)
            assert alone["interval"] == LinkCoordinator(BW).decide(da).intervals["a"] == 1  # the link is a's
            assert alone["sharing"] == 1
            both = _send(b, db)
            joint = LinkCoordinator(BW).decide(db, [da])
            assert joint.accepted and joint.total_rate <= BW * (1 + 1e-9)
            assert both["interval"] == joint.intervals["b"] and both["sharing"] == 2
            assert _intervals(arb)["a"] == joint.intervals["a"] > 1  # a now streams fewer layers
            assert _send(a, da)["interval"] == joint.intervals["a"]  # stable when asked again
            _send(b, db, active=False)  # b goes idle: the link is a's again
            assert _intervals(arb)["b"] is None
            assert _send(a, da)["interval"] == 1
            _send(b, db)
            b.close(force=True)  # b dies: its demand goes with it
            time.sleep(0.2)
            assert _send(a, da)["interval"] == 1
        finally:
            a.close(force=True)
            b.close(force=True)


def test_a_link_nobody_fits_on_streams_nothing_more(sock_path):
    with Arbiter(sock_path, host_backend(G), 4):
        a = ArbiterClient(sock_path, "a", host_backend(G))
        try:
            tight = demand_from_timings("a", N, LAYER, T_C, T_TR, 1e-4, 2)  # compute alone misses the SLO
            assert tight.min_interval is None
            reply = _send(a, tight)
            assert reply["interval"] is None and "SLO" in reply["reason"]
        finally:
            a.close(force=True)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"iter_times": [0.01] * 3}, "iter_times"),
        ({"iter_times": [0.01] * N + [-1.0]}, f"iter_times[{N}]"),
        ({"link_bytes_per_s": 0}, "link_bytes_per_s"),
        ({"min_interval": 0}, "min_interval"),
        ({"num_layers": 0}, "num_layers"),
        ({"active": 1}, "active"),
    ],
)
def test_a_malformed_link_is_refused_naming_the_field_and_the_arbiter_carries_on(sock_path, change, field):
    with Arbiter(sock_path, host_backend(G), 4) as arb:
        a = ArbiterClient(sock_path, "a", host_backend(G))
        try:
            d = _demand("a")
            args = dict(active=True, num_layers=N, layer_bytes=LAYER, link_bytes_per_s=BW,
                        min_interval=d.min_interval, iter_times=[d.iter_times[i] for i in range(1, N + 2)])  # fmt: skip
            args.update(change)
            with pytest.raises(ArbiterError) as err:
                a.link(**args)
            assert err.value.field == field, err.value
            assert _send(a, d)["interval"] == 1 and arb.status()["clients"][0]["link_interval"] == 1
        finally:
            a.close(force=True)


def _weights_state(**kw):
    from sglang_memx.weights import remap

    store = SimpleNamespace(copy_bytes_per_s=lambda: BW)
    # copies beside the compute (a GPU's copy engine), as _demand's numbers assume
    w = SimpleNamespace(tbt_slo_s=1.0, depth=2, profile=None, decode_layer_s=T_C, decode_step_s=N * T_C,
                        n_layers=N, layer_bytes=LAYER, layer_transfer_s=T_TR, last_decode_batch=1, store=store,
                        link_demand=None, link=None, link_layers=None, link_asked_at=0.0,
                        copies_share_compute=False)  # fmt: skip
    w.__dict__.update(kw)
    return remap, w


def test_the_servers_cap_follows_the_arbiters_share_and_an_idle_server_withdraws(sock_path):
    with Arbiter(sock_path, host_backend(G), 4) as arb:
        other = ArbiterClient(sock_path, "other", host_backend(G))
        pool = LentPool(sock_path, "self", host_backend(G))
        try:
            remap, w = _weights_state()
            assert remap.link_cap(w, pool, active=True) == N - 2  # alone: all 8 may stream, 2 of them in the slots
            _send(other, _demand("other", t_c=2e-3))
            w.link_asked_at = 0.0  # the poll interval passed
            shared = remap.link_cap(w, pool, active=True)
            joint = LinkCoordinator(BW).decide(w.link_demand, [_demand("other", t_c=2e-3)])
            assert shared == max(0, N // joint.intervals[w.link_demand.name] - 2) < N - 2
            assert w.link["sharing"] == 2
            assert remap.link_cap(w, pool, active=False) is None  # idle: demand withdrawn
            assert [c["link_interval"] for c in arb.status()["clients"] if c["name"] == "self"] == [None]
            assert remap.link_cap(w, None, active=True) is None  # private pool: no link
        finally:
            other.close(force=True)
            pool.close()
