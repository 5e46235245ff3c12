"""One decision procedure per question: the server's path and the simulator's path, fed the same
numbers, decide the same.

* Admission (eLLM Alg. 1): the server's admission hook builds its question from upstream's
  prefill budget (``elastic.admission.server_ask``) and upstream commits an admitted request
  into that budget; the simulator's eLLM scheduler asks ``ElasticAdmissionPolicy.decide``. Same
  queue, same memory, same reservations -> same requests on the device, offloaded, deferred;
  both ask ``judge_prefill`` once per request scanned and get the same whole verdicts (what to
  do if the device refuses, whether only the buffer's room was short).
* Arbiter (X1): the live device arbiter plans a reclaim from its clients' reports; the
  simulator's ledger (``MemoryArbiter.request``) plans from its accounts. Same holdings, same
  idle / headroom / busy -> the same donors give the same amounts.
* Host buffer (eLLM Alg. 2): see ``test_same_host_buffer_rule`` below.
* Governor (the batch decision under the TPOT SLO): the server's governor component measures
  decode steps tick to tick and is asked by the admission hook (``around_add_one_req``); the
  simulator's ``governed`` scheduler learns from its decode iterations and asks before each
  admission. Same steps, same running batch, same queue -> the same whole decisions, in order.
"""

from __future__ import annotations

import time
import types

import pytest

from memory_ext.policy import ellm
from memory_ext.policy.arbiter import Kind, MemoryArbiter
from memory_ext.policy.ellm import DEFER, OFFLOAD, ON_GPU, ElasticAdmissionPolicy, PrefillRequest, judge_prefill
from memory_ext.pool.arbiter import Arbiter
from memory_ext.pool.arbiter_client import ArbiterClient
from memory_ext.vmm import host_backend
from sglang_memx.config import MemxConfig
from sglang_memx.coordinator import device
from sglang_memx.elastic import admission
from sglang_memx.elastic.host_buffer import build_host_buffer
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched
from support.fakes import FakeBatch, FakeReq, fake_admission_pool

ROW_BYTES = 1024  # one token's KV over all layers (the fake pool's buffers below)


# ------------------------------------------------------------------ admission
def _server_decisions(available, running_reserve, running, queue, buffer_tokens, verdicts=None):
    """The server path: upstream's real prefill budget (with memx's physical mode), memx's admission
    question per request, upstream's own ``reserve`` as the commit of an admitted request.
    ``verdicts`` (if given) collects each request's whole verdict."""
    allocator, tree, host = fake_admission_pool(available, buffer_tokens, ROW_BYTES)
    kv = types.SimpleNamespace(activation=None, weights=None)
    device.attach(allocator, kv, host=host)
    budget = up_sched.new_physical_budget(allocator, tree, 0)
    budget.total_offset = running_reserve
    adder = types.SimpleNamespace(token_to_kv_pool_allocator=allocator, tree_cache=tree, memory_budget=budget,
                                  can_run_list=[], running_batch=FakeBatch(running), page_size=1,
                                  rem_chunk_tokens=None, rem_input_tokens=1 << 20, new_chunked_req=None)  # fmt: skip
    out = {ON_GPU: [], OFFLOAD: [], DEFER: []}
    for req in queue:
        ask = admission.server_ask(
            adder,
            req,
            len(req.origin_input_ids),
            has_chunked_req=False,
            activation=device.of(allocator).activation_side(),
            host=host,
        )
        verdict = judge_prefill(ask)
        if verdicts is not None:
            verdicts.append(verdict)
        verdict = verdict.action
        out[verdict].append(req.rid)
        if verdict == DEFER:
            out[DEFER] += [r.rid for r in queue[queue.index(req) + 1 :]]
            break
        max_new = req.sampling_params.max_new_tokens
        if verdict == ON_GPU:
            budget.reserve(len(req.origin_input_ids), max_new)
        else:
            with up_sched.physical_check(budget, headroom=len(running) + 1, max_new=max_new):
                budget.reserve(len(req.origin_input_ids), max_new)
            host.pending_bytes += len(req.origin_input_ids) * ROW_BYTES
        adder.can_run_list.append(req)
    return out


def _sim_decisions(available, running_reserve, running, queue, buffer_tokens):
    """The simulator path: Alg. 1 over the same queue, in tokens (one chunk = one token)."""
    return _sim_decisions_and_verdicts(available, running_reserve, running, queue, buffer_tokens)[0]


def _sim_decisions_and_verdicts(available, running_reserve, running, queue, buffer_tokens, parkable=True):
    """``_sim_decisions`` and the verdicts the simulator's policy got, in the order it asked.
    ``parkable=False``: the requests' KV cannot be parked at all (a server without a host buffer
    asks with ``offload_kv`` 0)."""
    prefills = []
    for r in queue:
        prompt, max_new = len(r.origin_input_ids), r.sampling_params.max_new_tokens
        prefills.append(PrefillRequest(r.rid, prompt, kv_chunks=prompt + 1 + max_new, decode_chunks=max_new,
                                       kv_now_chunks=prompt + 1, offload_chunks=prompt if parkable else 0))  # fmt: skip
    verdicts = []

    def asked(ask):
        verdicts.append(judge_prefill(ask))
        return verdicts[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ellm, "judge_prefill", asked)  # the question the simulator's policy object asks
        d = ElasticAdmissionPolicy(lambda tokens: 0).decide(
            free_kv_chunks=available, idle_act_chunks=0, prefills=prefills, cpu_buffer_free_chunks=buffer_tokens,
            reserved_chunks=running_reserve, reserved_now_chunks=len(running),
        )  # fmt: skip
    on_gpu = [rid for rid in d.admitted if rid not in d.offloaded]
    return {ON_GPU: on_gpu, OFFLOAD: list(d.offloaded), DEFER: list(d.deferred)}, verdicts


CASES = [
    # (available tokens, running reservation, running requests, [(prompt, max_new)], buffer tokens)
    (1000, 0, 0, [(100, 50), (200, 100), (300, 100)], 0),  # everything fits
    (1000, 600, 4, [(100, 50), (200, 100), (150, 100)], 0),  # the third waits (no buffer)
    (1000, 600, 4, [(100, 50), (200, 100), (150, 100), (400, 50)], 1000),  # third offloaded, fourth too big
    (500, 480, 8, [(100, 200), (100, 200), (100, 200), (100, 200), (100, 200)], 250),  # buffer fills up
    (300, 0, 2, [(250, 100), (10, 5)], 0),  # first refused on its reservation: FCFS stops the scan
    (500, 0, 2, [(100, 50), (600, 10)], 2000),  # second fits neither the device nor, now, the physical room
]


@pytest.mark.parametrize("available,reserve,n_running,reqs,buffer_tokens", CASES)
def test_server_and_simulator_admit_the_same(available, reserve, n_running, reqs, buffer_tokens):
    running = [FakeReq(prompt=10, outputs=1) for _ in range(n_running)]
    queue = [FakeReq(prompt=p, max_new=m, rid=f"q{i}") for i, (p, m) in enumerate(reqs)]
    server = _server_decisions(available, reserve, running, queue, buffer_tokens)
    sim = _sim_decisions(available, reserve, running, queue, buffer_tokens)
    assert server == sim
    assert sum(len(v) for v in server.values()) == len(queue)


@pytest.mark.parametrize("available,reserve,n_running,reqs,buffer_tokens", CASES)
def test_server_and_simulator_get_the_same_whole_verdicts(available, reserve, n_running, reqs, buffer_tokens):
    """Both paths ask the one question once per request they scan (up to the first deferred) and
    get equal verdicts, fallback and buffer-full reason included (which the actions alone do not show)."""
    running = [FakeReq(prompt=10, outputs=1) for _ in range(n_running)]
    queue = [FakeReq(prompt=p, max_new=m, rid=f"q{i}") for i, (p, m) in enumerate(reqs)]
    server: list = []
    _server_decisions(available, reserve, running, queue, buffer_tokens, verdicts=server)
    _, sim = _sim_decisions_and_verdicts(available, reserve, running, queue, buffer_tokens, bool(buffer_tokens))
    assert server == sim
    scanned = next((i + 1 for i, v in enumerate(sim) if v.action == DEFER), len(queue))
    assert len(sim) == scanned


def test_the_cases_exercise_every_verdict():
    seen = set()
    for available, reserve, n_running, reqs, buffer_tokens in CASES:
        running = [FakeReq(prompt=10, outputs=1) for _ in range(n_running)]
        queue = [FakeReq(prompt=p, max_new=m) for p, m in reqs]
        seen |= {v for v, rids in _sim_decisions(available, reserve, running, queue, buffer_tokens).items() if rids}
    assert seen == {ON_GPU, OFFLOAD, DEFER}


def test_the_cases_exercise_every_part_of_the_verdict():
    """The whole-verdict comparison above sees an ON_GPU request the buffer could take if refused,
    one it could not, and a request deferred only for the buffer's room."""
    verdicts = []
    for available, reserve, n_running, reqs, buffer_tokens in CASES:
        running = [FakeReq(prompt=10, outputs=1) for _ in range(n_running)]
        queue = [FakeReq(prompt=p, max_new=m) for p, m in reqs]
        verdicts += _sim_decisions_and_verdicts(available, reserve, running, queue, buffer_tokens)[1]
    on_gpu = [v for v in verdicts if v.action == ON_GPU]
    assert {v.if_refused for v in on_gpu} == {OFFLOAD, DEFER}
    assert any(v.buffer_full for v in verdicts) and any(v.action == DEFER and not v.buffer_full for v in verdicts)


# ------------------------------------------------------------------ arbiter
def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def _live_reclaims(tmp_path, budget, holders, want):
    """Live arbiter: clients borrow their holdings, report, then ``asker`` borrows ``want``; return
    the RECLAIM amounts each donor received."""
    backend = host_backend(4096)
    clients = {}
    try:
        with Arbiter(tmp_path / "a.sock", backend, budget) as arb:
            for name, (held, _idle, _headroom, _busy) in holders.items():
                clients[name] = ArbiterClient(tmp_path / "a.sock", name, host_backend(4096))
                if held:
                    clients[name].borrow(held)
            for name, (_held, idle, headroom, busy) in holders.items():
                if name != "asker":
                    clients[name].report(idle, headroom, busy)
            assert _wait(lambda: all(c["idle"] is not None for c in arb.status()["clients"] if c["name"] != "asker"))
            try:
                clients["asker"].borrow(want, timeout=0.3)
            except Exception:
                pass  # nobody answers the reclaims here: only what was asked matters
            _wait(lambda: sum(sum(c.reclaim_requests) for c in clients.values()) > 0, 2.0)
            asked = {n: sum(c.reclaim_requests) for n, c in clients.items() if c.reclaim_requests}
            for c in clients.values():
                c.close(force=True)
            return asked
    finally:
        backend.close()


def _ledger_takes(budget, holders, want):
    """The simulator's ledger with the same holdings: every account's nominal is the fair share."""
    arb = MemoryArbiter({0: budget}, floor_fraction=0.0)
    share = budget // len(holders)
    keys = {name: arb.open(0, name, Kind.KV, share) for name in holders}
    for name, (held, idle, headroom, busy) in holders.items():  # move each account to its holding
        acc = arb.accounts[keys[name]]
        arb.free[0] += acc.held - held
        acc.held = held
        arb.set_busy(0, name, busy)
        if name != "asker":
            arb.report(keys[name], idle, headroom)
    arb.check()
    grant = arb.request(keys["asker"], want)  # the ledger takes FREE first, like the live arbiter
    takes: dict[str, int] = {}
    for t in grant.takes if grant is not None else ():
        if t.source is not None:
            takes[t.source.owner] = takes.get(t.source.owner, 0) + t.nbytes
    return takes


ARBITER_CASES = [
    # budget, {client: (held, idle, headroom, busy)}, asker wants
    (90, {"a": (40, 30, 0, False), "b": (40, 10, 5, True), "asker": (10, 0, 0, True)}, 30),
    (90, {"a": (50, 10, 0, True), "b": (30, 25, 0, False), "asker": (0, 0, 0, True)}, 40),
    (60, {"a": (30, 5, 5, True), "b": (20, 20, 0, False), "asker": (5, 0, 0, True)}, 12),
]


@pytest.mark.parametrize("budget,holders,want", ARBITER_CASES)
def test_live_arbiter_and_simulator_ledger_take_from_the_same_donors(tmp_path, budget, holders, want):
    live = _live_reclaims(tmp_path, budget, holders, want)
    ledger = _ledger_takes(budget, holders, want)
    assert live == ledger and live, (live, ledger)


# ------------------------------------------------------------------ host buffer (Alg. 2)
def test_same_host_buffer_rule():
    """The server's host buffer (``--memx-host-buffer-gb`` + SLO flags) and the simulator's
    ``ellm_elastic`` scheduler (``cpu_buffer_gb`` + model SLOs) hold the same rule: the same
    stream of TTFT / TPOT samples moves both logical sizes identically (in their units)."""
    import random

    from benchmark.sim.core.engine import InstanceConfig
    from benchmark.sim.core.models import model_spec
    from benchmark.sim.mechanisms.ellm import EllmElasticScheduler

    cfg = InstanceConfig(name="m", model=model_spec("Llama-3.1-8B"), gpu=0, kv_blocks=1000, prefix_caching=False,
                         ttft_slo_s=0.5, tpot_slo_s=0.05)  # fmt: skip
    units = 64
    sim = EllmElasticScheduler(cfg, cpu_buffer_gb=units * cfg.kv_block_bytes / 1e9 + 1e-9).rule
    server = build_host_buffer(
        MemxConfig(elastic_kv=True, host_buffer_gb=units * 4096 / (1 << 30), ttft_slo_ms=500, tpot_slo_ms=50), 4096
    ).rule
    assert sim.scaler.max_chunks == server.scaler.max_chunks == units
    rng = random.Random(7)
    sizes = []
    for _ in range(400):
        ttfts = [rng.choice([0.1, 0.9]) for _ in range(rng.randint(0, 2))]
        tpot = rng.choice([None, 0.01, 0.2])
        a, b = sim.observe_iteration(ttfts, tpot), server.observe_iteration(ttfts, tpot)
        assert a == b
        sizes.append(a)
    assert len(set(sizes)) > 3 and sim.events == server.events and sim.events["ttft"] and sim.events["tpot"]


# ------------------------------------------------------------------ governor (batch under the TPOT SLO)
# decode steps: (running requests as (prompt, generated), step seconds); then admission rounds:
# (running requests, waiting queue), both as (prompt, generated)
# (running, seconds, prefill tokens): decode steps of growing batches (0 tokens); after every third
# one a prefill iteration of 40 tokens per running request the same running batch waits through
# (its stall counts in the predicted TPOT; its tokens and seconds teach the prefill-time model)
GOVERNOR_STEPS = [
    step
    for n in range(1, 9)
    for step in [([(100, 1)] * n + [(300, 5)] * (n % 3), 0.010 + 0.002 * n + 0.0004 * (n % 3), 0)]
    + ([([(100, 1)] * n + [(300, 5)] * (n % 3), 0.004 * n, 40 * n)] if n % 3 == 0 else [])
] * 2
# admission rounds: running requests as (prompt, generated, seconds since their first token; each
# may decode MAX_NEW tokens), the waiting queue as (prompt, generated)
GOVERNOR_ROUNDS = [
    ([], [(100, 0), (100, 0)]),  # empty batch: one always joins
    ([(100, 1, 0.0)] * 3, [(100, 0), (100, 0), (2000, 0)]),
    ([(100, 1, 0.0)] * 5, [(100, 0), (100, 0)]),
    ([(100, 1, 0.0)] * 4 + [(300, 5, 0.08)], [(50, 0), (4000, 0), (10, 0)]),
    ([(100, 12, 0.25)] * 2 + [(100, 3, 0.02)], [(100, 0), (100, 0), (500, 0)]),  # one far behind, one on time
]
MAX_NEW = 16
NOW = 100.0


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _server_governor_decisions(slo_s, steps, rounds, default_scale=0.0):
    """The server path: the governor component's step on a scheduler whose last batch decoded, timed by
    its clock; then upstream's adder offering the queue through memx's admission hook."""
    from memory_ext.policy.default_slo import SoloStepDefault
    from memory_ext.policy.governor import BatchGovernor
    from sglang_memx.coordinator.governor import GovernorPart
    from sglang_memx.coordinator.parts import Iteration
    from sglang_memx.hooks import scheduler as hooks
    from support.fakes import FakeScheduler

    clock = _Clock()
    default = SoloStepDefault(default_scale) if default_scale else None  # as pool_build's, with the flag's scale
    part = GovernorPart(BatchGovernor(slo_s, default=default), clock=clock)
    (measure,) = part.steps()
    measure.run(Iteration(FakeScheduler(decode=False), None, None, None, None))  # after a prefill: starts the clock
    for running, step_s, prefilled in steps:  # each tick sees the batch that ran since the previous tick
        clock.t += step_s
        reqs = [FakeReq(prompt=p, outputs=o) for p, o in running]
        fake = FakeScheduler(running=reqs, decode=not prefilled, prefill_tokens=prefilled or None)
        measure.run(Iteration(fake, None, None, None, None))
    clock.t = NOW
    alloc = types.SimpleNamespace()
    device.tie(alloc, device.Coordinator(types.SimpleNamespace())).register(part)
    out = []

    def original(adder, req, has_chunked_req, truncation_align_size):
        adder.can_run_list.append(req)
        return up_sched.add_result("CONTINUE")

    for running, queue in rounds:
        batch = FakeBatch([_decoding(FakeReq(prompt=p, outputs=o, max_new=MAX_NEW), NOW - t) for p, o, t in running])
        adder = types.SimpleNamespace(token_to_kv_pool_allocator=alloc, can_run_list=[], running_batch=batch)
        for p, o in queue:
            result = hooks.around_add_one_req(original, adder, FakeReq(prompt=p, outputs=o), False, None)
            out.append(part.governor.last)
            if result != up_sched.add_result("CONTINUE"):
                break
    return out, part.governor


def _decoding(req, since: float):
    """``req`` as the governor's tick saw it first with one token, at ``since``."""
    up_req.memx_state(req).decoding_since = (since, 1)
    return req


def _sim_governor_decisions(slo_s, steps, rounds, default_scale=0.0):
    """The simulator path: the ``governed`` scheduler noting each pure decode plan and observing it
    once run; then its admission question over the same queue (FCFS: the first refusal ends the scan)."""
    from benchmark.sim.core.plan import BatchPlan
    from benchmark.sim.core.request import Request
    from benchmark.sim.mechanisms.governor import GovernedScheduler

    def reqs(pairs):
        out = []
        for i, (p, o, *since) in enumerate(pairs):
            r = Request(i, 0, 0.0, p, MAX_NEW if since else max(o, 1) + 1)
            r.generated = o
            if since:
                r.first_token_t = NOW - since[0]
            out.append(r)
        return out

    sched = GovernedScheduler(types.SimpleNamespace(name="m", tpot_slo_s=slo_s), default_slo_scale=default_scale)
    inst = types.SimpleNamespace(running=[], iterations=0, last_duration=0.0)
    for running, step_s, prefilled in steps:
        inst.running = reqs(running)
        for r in inst.running:
            r.decoding = True
        newcomer = Request(len(running), 0, 0.0, max(prefilled, 1), 2)
        plan = BatchPlan(prefills=[(newcomer, prefilled)]) if prefilled else BatchPlan(decodes=list(inst.running))
        sched.note_plan(inst, plan)
        inst.iterations += 1
        inst.last_duration = step_s
        sched.observe(inst)
    out = []
    for running, queue in rounds:
        inst.running = reqs(running)
        for r in inst.running:
            r.decoding = True
        plan = BatchPlan()
        for r in reqs(queue):
            admit = sched.may_admit(inst, r, NOW, plan)
            out.append(sched.governor.last)
            if not admit:
                break
            inst.running.append(r)
            plan.prefills.append((r, r.target))
    return out, sched.governor


@pytest.mark.parametrize("slo_s", [None, 0.008, 0.018, 0.021, 0.030])
def test_server_and_simulator_governors_decide_the_same(slo_s):
    server, server_gov = _server_governor_decisions(slo_s, GOVERNOR_STEPS, GOVERNOR_ROUNDS)
    sim, sim_gov = _sim_governor_decisions(slo_s, GOVERNOR_STEPS, GOVERNOR_ROUNDS)
    # both counted the same prefill stalls per decoded token, and they are in the predictions
    assert server_gov.prefill.per_token() == pytest.approx(sim_gov.prefill.per_token(), rel=1e-12)
    assert server_gov.prefill.per_token() > 0 and server_gov.prefill.stalls == sim_gov.prefill.stalls == 4
    assert len(server) == len(sim) > 0
    for a, b in zip(server, sim):
        assert (a.admit, a.reason, a.running, a.slo_s) == (b.admit, b.reason, b.running, b.slo_s)
        assert (a.predicted_s is None) == (b.predicted_s is None)
        if a.predicted_s is not None:
            assert a.predicted_s == pytest.approx(b.predicted_s, rel=1e-9)


# five decode steps of one request alone first: the measured default SLO's samples (12 ms a step)
SOLO_STEPS = [([(100, 1)], 0.012, 0)] * 5


@pytest.mark.parametrize("scale", [2.0, 3.0])
def test_server_and_simulator_governors_hold_the_same_measured_default(scale):
    """No SLO given, a default scale (the server's ``--memx-tpot-slo-scale``, the simulator's
    ``default_slo_scale`` option): both derive scale x 12 ms from the solo steps and decide alike."""
    steps = SOLO_STEPS + GOVERNOR_STEPS
    server, server_gov = _server_governor_decisions(None, steps, GOVERNOR_ROUNDS, scale)
    sim, sim_gov = _sim_governor_decisions(None, steps, GOVERNOR_ROUNDS, scale)
    assert server_gov.tpot_slo_s == sim_gov.tpot_slo_s == pytest.approx(scale * 0.012)
    assert server_gov.slo_origin == sim_gov.slo_origin == "default"
    assert len(server) == len(sim) > 0 and "over_slo" in {d.reason for d in server}
    for a, b in zip(server, sim):
        assert (a.admit, a.reason, a.running, a.slo_s) == (b.admit, b.reason, b.running, b.slo_s)
        assert a.predicted_s == pytest.approx(b.predicted_s, rel=1e-9)


def test_a_bad_default_slo_scale_option_is_named():
    from benchmark.sim.core.batching import OptionError
    from benchmark.sim.mechanisms.governor import GovernedScheduler

    for bad in (1, -1, "2", float("nan")):
        with pytest.raises(OptionError) as err:
            GovernedScheduler(types.SimpleNamespace(name="m", tpot_slo_s=None), default_slo_scale=bad)
        assert err.value.option == "default_slo_scale"


def test_the_governor_cases_exercise_every_reason():
    seen = set()
    for slo_s in (None, 0.008, 0.018, 0.021, 0.030):  # 8 ms: even one request alone is over
        seen |= {d.reason for d in _sim_governor_decisions(slo_s, GOVERNOR_STEPS, GOVERNOR_ROUNDS)[0]}
        seen |= {d.reason for d in _sim_governor_decisions(slo_s, GOVERNOR_STEPS[:3], GOVERNOR_ROUNDS)[0]}
    assert seen == {"no_slo", "empty_batch", "learning", "within_slo", "over_slo", "slo_infeasible"}


# ------------------------------------------------------------------ governed admission ("do no harm")
# (free tokens, upstream's decode reservation, running as (prompt, generated, max_new), queue as (prompt, max_new))
NO_HARM_CASES = [
    (1000, 0, [(100, 10, 50)] * 3, [(100, 50), (200, 100), (300, 100)]),  # the mechanism admits, no harm
    (1000, 900, [(100, 10, 50)] * 4, [(100, 50), (200, 100)]),  # it defers on its reservation: no gain, stock
    (300, 0, [(10, 0, 200)] * 2, [(50, 100), (50, 200)]),  # the running requests' growth alone would not fit
    (500, 0, [(10, 0, 100)] * 2, [(50, 100), (100, 150), (10, 5)]),  # the second would preempt one later
]


class _Verdicts:
    """The governor's side of ``admission.add_one``: the verdicts it passed, in order."""

    def __init__(self):
        self.seen = []

    def note_verdict(self, verdict):
        self.seen.append(verdict)

    def park_tpot(self, running_reqs, req):
        return None  # no TPOT SLO here: parking is judged without it, as in the simulator


def _server_governed(available, reserve, running, queue):
    """The server path: memx's admission hook with the governor, over upstream's real prefill budget;
    returns, per request offered, (the harm's shortfall it predicted, the mechanism's verdict, the
    governed verdict)."""
    from memory_ext.policy import no_harm

    allocator, tree, host = fake_admission_pool(available, 0, ROW_BYTES)
    device.attach(allocator, types.SimpleNamespace(activation=None, weights=None))
    budget = up_sched.new_physical_budget(allocator, tree, 0)
    budget.total_offset = reserve
    batch = FakeBatch([FakeReq(prompt=p, outputs=g, max_new=m) for p, g, m in running])
    adder = types.SimpleNamespace(token_to_kv_pool_allocator=allocator, tree_cache=tree, memory_budget=budget,
                                  can_run_list=[], running_batch=batch, page_size=1, rem_chunk_tokens=None,
                                  rem_input_tokens=1 << 20, new_chunked_req=None,
                                  new_token_ratio=1.0)  # fmt: skip  # the simulator's lengths are exact

    def original(adder, req, has_chunked_req, truncation_align_size):
        adder.can_run_list.append(req)
        budget.reserve(len(req.origin_input_ids), req.sampling_params.max_new_tokens)
        return up_sched.add_result("CONTINUE")

    asked, governor = [], _Verdicts()

    def govern(ask, running_reqs, page, now_pages, batch_admits=True, park=None):
        assert park is None  # the governor here has no TPOT SLO
        out = no_harm.govern_prefill(ask, running_reqs, page, now_pages, batch_admits)
        room = max(ask.budget - ask.act, 0)
        asked.append((no_harm.peak_shortfall(room // page, running_reqs, page, now_pages), out[0]))
        return out

    activation = device.of(allocator).activation_side()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(admission, "govern_prefill", govern)
        for p, m in queue:
            result = admission.add_one(original, adder, FakeReq(prompt=p, max_new=m), False, None, activation, None,
                                       None, governor=governor)  # fmt: skip
            if result != up_sched.add_result("CONTINUE"):
                break
    return [(short, mech, gv) for (short, mech), gv in zip(asked, governor.seen)]


def _sim_shortfalls(available, running, queue, verdicts):
    """The simulator path (``governed_ellm``'s inputs on a real instance, one block per token): the
    harm's shortfall for each request the server was asked about, admitting those it admitted."""
    from benchmark.sim.core.engine import Instance, InstanceConfig
    from benchmark.sim.core.hardware import gpu_spec
    from benchmark.sim.core.models import model_spec
    from benchmark.sim.core.request import RUNNING, WAITING, Request
    from benchmark.sim.mechanisms.governed_ellm import candidate_growth, running_growth
    from memory_ext.policy.no_harm import peak_shortfall

    held = sum(p + g for p, g, _ in running)
    cfg = InstanceConfig(name="m", model=model_spec("Llama-3.1-8B"), gpu=0, kv_blocks=available + held, block_size=1,
                         prefix_caching=False)  # fmt: skip
    inst = Instance(0, cfg, gpu_spec("H100-SXM"), scheduler=None)
    for i, (p, g, m) in enumerate(running):
        r = Request(i, 0, 0.0, p, m)
        r.state, r.generated, r.ctx, r.decoding, r.private_blocks = RUNNING, g, p + g, True, p + g
        assert inst.kv.allocate(p + g)
        inst.running.append(r)
    out = []
    for j, ((p, m), (_, _, gv)) in enumerate(zip(queue, verdicts)):
        r = Request(100 + j, 0, 0.0, p, m)
        r.state = WAITING
        inst.waiting.append(r)
        reqs, pending = running_growth(inst)  # before it joins, as the scheduler takes them
        inst.waiting.popleft()
        inst.admit(r, 0.0)
        cand, need = candidate_growth(inst, r)
        out.append(peak_shortfall(inst.kv.available, [*reqs, cand], 1, pending + need))
        if gv.action == DEFER:
            break
        assert inst.reserve(r, r.target - r.ctx)
    return out


@pytest.mark.parametrize("available,reserve,running,queue", NO_HARM_CASES)
def test_server_and_simulator_govern_admission_the_same(available, reserve, running, queue):
    """Same state, same question: both paths predict the same harm for each request offered, and the
    one governed verdict (``no_harm.judge_with_governor``) follows from it and the mechanism's verdict."""
    from memory_ext.policy.no_harm import judge_with_governor

    server = _server_governed(available, reserve, running, queue)
    sim = _sim_shortfalls(available, running, queue, server)
    assert len(server) == len(sim) > 0
    for (short, mech, gv), sim_short in zip(server, sim):
        assert short == sim_short
        assert gv == judge_with_governor(mech.action, sim_short > 0)


def test_the_governed_cases_exercise_every_admission_reason():
    seen = set()
    for available, reserve, running, queue in NO_HARM_CASES:
        seen |= {gv.reason for _, _, gv in _server_governed(available, reserve, running, queue)}
    assert seen == {"mechanism_admits", "no_predicted_gain", "protects_running"}
