"""The governor in the engine (``coordinator.governor.GovernorPart``): its step measures decode
steps tick to tick, admission asks it before a request joins the running batch (the hook on
``PrefillAdder.add_one_req``), its status, and its registration (with a TPOT SLO or ``--memx-governor``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memory_ext.policy.governor import BatchGovernor, StepTimeModel
from sglang_memx.config import MemxConfig
from sglang_memx.coordinator import device
from sglang_memx.coordinator.governor import GovernorPart, SloInForce
from sglang_memx.coordinator.parts import Iteration
from sglang_memx.hooks import scheduler as hooks
from sglang_memx.upstream import scheduler as up_sched
from support.fakes import FakeBatch, FakeReq, FakeScheduler
from support.pool_build_stub import governor_parts

IDLE = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=bool, is_mixed=bool, is_extend=bool))  # neither


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _trained(a=0.010, b=0.002, n=20):
    m = StepTimeModel(min_samples=4, use_kv=False)
    for i in range(n):
        m.observe(1 + i % 6, 0, a + b * (1 + i % 6))
    return m


def _run_step(part, scheduler):
    (s,) = part.steps()
    s.run(Iteration(scheduler, None, None, None, None))


def test_decode_steps_are_measured_tick_to_tick():
    clock = Clock()
    part = GovernorPart(BatchGovernor(0.05), clock=clock)
    running = [FakeReq(prompt=10, outputs=2), FakeReq(prompt=20, outputs=3)]
    sched = FakeScheduler(running=running)  # the last batch is the running (decode) batch
    _run_step(part, sched)  # the first tick only starts the clock
    assert part.governor.model.samples == 0 and (part.running, part.running_kv_tokens) == (2, 35)
    assert part.max_running_seen == 2 and part.status()["governor"]["max_running_seen"] == 2
    clock.t += 0.030
    _run_step(part, sched)
    assert part.governor.model.samples == 1 and part.last_step_s == pytest.approx(0.030)
    assert part.measured_s == pytest.approx(0.030)
    clock.t += 0.040
    _run_step(part, sched)
    assert part.measured_s == pytest.approx(0.030 + 0.2 * 0.010)


@pytest.mark.parametrize("last", [None, FakeBatch([FakeReq()], decode=False), FakeBatch([], decode=True)])
def test_prefill_mixed_or_idle_iterations_are_not_samples(last):
    clock = Clock()
    part = GovernorPart(BatchGovernor(0.05), clock=clock)
    sched = FakeScheduler(running=[FakeReq()])
    sched.last_batch = last
    for _ in range(3):
        _run_step(part, sched)
        clock.t += 0.5
    assert part.governor.model.samples == 0 and part.measured_s is None


def _adder(running, admitted=()):
    alloc = SimpleNamespace()
    kv = SimpleNamespace(status=dict)
    coordinator = device.tie(alloc, device.Coordinator(kv))
    adder = SimpleNamespace(token_to_kv_pool_allocator=alloc, running_batch=FakeBatch(running),
                            can_run_list=list(admitted))  # fmt: skip
    return coordinator, adder


def _original(calls):
    def original(adder, req, has_chunked_req, truncation_align_size):
        calls.append(req)
        adder.can_run_list.append(req)
        return up_sched.add_result("CONTINUE")

    return original


@pytest.mark.parametrize(
    "n_running,n_admitted,joins",
    [
        (0, 0, True),  # an empty batch always takes one
        (4, 0, True),  # predicted 10 + 2 * 5 = 20 ms: at the SLO
        (3, 1, True),  # this pass's admissions count as running
        (5, 0, False),  # 22 ms > 20 ms: the request waits
        (3, 2, False),
    ],
)
def test_admission_asks_the_governor_first(n_running, n_admitted, joins):
    coordinator, adder = _adder([FakeReq() for _ in range(n_running)], [FakeReq() for _ in range(n_admitted)])
    part = GovernorPart(BatchGovernor(0.020, _trained()))
    coordinator.register(part)
    calls: list = []
    req = FakeReq()
    result = hooks.around_add_one_req(_original(calls), adder, req, False, None)
    if joins:
        assert calls == [req] and result == up_sched.add_result("CONTINUE")
    else:  # upstream's "stop adding": the request stays in the waiting queue, upstream never saw it
        assert calls == [] and result == up_sched.add_result("OTHER") and req not in adder.can_run_list
    reason = part.governor.last.reason
    assert reason == ("empty_batch" if n_running + n_admitted == 0 else "within_slo" if joins else "over_slo")
    doc = coordinator.status()["governor"]
    assert doc["decisions"][reason] == 1 and doc["tpot_slo_ms"] == 20 and doc["batch_cap"] == 5


def test_without_the_governor_admission_is_upstreams():
    coordinator, adder = _adder([FakeReq() for _ in range(50)])
    calls: list = []
    hooks.around_add_one_req(_original(calls), adder, FakeReq(), False, None)
    assert len(calls) == 1 and coordinator.part(GovernorPart) is None
    assert coordinator.status()["governor"] is None
    assert "measure the decode step" not in [s.name for _, s in coordinator.iteration_order()]


def test_the_pool_build_registers_the_governor_with_a_tpot_slo_or_the_flag(monkeypatch):
    for slo, flag, want in ((None, False, []), (80.0, False, [0.08]), (None, True, [None]), (80.0, True, [0.08])):
        config = MemxConfig(elastic_kv=True, tpot_slo_ms=slo, governor=flag)
        assert [p.governor.tpot_slo_s for p in governor_parts(monkeypatch, config)] == want


def test_status_names_the_slos_in_force_and_where_each_came_from():
    part = GovernorPart(BatchGovernor(0.020, _trained()))
    assert part.status()["governor"]["slos"] == {"tpot": {"ms": 20.0, "source": "--memx-tpot-slo-ms"}, "ttft": None}
    served = GovernorPart(BatchGovernor(0.080), tpot_source="models.yaml: models[1].tpot_slo_ms",
                          ttft=SloInForce(500.0, "--memx-ttft-slo-ms"))  # fmt: skip
    doc = served.status()["governor"]
    assert doc["slos"] == {"tpot": {"ms": 80.0, "source": "models.yaml: models[1].tpot_slo_ms"},
                           "ttft": {"ms": 500.0, "source": "--memx-ttft-slo-ms"}}  # fmt: skip
    assert (doc["batch_cap"], doc["batch_cap_reason"], doc["tpot_slo_ms"]) == (None, "learning", 80.0)


@pytest.mark.parametrize(
    "env,ttft,host_gb,source,want_ttft",
    [
        ({}, None, None, "--memx-tpot-slo-ms", None),  # the flag, given directly
        ({"SGLANG_MEMX_TPOT_SLO_SOURCE": "m.yaml: models[0].tpot_slo_ms"}, None, None,
         "m.yaml: models[0].tpot_slo_ms", None),  # passed by sglang-memx serve from models.yaml
        ({}, 900.0, 1.0, "--memx-tpot-slo-ms", {"ms": 900.0, "source": "--memx-ttft-slo-ms"}),
    ],
)  # fmt: skip
def test_the_pool_build_gives_the_governor_its_slo_sources(monkeypatch, env, ttft, host_gb, source, want_ttft):
    monkeypatch.delenv("SGLANG_MEMX_TPOT_SLO_SOURCE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = MemxConfig(elastic_kv=True, tpot_slo_ms=80.0, ttft_slo_ms=ttft, host_buffer_gb=host_gb).validate()
    (part,) = governor_parts(monkeypatch, config)
    assert part.status()["governor"]["slos"] == {"tpot": {"ms": 80.0, "source": source}, "ttft": want_ttft}


def test_a_real_status_renders_in_metrics_and_top():
    """The governor section the component writes is the one ``/memx/metrics`` and ``top`` read
    (test_metrics_top.py tables their output on hand-written sections of the same shape)."""
    from sglang_memx.metrics import render_prometheus
    from sglang_memx.top import _governor_line

    part = GovernorPart(BatchGovernor(0.020, _trained()), tpot_source="models.yaml: models[0].tpot_slo_ms")
    part.governor.may_grow(5, 0, 0)
    part.running, part.measured_s = 3, 0.0165  # as its step would leave them
    gov = part.status()["governor"]
    text = render_prometheus({"schedulers": [{"dp_rank": 0, "elastic_kv": dict(ELASTIC, governor=gov)}]})
    assert 'memx_governor_batch_cap{dp_rank="0"} 5' in text
    assert 'memx_governor_decisions_total{dp_rank="0",reason="over_slo"} 1' in text
    assert 'memx_governor_tpot_slo_seconds{dp_rank="0",source="models.yaml: models[0].tpot_slo_ms"} 0.02' in text
    assert 'memx_governor_measured_tpot_seconds{dp_rank="0"} 0.0165' in text
    assert 'memx_governor_predicted_tpot_seconds{dp_rank="0"} 0.016' in text
    line = _governor_line(gov)
    assert "TPOT 20.0 ms (models.yaml: models[0].tpot_slo_ms)" in line and "cap 5 (predicted_tpot_within_slo)" in line
    assert "TPOT predicted 16.0 ms / measured 16.5 ms" in line and "refused 1" in line


ELASTIC = {
    "mapped_bytes": 0, "logical_bytes": 0, "groups_mapped": 0, "pool_capacity_bytes": 0, "groups_mapped_total": 0,
    "groups_unmapped_total": 0, "grow_refused": 0, "map_seconds": 0.0, "unmap_seconds": 0.0,
    "max_map_seconds": 0.0, "max_unmap_seconds": 0.0, "chunk_bytes": 4096,
}  # fmt: skip


def test_a_prefill_the_running_requests_wait_through_is_a_stall():
    """The interval of a prefill batch counts as stalled time of the requests running at the tick
    before it; with nobody running it counts nothing; a mixed batch counts what exceeds the step."""
    clock = Clock()
    part = GovernorPart(BatchGovernor(0.05, _trained(a=0.010, b=0.002)), clock=clock)
    idle = FakeScheduler(running=[])
    idle.last_batch = FakeBatch([FakeReq()], decode=False)  # a prefill while nothing ran
    _run_step(part, idle)
    clock.t += 0.5
    _run_step(part, idle)
    assert part.governor.prefill.iterations == 0
    running = [FakeReq(prompt=10, outputs=2), FakeReq(prompt=20, outputs=3)]
    decode = FakeScheduler(running=running)
    for _ in range(2):
        clock.t += 0.014
        _run_step(part, decode)  # decode steps of 2: 2 tokens each
    prefill = FakeScheduler(running=running)
    prefill.last_batch = FakeBatch([FakeReq(prompt=500)], decode=False)
    clock.t += 0.040
    _run_step(part, prefill)  # the 2 running requests waited 40 ms
    mixed = FakeScheduler(running=running)
    mixed.last_batch = FakeBatch(running + [FakeReq(prompt=64)], mixed=True)
    clock.t += 0.020
    _run_step(part, mixed)  # a mixed step of 2 predicted at 14 ms took 20: 6 ms stalled, 2 tokens
    stalls = part.governor.prefill
    assert stalls.stalls == 2 and stalls.iterations == 4
    d = part.governor.model.decay
    assert stalls.tokens == pytest.approx(2 * d**3 + 2 * d**2 + 2)
    assert stalls.stalled_s == pytest.approx(0.040 * d + 0.006)
    doc = part.status()["governor"]
    assert doc["prefill_stalls"]["stalls"] == 2 and doc["measured_decode_step_ms"] == pytest.approx(14.0)


def test_the_parking_question_gets_the_predicted_tpot_and_the_slo_only_when_both_exist():
    """``park_tpot``: None without a TPOT SLO or while the step model learns (parking is judged as
    before); else the predicted TPOT of the batch with the request (the step model's at one more
    request) and the SLO."""
    running, req = [FakeReq(prompt=10, outputs=2)] * 2, FakeReq(prompt=30)
    assert GovernorPart(BatchGovernor(None, _trained())).park_tpot(running, req) is None  # --memx-governor alone
    assert GovernorPart(BatchGovernor(0.05, StepTimeModel(min_samples=4))).park_tpot(running, req) is None  # learning
    park = GovernorPart(BatchGovernor(0.05, _trained())).park_tpot(running, req)
    assert park.slo_s == 0.05 and park.step_s == pytest.approx(0.010 + 0.002 * 3, rel=1e-3)


def test_prefill_iterations_teach_the_prefill_time_by_the_tokens_they_computed():
    """A prefill batch's interval, with or without requests running, is a sample of the prefill-time
    model at its extend tokens; a mixed batch's time beyond its predicted step at its prompt tokens."""
    clock = Clock()
    part = GovernorPart(BatchGovernor(0.05, _trained(a=0.010, b=0.002)), clock=clock)
    sched = FakeScheduler(running=[])
    _run_step(part, sched)
    for tokens, seconds in ((100, 0.030), (300, 0.050), (500, 0.070)):
        sched.last_batch = FakeBatch([FakeReq(prompt=tokens)], decode=False, extend_tokens=tokens)
        clock.t += seconds
        _run_step(part, sched)
    running = [FakeReq(prompt=10, outputs=2), FakeReq(prompt=20, outputs=3)]
    mixed = FakeScheduler(running=running)
    mixed.last_batch = IDLE  # the tick sees the 2 running requests, no sample
    _run_step(part, mixed)
    mixed.last_batch = FakeBatch(running + [FakeReq(prompt=200)], mixed=True, extend_tokens=200 + 2)
    clock.t += 0.014 + 0.040  # a step of 2 (14 ms) and 200 prompt tokens (40 ms)
    _run_step(part, mixed)
    model = part.governor.prefill_time
    assert model.samples == 4 and model.coef == pytest.approx((0.020, 0.0001), rel=1e-6)
    assert part.status()["governor"]["prefill_time"]["samples"] == 4


def test_admission_judges_each_running_request_from_the_tick_that_saw_its_first_token():
    """The requests' paces count from the first tick that saw a token: one that has waited long for
    its tokens refuses a newcomer that fresh requests would take; this pass's admissions count in
    the batch and their prompts in the pass's prefill."""
    clock = Clock()
    part = GovernorPart(BatchGovernor(0.030, _trained(a=0.010, b=0.002)), clock=clock)
    for tokens in (64, 128, 256, 512):
        part.governor.prefill_time.observe(tokens, 0.020 + 0.0001 * tokens)
    slow, fresh = FakeReq(prompt=10, outputs=1, max_new=51), FakeReq(prompt=10, outputs=1, max_new=51)
    _run_step(part, FakeScheduler(running=[slow], last=IDLE))  # slow's first token seen now
    clock.t += 1.33
    slow.output_ids = [0] * 41  # 40 tokens in 1.33 s, 10 to go
    _run_step(part, FakeScheduler(running=[slow, fresh], last=IDLE))  # fresh's first token seen now
    assert [p.decoded for p in part.paces([slow, fresh])] == [40, 0]
    coordinator, adder = _adder([slow, fresh])
    coordinator.register(part)
    calls: list = []
    newcomer = FakeReq(prompt=200)
    assert hooks.around_add_one_req(_original(calls), adder, newcomer, False, None) == up_sched.add_result("OTHER")
    d = part.governor.last
    assert (d.reason, d.rule, d.running) == ("over_slo", "per_request", 2)
    assert d.predicted_s == pytest.approx((1.33 + 0.040 + 10 * 0.016) / 50)
    coordinator, adder = _adder([fresh], admitted=[FakeReq(prompt=100)])
    coordinator.register(part)
    assert hooks.around_add_one_req(_original(calls), adder, newcomer, False, None) == up_sched.add_result("CONTINUE")
    d = part.governor.last  # fresh: one 50 ms iteration for both prompts, then 50 steps of 3
    assert (d.reason, d.running) == ("within_slo", 2)
    assert d.predicted_s == pytest.approx((0.050 + 50 * 0.016) / 50)


def test_without_a_tpot_slo_no_paces_are_built(monkeypatch):
    """``--memx-governor`` alone: the admission question is asked at every iteration a request
    waits, and nothing would judge the paces, so none are built (the decision is ``no_slo``)."""
    part = GovernorPart(BatchGovernor(None, _trained()))
    monkeypatch.setattr(part, "paces", lambda reqs: pytest.fail("paces built without an SLO"))
    d = part.may_grow([FakeReq(), FakeReq()], [FakeReq()], FakeReq())
    assert (d.admit, d.reason, d.running) == (True, "no_slo", 3)
    assert part.would_admit([FakeReq()], FakeReq())
    assert GovernorPart(BatchGovernor(0.03, _trained())).governor.judges_paces


def test_at_tensor_parallel_every_rank_measures_with_rank0s_clock_and_paces_count_to_the_tick():
    """``tick_time`` (``RankAgreement.tick_time``, faked: rank 0's clock reads 500 s + 25 ms a tick, this
    rank's own 100 s + 40 ms) replaces this rank's clock once a tick; the decode step measured is rank
    0's and the running requests' paces count to the tick's agreed time, never to this rank's clock."""
    clock = Clock()
    rank0_clock = iter([500.0, 500.025, 500.050])
    part = GovernorPart(BatchGovernor(0.05), clock=clock, tick_time=lambda: next(rank0_clock))
    running = [FakeReq(prompt=10, outputs=2)]
    sched = FakeScheduler(running=running)
    for _ in range(3):
        _run_step(part, sched)
        clock.t += 0.040
    assert part.last_step_s == pytest.approx(0.025) and part.governor.model.samples == 2
    # its first token was seen at rank 0's first tick (500 s); its pace counts to the last tick (500.05 s)
    assert part.paces(running)[0].elapsed_s == pytest.approx(0.050)
