"""memory_ext.policy.ellm: Alg. 1 ballooning admission and Alg. 2 buffer scaling (E4).

Numbers below are hand-worked from the algorithms; each comment shows the arithmetic.
"""

import math
import random

import pytest

from memory_ext.policy.ellm import (
    DECODE,
    PREFILL,
    DecodeRequest,
    ElasticAdmissionPolicy,
    LogicalBufferScaler,
    PrefillRequest,
)


def per512(tokens):  # one activation chunk per 512 batch tokens
    return math.ceil(tokens / 512)


def per2(tokens):
    return math.ceil(tokens / 2)


# ---------------------------------------------------------------- Alg. 1: prefill


def test_prefill_inflation_then_break():
    # P_kv=4, P_act=10, θ=1 -> budget 13 (R1: P_T = P_kv + P_act).
    # A: act(1024)=2, 0+3+2=5 <= 13 -> GPU.        M_kv=3
    # B: act(1536)=3, 3+4+3=10 <= 13 -> GPU.       M_kv=7
    # C: act(3584)=7, 7+8+7=22 > 13; offload 7+7=14 > 13 -> break (R3), D never looked at.
    # M_act=act(1536)=3; P_kv 4 < 7 and P_act 10 > 3 -> I = 7-4 = 3 (inflation).
    pol = ElasticAdmissionPolicy(per512, threshold_chunks=1)
    q = [
        PrefillRequest("A", 1024, 3),
        PrefillRequest("B", 512, 4),
        PrefillRequest("C", 2048, 8),
        PrefillRequest("D", 1, 0),
    ]
    d = pol.decide(4, 10, prefills=q, cpu_buffer_free_chunks=100)
    assert d.phase == PREFILL
    assert d.admitted == ("A", "B") and d.deferred == ("C", "D") and d.offloaded == ()
    assert (d.kv_chunks, d.act_chunks, d.tokens) == (7, 3, 1536)
    assert d.inflation == 3 and d.inflate_chunks == 3 and d.deflate_chunks == 0
    assert (d.kv_free_after, d.act_idle_after, d.cpu_buffer_free_after) == (0, 4, 100)


def test_prefill_offload_to_cpu_buffer():
    # Same pool; C now 1024 tokens / 8 KV chunks, CPU buffer 8.
    # C: act(2560)=5, 7+8+5=20 > 13; 7+5=12 <= 13 and 8 <= 8 -> admitted, KV offloaded. P_B=0.
    # D: act(3072)=6, 7+1+6=14 > 13; 7+6=13 <= 13 but 1 > P_B=0 -> break.
    # M_kv=7, M_act=5, I=3; act idle after = 10-3-5 = 2.
    pol = ElasticAdmissionPolicy(per512, threshold_chunks=1)
    q = [
        PrefillRequest("A", 1024, 3),
        PrefillRequest("B", 512, 4),
        PrefillRequest("C", 1024, 8),
        PrefillRequest("D", 512, 1),
    ]
    d = pol.decide(4, 10, prefills=q, cpu_buffer_free_chunks=8)
    assert d.admitted == ("A", "B", "C") and d.offloaded == ("C",) and d.deferred == ("D",)
    assert (d.kv_chunks, d.act_chunks, d.offload_chunks) == (7, 5, 8)
    assert d.inflation == 3
    assert (d.kv_free_after, d.act_idle_after, d.cpu_buffer_free_after) == (0, 2, 0)


def test_no_inflation_when_kv_pool_suffices():
    # P_kv=10, P_act=4: one prefill KV 6, act(512)=1 -> 7 <= 14, KV fits its own pool -> I=0.
    d = ElasticAdmissionPolicy(per512).decide(10, 4, prefills=[PrefillRequest("A", 512, 6)])
    assert d.admitted == ("A",) and d.inflation == 0
    assert (d.kv_free_after, d.act_idle_after) == (4, 3)


def test_all_or_nothing_kv_and_activation_together():
    # P_kv=5, P_act=3, θ=0. KV 6 alone fits (by inflating 1) and act 3 alone fits idle act,
    # but together 6+3=9 > 8: the request is not admitted at all (no hold-and-wait).
    pol = ElasticAdmissionPolicy(lambda t: 3)
    d = pol.decide(5, 3, prefills=[PrefillRequest("A", 10, 6)])
    assert d.admitted == () and d.deferred == ("A",)
    assert d.kv_chunks == 0 and d.act_chunks == 0 and d.inflation == 0
    # Exactly fitting together (5+3=8) is admitted with no ballooning.
    d = pol.decide(5, 3, prefills=[PrefillRequest("A", 10, 5)])
    assert d.admitted == ("A",) and d.inflation == 0 and (d.kv_free_after, d.act_idle_after) == (0, 0)


def test_threshold_is_kept_free():
    # budget = 5+3-2 = 6: KV 3 + act 3 = 6 fits; KV 4 + act 3 = 7 does not.
    pol = ElasticAdmissionPolicy(lambda t: 3, threshold_chunks=2)
    assert pol.decide(5, 3, prefills=[PrefillRequest("A", 1, 3)]).admitted == ("A",)
    assert pol.decide(5, 3, prefills=[PrefillRequest("A", 1, 4)]).admitted == ()


def test_activation_is_per_batch_not_per_request_sum():
    # R2: four 128-token prefills need act(512)=1 chunk together, not 4.
    q = [PrefillRequest(f"r{i}", 128, 1) for i in range(4)]
    d = ElasticAdmissionPolicy(per512).decide(4, 1, prefills=q)
    assert d.admitted == ("r0", "r1", "r2", "r3") and d.act_chunks == 1 and d.kv_chunks == 4


# ---------------------------------------------------------------- Alg. 1: decode


def test_decode_fetch_and_lazy_deflation():
    # P_kv=10, P_act=1, θ=0 -> budget 11; act(t)=ceil(t/2), 1 token per decode.
    # d1: act(1)=1, 0+1+1=2 -> M_kv=1
    # d2: act(2)=1, 1+(1+3)+1=6 -> M_kv=5, fetch 3 chunks back from CPU
    # d3: act(3)=2, 5+1+2=8 -> M_kv=6
    # d4: act(4)=2, 6+5+2=13 > 11 -> break
    # M_act=2 > P_act=1 and P_kv=10 > 6 -> I = 1-2 = -1 (deflate one chunk).
    q = [
        DecodeRequest("d1", 1),
        DecodeRequest("d2", 1, offloaded_chunks=3),
        DecodeRequest("d3", 1),
        DecodeRequest("d4", 5),
    ]
    d = ElasticAdmissionPolicy(per2).decide(10, 1, decodes=q)
    assert d.phase == DECODE
    assert d.admitted == ("d1", "d2", "d3") and d.deferred == ("d4",)
    assert d.fetched == ("d2",) and d.fetch_chunks == 3 and d.offloaded == ()
    assert (d.kv_chunks, d.act_chunks) == (6, 2)
    assert d.inflation == -1 and d.deflate_chunks == 1 and d.inflate_chunks == 0
    assert (d.kv_free_after, d.act_idle_after) == (3, 0)


def test_deflation_is_lazy():
    # R6: KV has 10 free (perhaps borrowed earlier) but activation has enough idle: nothing returned.
    d = ElasticAdmissionPolicy(per2).decide(10, 5, decodes=[DecodeRequest("d1", 1), DecodeRequest("d2", 1)])
    assert d.act_chunks == 1 and d.inflation == 0


def test_decode_inflation():
    # P_kv=1, P_act=6: three decodes with 1 KV chunk each, act(3)=2 -> 3+2=5 <= 7; I = 3-1 = 2.
    q = [DecodeRequest(f"d{i}", 1) for i in range(3)]
    d = ElasticAdmissionPolicy(per2).decide(1, 6, decodes=q)
    assert d.admitted == ("d0", "d1", "d2") and d.inflation == 2
    assert (d.kv_free_after, d.act_idle_after) == (0, 2)


def test_decode_never_offloads():
    # Decode KV that does not fit is not sent to the CPU buffer: break.
    d = ElasticAdmissionPolicy(per2).decide(1, 1, decodes=[DecodeRequest("d", 5)], cpu_buffer_free_chunks=100)
    assert d.admitted == () and d.offloaded == () and d.cpu_buffer_free_after == 100


# ---------------------------------------------------------------- Alg. 1: phase choice (R4)


def test_phase_prefill_first_then_fallback_to_decode():
    pol = ElasticAdmissionPolicy(per2)
    p_fit = [PrefillRequest("p", 2, 1)]
    p_nofit = [PrefillRequest("big", 2, 50)]
    dec = [DecodeRequest("d", 1)]
    assert pol.decide(4, 4, prefills=p_fit, decodes=dec).phase == PREFILL
    d = pol.decide(4, 4, prefills=p_nofit, decodes=dec)
    assert d.phase == DECODE and d.admitted == ("d",)
    # Explicit phase is honoured, no fallback.
    d = pol.decide(4, 4, prefills=p_nofit, decodes=dec, phase=PREFILL)
    assert d.phase == PREFILL and d.admitted == () and d.deferred == ("big",)
    assert pol.decide(4, 4, prefills=p_fit, decodes=dec, phase=DECODE).admitted == ("d",)
    # Nothing at all: empty decode decision, no ballooning.
    d = pol.decide(4, 4)
    assert d.admitted == () and d.inflation == 0 and d.act_chunks == 0


# ---------------------------------------------------------------- Alg. 1: invariants over random inputs


def _fits(pol, m_kv, tokens, r, budget, p_b_left):
    act = pol._act(tokens + r.tokens)
    if isinstance(r, PrefillRequest):
        return m_kv + r.kv_chunks + act <= budget or (m_kv + act <= budget and r.kv_chunks <= p_b_left)
    return m_kv + r.gpu_kv_chunks + act <= budget


def test_random_invariants():
    rng = random.Random(1234)
    for case in range(3000):
        per = rng.randint(1, 600)
        base = rng.randint(0, 2)
        pol = ElasticAdmissionPolicy(
            lambda t, per=per, base=base: base + math.ceil(t / per), threshold_chunks=rng.randint(0, 3)
        )
        p_kv, p_act, p_b = rng.randint(0, 30), rng.randint(0, 30), rng.randint(0, 20)
        prefills = [PrefillRequest(f"p{i}", rng.randint(1, 2000), rng.randint(0, 12)) for i in range(rng.randint(0, 6))]
        decodes = [
            DecodeRequest(f"d{i}", rng.randint(0, 3), rng.choice([0, 0, rng.randint(1, 6)]))
            for i in range(rng.randint(0, 8))
        ]
        d = pol.decide(p_kv, p_act, prefills, decodes, p_b)
        budget = p_kv + p_act - pol.threshold_chunks
        if d.admitted:
            # KV + activation of the whole batch fit together under the threshold.
            assert d.kv_chunks + d.act_chunks <= budget, case
        # Inflation never exceeds the idle activation chunks (minus the batch's own need).
        assert 0 <= d.inflate_chunks <= p_act - d.act_chunks or d.inflate_chunks == 0
        assert d.inflate_chunks <= p_act
        assert d.deflate_chunks <= p_kv - d.kv_chunks or d.deflate_chunks == 0
        assert d.kv_free_after >= 0 and d.act_idle_after >= 0
        assert d.kv_free_after + d.act_idle_after == p_kv + p_act - d.kv_chunks - d.act_chunks
        assert 0 <= d.offload_chunks <= p_b and d.cpu_buffer_free_after == p_b - d.offload_chunks
        # Decision is an FCFS prefix; the first deferred request really did not fit.
        queue = prefills if d.phase == PREFILL else decodes
        assert [r.rid for r in queue] == list(d.admitted + d.deferred)
        if d.deferred:
            nxt = queue[len(d.admitted)]
            assert not _fits(pol, d.kv_chunks, d.tokens, nxt, budget, p_b - d.offload_chunks), case


# ---------------------------------------------------------------- Alg. 2


def test_two_misses_no_change_three_of_five_change():
    s = LogicalBufferScaler(max_chunks=64, initial_chunks=8)
    for missed in (True, False, True, False):  # 2 misses in window
        r = s.update(ttft_missed=missed)
        assert r.logical_chunks == 8 and not r.changed and r.event is None
    r = s.update(ttft_missed=True)  # 3 of last 5 -> grow ×2
    assert r.event == "ttft" and r.changed and (r.previous_chunks, r.logical_chunks) == (8, 16)


def test_old_misses_age_out():
    s = LogicalBufferScaler(max_chunks=64, initial_chunks=8)
    for missed in (True, True, False, False, False):
        assert not s.update(tpot_missed=missed).changed
    # T,T,F,F,F then T: last 5 = T,F,F,F,T -> the first miss aged out, 2 misses, no change.
    r = s.update(tpot_missed=True)
    assert s.window_misses() == (0, 2) and not r.changed
    # then T: last 5 = F,F,F,T,T -> still 2 misses.
    r = s.update(tpot_missed=True)
    assert r.tpot_violation is False and s.window_misses() == (0, 2)
    r = s.update(tpot_missed=True)  # last 5 = F,F,T,T,T -> 3 misses -> shrink 8 -> 4
    assert r.event == "tpot" and r.logical_chunks == 4


def test_window_cleared_after_event():
    # R8: after an event, 3 fresh misses are needed.
    s = LogicalBufferScaler(max_chunks=64, initial_chunks=8)
    for _ in range(3):
        r = s.update(ttft_missed=True)
    assert r.logical_chunks == 16 and s.window_misses() == (0, 0)
    assert not s.update(ttft_missed=True).changed
    assert not s.update(ttft_missed=True).changed
    assert s.update(ttft_missed=True).logical_chunks == 32


def test_tpot_takes_priority_and_both_windows_clear():
    s = LogicalBufferScaler(max_chunks=64, initial_chunks=8)
    for _ in range(3):
        r = s.update(ttft_missed=True, tpot_missed=True)
    assert r.tpot_violation and r.ttft_violation and r.event == "tpot" and r.logical_chunks == 4
    # The suppressed TTFT event does not fire next iteration (its window was consumed).
    assert not s.update(ttft_missed=True).changed and s.logical_chunks == 4


def test_alpha_scaling_and_bounds():
    # Paper default: initialized to 1, α=2: 1 -> 2 -> 4 -> 8 (cap 6 here -> 6) ; shrink 6 -> 3 -> 1 -> 1.
    s = LogicalBufferScaler(max_chunks=6)
    assert s.logical_chunks == 1 and s.alpha == 2
    grown = []
    for _ in range(4):
        for _ in range(3):
            r = s.update(ttft_missed=True)
        grown.append(r.logical_chunks)
    assert grown == [2, 4, 6, 6]
    assert r.event == "ttft" and not r.changed  # event at the bound: no change
    shrunk = []
    for _ in range(3):
        for _ in range(3):
            r = s.update(tpot_missed=True)
        shrunk.append(r.logical_chunks)
    assert shrunk == [3, 1, 1]  # floor(6/2)=3, floor(3/2)=1, max(0,1)=1
    # Non-integer α: growth ceils, shrink floors (R7): 3*1.5=4.5 -> 5; 5/1.5=3.33 -> 3.
    s = LogicalBufferScaler(max_chunks=100, min_chunks=2, alpha=1.5, initial_chunks=3)
    for _ in range(3):
        r = s.update(ttft_missed=True)
    assert r.logical_chunks == 5
    for _ in range(3):
        r = s.update(tpot_missed=True)
    assert r.logical_chunks == 3
    for _ in range(3):
        r = s.update(tpot_missed=True)
    assert r.logical_chunks == 2  # floor(3/1.5)=2 = min


def test_observe_latencies():
    s = LogicalBufferScaler(max_chunks=64, initial_chunks=4, ttft_slo=1.0, tpot_slo=0.05)
    assert not s.observe(ttft=1.0).changed  # equal to the SLO is not a miss ("exceeds")
    assert not s.observe(ttft=1.5).changed
    assert not s.observe(tpot=0.01).changed  # no TTFT sample -> non-miss for TTFT
    assert not s.observe(ttft=2.0).changed
    assert s.window_misses() == (2, 0)
    assert s.observe(ttft=3.0, tpot=0.01).logical_chunks == 8  # last 5: F,T,F,T,T


def test_per_sample_windows_ignore_iterations_without_a_sample():
    # Same samples as above, with empty iterations between them: per iteration the TTFT window
    # (maxlen 5) never holds 3 misses; per sample it holds T,T,T after the third slow first token.
    per_iter = LogicalBufferScaler(max_chunks=64, initial_chunks=4, ttft_slo=1.0, tpot_slo=0.05)
    per_sample = LogicalBufferScaler(max_chunks=64, initial_chunks=4, ttft_slo=1.0, tpot_slo=0.05, per_sample=True)
    for s in (per_iter, per_sample):
        for _ in range(3):
            s.observe(ttft=2.0)
            for _ in range(4):
                s.observe(tpot=0.01)
    assert per_iter.logical_chunks == 4 and per_iter.window_misses() == (1, 0)  # T,F,F,F,F
    assert per_sample.logical_chunks == 8  # 4 * alpha
    assert per_sample.window_misses() == (0, 0)  # cleared by the event; TPOT samples were all fast
    with pytest.raises(ValueError, match="per_sample"):
        LogicalBufferScaler(max_chunks=4, per_sample=1)


def test_available_buffer_never_evicts():
    s = LogicalBufferScaler(max_chunks=64, initial_chunks=8)
    assert s.available(3) == 5
    assert s.available(10) == 0  # shrunk below what it holds: no room, nothing evicted


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda p: p.decide(-1, 0), "free_kv_chunks"),
        (lambda p: p.decide(0, "3"), "idle_act_chunks"),
        (lambda p: p.decide(0, True), "idle_act_chunks"),
        (lambda p: p.decide(0, 0, cpu_buffer_free_chunks=-2), "cpu_buffer_free_chunks"),
        (lambda p: p.decide(0, 0, phase="mixed"), "phase"),
        (lambda p: p.decide(0, 0, prefills=[DecodeRequest("d")]), "prefills"),
        (lambda p: p.decide(0, 0, decodes=[PrefillRequest("p", 1, 1)]), "decodes"),
        (lambda p: p.decide(0, 0, [PrefillRequest("x", 1, 1)], [DecodeRequest("x")]), "rid"),
    ],
)
def test_admission_bad_inputs(call, field):
    with pytest.raises(ValueError, match=field):
        call(ElasticAdmissionPolicy(per2))


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: PrefillRequest("p", 0, 1), "tokens"),
        (lambda: PrefillRequest("p", 1, -1), "kv_chunks"),
        (lambda: PrefillRequest("", 1, 1), "rid"),
        (lambda: DecodeRequest("d", offloaded_chunks=-1), "offloaded_chunks"),
        (lambda: DecodeRequest("d", kv_chunks=1.5), "kv_chunks"),
        (lambda: ElasticAdmissionPolicy(per2, threshold_chunks=-1), "threshold_chunks"),
        (lambda: ElasticAdmissionPolicy(None), "act_chunks_for_tokens"),
        (
            lambda: ElasticAdmissionPolicy(lambda t: -1).decide(5, 5, [PrefillRequest("p", 1, 1)]),
            "act_chunks_for_tokens",
        ),
        (lambda: LogicalBufferScaler(max_chunks=0), "max_chunks"),
        (lambda: LogicalBufferScaler(max_chunks=4, min_chunks=0), "min_chunks"),
        (lambda: LogicalBufferScaler(max_chunks=4, min_chunks=5), "max_chunks"),
        (lambda: LogicalBufferScaler(max_chunks=4, alpha=1), "alpha"),
        (lambda: LogicalBufferScaler(max_chunks=4, alpha=float("inf")), "alpha"),
        (lambda: LogicalBufferScaler(max_chunks=4, window=0), "window"),
        (lambda: LogicalBufferScaler(max_chunks=4, misses_to_violate=6), "misses_to_violate"),
        (lambda: LogicalBufferScaler(max_chunks=4, initial_chunks=5), "initial_chunks"),
        (lambda: LogicalBufferScaler(max_chunks=4, ttft_slo=0), "ttft_slo"),
        (lambda: LogicalBufferScaler(max_chunks=4).update(ttft_missed=1), "ttft_missed"),
        (lambda: LogicalBufferScaler(max_chunks=4).update(tpot_missed=None), "tpot_missed"),
        (lambda: LogicalBufferScaler(max_chunks=4).observe(ttft=1.0), "ttft_slo"),
        (lambda: LogicalBufferScaler(max_chunks=4, tpot_slo=1.0).observe(tpot=-1.0), "tpot"),
        (lambda: LogicalBufferScaler(max_chunks=4).available(-1), "used_chunks"),
    ],
)
def test_construction_bad_inputs(make, field):
    with pytest.raises(ValueError, match=field):
        make()
