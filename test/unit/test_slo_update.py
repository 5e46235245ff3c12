"""``POST /memx/slo``: the body's checks (400 / 409 naming the field), the wire to the schedulers,
what a scheduler changes (the governor, the weights' step SLO when it was the TPOT SLO, the host
buffer's rule) and what it refuses (changing nothing), and the route's key level (upstream's
``/set_internal_state``'s: admin optional)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from memory_ext.policy.buffer_scaling import HostBufferRule, LogicalBufferScaler
from memory_ext.policy.governor import BatchGovernor
from sglang_memx import slo_update
from sglang_memx.config import MemxConfig
from sglang_memx.coordinator.components import WeightLender
from sglang_memx.coordinator.governor import GovernorPart
from sglang_memx.endpoints import add_status_routes
from sglang_memx.router_activity import is_activity
from sglang_memx.upstream import http as up_http

GOVERNED = MemxConfig(elastic_kv=True, governor=True)
WITH_SLO = MemxConfig(elastic_kv=True, tpot_slo_ms=50.0)
HOST_RULE = MemxConfig(elastic_kv=True, host_buffer_gb=1.0, ttft_slo_ms=500.0, tpot_slo_ms=50.0)


@pytest.mark.parametrize(
    "doc,config,field,status",
    [
        ([1], GOVERNED, "body", 400), (None, GOVERNED, "body", 400), ("50", GOVERNED, "body", 400),
        ({}, GOVERNED, "tpot_slo_ms", 400),
        ({"tpot_slo_ms": 0}, GOVERNED, "tpot_slo_ms", 400), ({"tpot_slo_ms": -3}, GOVERNED, "tpot_slo_ms", 400),
        ({"tpot_slo_ms": "50"}, GOVERNED, "tpot_slo_ms", 400), ({"tpot_slo_ms": True}, GOVERNED, "tpot_slo_ms", 400),
        ({"tpot_slo_ms": float("inf")}, GOVERNED, "tpot_slo_ms", 400),
        ({"tpot_slo_ms": float("nan")}, GOVERNED, "tpot_slo_ms", 400),
        ({"tpot_slo_ms": 50, "ttft_slo_ms": 9}, GOVERNED, "ttft_slo_ms", 400),
        ({"tpot": 50}, GOVERNED, "tpot", 400),
        ({"tpot_slo_ms": 50}, MemxConfig(elastic_kv=True), "tpot_slo_ms", 409),  # no governor
        ({"tpot_slo_ms": None}, HOST_RULE, "tpot_slo_ms", 409),  # the host buffer's rule needs one
    ],
)  # fmt: skip
def test_a_bad_body_is_refused_naming_the_field(doc, config, field, status):
    with pytest.raises(slo_update.SloUpdateError) as err:
        slo_update.parse(doc, config)
    assert (err.value.field, err.value.status) == (field, status)
    assert str(err.value).startswith(field + ":")


@pytest.mark.parametrize("config", [GOVERNED, WITH_SLO, HOST_RULE])
def test_a_good_body_parses_and_crosses_the_wire(config):
    assert slo_update.parse({"tpot_slo_ms": 12}, config) == 12.0
    for ms in (12.5, None):
        if ms is None and config is HOST_RULE:
            continue
        wire = slo_update.to_wire(slo_update.parse({"tpot_slo_ms": ms}, config))
        assert all(isinstance(v, float) for v in wire.values())  # upstream's request carries numbers only
        assert slo_update.is_update(wire) and not is_activity(wire)
        assert slo_update.from_wire(wire) == ms


@dataclass
class _Weights:
    tbt_slo_s: float | None
    tbt_slo_source: str | None


@dataclass
class _Host:
    rule: HostBufferRule | None


class _Coordinator:
    """The two questions ``apply`` asks of a device's coordinator."""

    def __init__(self, parts, host=None):
        self.parts, self.host = parts, host

    def part(self, kind):
        return next((p for p in self.parts if isinstance(p, kind)), None)

    def host_buffer(self):
        return self.host


def _device(slo_s=0.05, weights_source="--memx-tpot-slo-ms", rule=False):
    governor = GovernorPart(BatchGovernor(slo_s))
    weights = _Weights(slo_s, weights_source)
    host = _Host(HostBufferRule(4, 0.5, slo_s) if rule else None)
    return _Coordinator([governor, WeightLender(kv=None, weights=weights)], host), governor, weights, host


def test_apply_gives_the_slo_to_the_governor_the_weights_and_the_host_buffer():
    coordinator, governor, weights, host = _device(rule=True)
    assert slo_update.apply(coordinator, 20.0)
    assert governor.governor.tpot_slo_s == pytest.approx(0.02) and governor.tpot_source == slo_update.SOURCE
    assert governor.status()["governor"]["slos"]["tpot"] == {"ms": 20.0, "source": "POST /memx/slo"}
    assert weights.tbt_slo_s == pytest.approx(0.02) and weights.tbt_slo_source == slo_update.SOURCE
    assert host.rule.scaler.tpot_slo == pytest.approx(0.02)


def test_clearing_leaves_the_governor_without_an_slo_and_an_explicit_tbt_slo_stays():
    coordinator, governor, weights, _ = _device(weights_source="--memx-tbt-slo-ms")
    assert slo_update.apply(coordinator, None)
    assert governor.governor.tpot_slo_s is None and governor.status()["governor"]["slos"]["tpot"] is None
    assert weights.tbt_slo_s == 0.05 and weights.tbt_slo_source == "--memx-tbt-slo-ms"  # its own flag wins


@pytest.mark.parametrize("case", ["no coordinator", "no governor", "host rule and null"])
def test_a_rank_that_cannot_hold_it_changes_nothing(case):
    coordinator, governor, weights, host = _device(rule=True)
    if case == "no coordinator":
        assert not slo_update.apply(None, 20.0)
        return
    if case == "no governor":
        coordinator.parts = [p for p in coordinator.parts if p is not governor]
        assert not slo_update.apply(coordinator, 20.0)
    else:
        assert not slo_update.apply(coordinator, None)
    assert governor.governor.tpot_slo_s == 0.05 and weights.tbt_slo_s == 0.05 and host.rule.scaler.tpot_slo == 0.05


def test_the_policies_refuse_a_bad_slo_and_keep_theirs():
    governor = BatchGovernor(0.05)
    for bad in (0, -1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="tpot_slo"):
            governor.set_tpot_slo(bad)
    assert governor.tpot_slo_s == 0.05
    scaler = LogicalBufferScaler(max_chunks=4, ttft_slo=0.5, tpot_slo=0.05, per_sample=True)
    scaler.observe(ttft=None, tpot=1.0)  # one TPOT miss against the old SLO
    assert scaler.window_misses() == (0, 1)
    for bad in (0, None, float("inf"), False):
        with pytest.raises(ValueError, match="tpot_slo"):
            scaler.set_tpot_slo(bad)
    scaler.set_tpot_slo(2.0)
    assert scaler.tpot_slo == 2.0 and scaler.window_misses() == (0, 0)  # misses judged by the old SLO forgotten


# ------------------------------------------------------------------------------ the route
SENT: list = []


@pytest.fixture
def schedulers(monkeypatch):
    """One fake rank that answers ``updated`` with ``answer[0]``."""
    answer = [True]

    async def set_numbers(numbers):
        SENT.append(numbers)
        return [answer[0]]

    monkeypatch.setattr(up_http, "set_scheduler_numbers", set_numbers)
    SENT.clear()
    return answer


def _client(config: MemxConfig, keys=None) -> TestClient:
    app = FastAPI()
    assert add_status_routes(app, config)
    if keys is not None:
        up_http.add_api_key_middleware(app, api_key=keys[0], admin_api_key=keys[1])
    return TestClient(app, raise_server_exceptions=False)


def test_the_route_sets_refuses_and_reports_a_rank_that_did_not_take_it(schedulers):
    with _client(WITH_SLO) as c:
        r = c.post(slo_update.SLO_PATH, json={"tpot_slo_ms": 25})
        assert r.status_code == 200 and r.json() == {"tpot_slo_ms": 25.0, "source": "POST /memx/slo"}
        assert SENT == [{"memx_slo_tpot_ms": 25.0}]
        r = c.post(slo_update.SLO_PATH, content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "body"
        r = c.post(slo_update.SLO_PATH, json={"tpot_slo_ms": -1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "tpot_slo_ms"
        assert len(SENT) == 1  # nothing refused reached the schedulers
        assert c.get(slo_update.SLO_PATH).status_code == 405
        schedulers[0] = False
        r = c.post(slo_update.SLO_PATH, json={"tpot_slo_ms": None})
        assert r.status_code == 503 and r.json()["error"]["field"] == "tpot_slo_ms"
    with _client(MemxConfig()) as c:
        r = c.post(slo_update.SLO_PATH, json={"tpot_slo_ms": 25})
        assert r.status_code == 409 and "--memx-governor" in r.json()["error"]["message"]


@pytest.mark.parametrize("keys,token,want", [
    ((None, None), None, 200),
    (("k", None), None, 401), (("k", None), "k", 200),
    ((None, "adm"), None, 401), ((None, "adm"), "adm", 200),
    (("k", "adm"), "k", 401), (("k", "adm"), "adm", 200),
])  # fmt: skip
def test_the_route_has_the_key_level_of_upstreams_set_internal_state(schedulers, keys, token, want):
    """With ``--admin-api-key`` only the admin key sets the SLO; the normal API key reads the status."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with _client(WITH_SLO, keys) as c:
        assert c.post(slo_update.SLO_PATH, json={"tpot_slo_ms": 25}, headers=headers).status_code == want
