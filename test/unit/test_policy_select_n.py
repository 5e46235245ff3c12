"""memory_ext.policy.select_n: Select-N interval model, performance record, link coordinator."""

import itertools

import pytest

from memory_ext.policy import select_n as sn
from memory_ext.policy.select_n import (
    GpuDemand,
    LayerTiming,
    LinkCoordinator,
    Phase,
    Rejection,
    SloKind,
)

L = 32
T_TR = 1e-3  # per-layer host->GPU copy, seconds

# Table 1 of the paper. Rows: batch; columns: sequence length.
TABLE1_BATCH = (4, 8, 16, 32, 64)
TABLE1_SEQ = (128, 256, 512, 1024)
TABLE1 = [
    [5, 4, 3, 2],
    [4, 3, 2, 1],
    [3, 2, 1, 1],
    [2, 1, 1, 1],
    [1, 1, 1, 1],
]
TABLE1_DELTA = 0.5
# "Measured" per-layer compute time, a function of batch*seq tokens only,
# sub-linear at small sizes (GPU under-utilised) and linear beyond.
_TC_BY_TOKENS = {512: 0.17e-3, 1024: 0.25e-3, 2048: 0.45e-3, 4096: 1.0e-3}


def table1_timing(batch, seq):
    tokens = batch * seq
    tc = _TC_BY_TOKENS.get(tokens, 2.1e-3 * tokens / 8192)
    return LayerTiming(compute_s=tc, transfer_s=T_TR)


def table1_record():
    return sn.analyze(
        L, table1_timing, [TABLE1_DELTA], TABLE1_BATCH, TABLE1_SEQ, phase=Phase.PREFILL, slo_kind=SloKind.SLOWDOWN
    )


# ----------------------------------------------------------------------------- S1 model


def test_latency_model_figure7_interval4():
    # Fig. 7: L=8, interval 4 -> layers 4 and 8 offloaded; each copy overlaps 3 layers.
    assert sn.offloaded_layers(8, 4) == 2
    t = LayerTiming(compute_s=1.0, transfer_s=5.0)
    # 8 layers of compute + 2 groups * (5 - 3) stall
    assert sn.iteration_latency(8, 4, t) == pytest.approx(8 + 2 * 2)
    # transfer fully hidden when it fits in the 3 preceding layers
    assert sn.iteration_latency(8, 4, LayerTiming(1.0, 3.0)) == pytest.approx(8.0)
    # interval 1: every layer offloaded, no overlap (single staging buffer reading)
    assert sn.iteration_latency(8, 1, t) == pytest.approx(8 + 8 * 5)
    # interval > L offloads nothing; trailing layers (L % i) are resident
    assert sn.offloaded_layers(8, 9) == 0
    assert sn.iteration_latency(8, 9, t) == pytest.approx(8.0)
    assert sn.offloaded_layers(10, 4) == 2


def test_latency_monotone_in_interval_transfer_and_compute():
    for tc, ttr in itertools.product([0.1, 0.5, 1.0, 3.0], [0.0, 0.5, 2.0, 7.0]):
        t = LayerTiming(tc, ttr)
        lats = [sn.iteration_latency(L, i, t) for i in range(1, L + 2)]
        assert all(a >= b - 1e-12 for a, b in zip(lats, lats[1:]))
        for i in range(1, L + 2):
            assert sn.iteration_latency(L, i, LayerTiming(tc, ttr * 1.5)) >= lats[i - 1]
            assert sn.iteration_latency(L, i, LayerTiming(tc * 1.5, ttr)) >= lats[i - 1]


def test_optimal_interval_is_smallest_meeting_slo():
    t = LayerTiming(1e-3, 4e-3)
    slo = 40e-3
    i = sn.optimal_interval(L, t, slo)
    assert sn.meets_slo(L, i, t, slo)
    assert i == 1 or not sn.meets_slo(L, i - 1, t, slo)
    # only "no offload" meets an SLO equal to the pure compute time
    assert sn.optimal_interval(L, LayerTiming(1e-3, 1.0), L * 1e-3) == L + 1
    # below pure compute time nothing meets it
    assert sn.optimal_interval(L, t, L * 1e-3 * 0.99) is None


# ----------------------------------------------------------------------------- S2 record


def test_table1_record_matches_paper():
    rec = table1_record()
    assert rec.grid(TABLE1_DELTA) == TABLE1


def test_table1_lookups_exact_cells():
    rec = table1_record()
    for (bi, b), (si, s) in itertools.product(enumerate(TABLE1_BATCH), enumerate(TABLE1_SEQ)):
        assert rec.lookup(TABLE1_DELTA, b, s) == TABLE1[bi][si]


def test_table1_lookups_conservative_between_cells():
    rec = table1_record()
    # SLOWDOWN reading: more compute only helps hide copies, so batch/seq round DOWN
    assert rec.lookup(TABLE1_DELTA, 6, 200) == 5  # -> (4, 128)
    assert rec.lookup(TABLE1_DELTA, 8, 300) == 3  # -> (8, 256)
    assert rec.lookup(TABLE1_DELTA, 20, 1000) == 1  # -> (16, 512)
    # larger than the grid: the paper omits these because the interval is one
    assert rec.lookup(TABLE1_DELTA, 128, 4096) == 1
    # smaller than the grid: no conservative cell -> None (reject)
    assert rec.lookup(TABLE1_DELTA, 2, 128) is None
    # SLO rounds down: a looser request uses the recorded (tighter) delta
    assert rec.lookup(0.9, 4, 128) == 5
    # tighter than every recorded SLO: no cell
    assert rec.lookup(0.1, 4, 128) is None
    # every lookup meets the request's true SLO in the model
    for b, s in [(6, 200), (8, 300), (20, 1000), (40, 700)]:
        i = rec.lookup(TABLE1_DELTA, b, s)
        assert sn.meets_slo(L, i, table1_timing(b, s), TABLE1_DELTA, SloKind.SLOWDOWN)


def _abs_timing(batch, seq):
    return LayerTiming(compute_s=1e-5 * (batch * seq) ** 0.5, transfer_s=T_TR)


def _abs_record(phase=Phase.DECODE, timing=_abs_timing, slos=(0.02, 0.03, 0.05, 0.1)):
    return sn.analyze(
        L, timing, slos, (1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048), phase=phase, slo_kind=SloKind.ABSOLUTE
    )


def test_absolute_lookup_rounds_batch_seq_up_and_slo_down():
    rec = _abs_record()
    assert rec.conservative_key(0.04, 3, 300) == (0.03, 4, 512)
    assert rec.lookup(0.04, 3, 300) == rec.cell(0.03, 4, 512)
    assert rec.lookup(0.04, 64, 128) is None  # above the batch grid
    assert rec.lookup(0.01, 4, 128) is None  # tighter than every SLO
    assert rec.conservative_key(0.05, 1, 1) == (0.05, 1, 128)  # below grid rounds up
    # conservative: the chosen interval meets the request's own SLO in the model
    for slo, b, s in itertools.product([0.025, 0.04, 0.07, 0.2], [1, 3, 5, 9, 17, 31], [100, 129, 300, 700, 1500]):
        i = rec.lookup(slo, b, s)
        if i is not None:
            assert sn.meets_slo(L, i, _abs_timing(b, s), slo, SloKind.ABSOLUTE)


@pytest.mark.parametrize("kind", [SloKind.ABSOLUTE, SloKind.SLOWDOWN])
def test_tighter_slo_gives_larger_or_equal_interval(kind):
    slos = (0.02, 0.03, 0.05, 0.1) if kind is SloKind.ABSOLUTE else (0.05, 0.1, 0.25, 0.5, 1.0)
    rec = sn.analyze(L, _abs_timing, slos, (1, 4, 16), (128, 512, 2048), slo_kind=kind)
    inf = L + 2  # None (infeasible) is "worse than any interval"
    for b, s in itertools.product(rec.batch_sizes, rec.seq_lens):
        vals = [rec.cell(x, b, s) for x in rec.slos]  # loosest last
        vals = [inf if v is None else v for v in vals]
        assert all(a >= c for a, c in zip(vals, vals[1:])), (b, s, vals)


@pytest.mark.parametrize("kind,slo", [(SloKind.ABSOLUTE, 0.04), (SloKind.SLOWDOWN, 0.3)])
def test_more_bandwidth_never_worse(kind, slo):
    for b, s in itertools.product([1, 4, 16], [128, 1024]):
        tc = _abs_timing(b, s).compute_s
        prev = L + 2
        for ttr in [8e-3, 4e-3, 2e-3, 1e-3, 5e-4, 1e-4, 0.0]:  # faster link -> shorter copy
            i = sn.optimal_interval(L, LayerTiming(tc, ttr), slo, kind)
            cur = L + 2 if i is None else i
            assert cur <= prev
            prev = cur


def test_separate_prefill_and_decode_records():
    def prefill(b, s):  # whole prompt per layer: compute-heavy
        return LayerTiming(compute_s=2e-6 * b * s, transfer_s=T_TR)

    def decode(b, s):  # one token per sequence: little compute to hide copies
        return LayerTiming(compute_s=5e-6 * b + 1e-5, transfer_s=T_TR)

    recs = sn.analyze_phases(L, prefill, decode, [0.25], (1, 4, 16), (256, 1024), slo_kind=SloKind.SLOWDOWN)
    assert recs.prefill.phase is Phase.PREFILL and recs.decode.phase is Phase.DECODE
    for b, s in itertools.product((1, 4, 16), (256, 1024)):
        p = recs.lookup(Phase.PREFILL, 0.25, b, s)
        d = recs.lookup("decode", 0.25, b, s)
        assert p <= d  # paper: prefill takes a shorter interval than decode
    assert recs.lookup(Phase.PREFILL, 0.25, 16, 1024) < recs.lookup(Phase.DECODE, 0.25, 16, 1024)
    with pytest.raises(ValueError, match="prefill"):
        sn.PhaseRecords(recs.decode, recs.decode)


# ----------------------------------------------------------------------------- S3 coordinator

GB = 1 << 30


def _gpu(name, min_i, max_i=None, layers=L, layer_bytes=GB // 4, iter_time=0.05):
    return GpuDemand(name, layers, layer_bytes, iter_time, min_i, max_i)


def test_coordinator_alone_gets_min_interval():
    d = LinkCoordinator(64 * GB).decide(_gpu("g0", 3))
    assert d.accepted and d.intervals == {"g0": 3}
    assert d.host_bytes == (L // 3) * (GB // 4)


def test_coordinator_joint_choice_maximises_host_bytes_under_bandwidth():
    a, b = _gpu("a", 2), _gpu("b", 4, iter_time=0.1)
    bw = 80 * GB
    d = LinkCoordinator(bw).decide(a, [b])
    assert d.accepted
    assert d.total_rate <= bw
    # brute-force optimum over every valid interval pair
    best = max(
        (a.offloaded_bytes(i) + b.offloaded_bytes(j))
        for i in range(2, L + 2)
        for j in range(4, L + 2)
        if a.transfer_rate(i) + b.transfer_rate(j) <= bw
    )
    assert d.host_bytes == best
    assert d.intervals["a"] >= 2 and d.intervals["b"] >= 4
    # both at their minimum would exceed the link, so someone backed off
    assert a.transfer_rate(2) + b.transfer_rate(4) > bw
    assert (d.intervals["a"], d.intervals["b"]) != (2, 4)


def test_coordinator_never_exceeds_link_bandwidth():
    for bw_gb, mins in itertools.product([1, 10, 40, 100, 200], [(1, 1), (1, 5), (3, 2), (8, 8)]):
        bw = bw_gb * GB
        gpus = [_gpu(f"g{k}", m, iter_time=0.02 * (k + 1)) for k, m in enumerate(mins)]
        d = LinkCoordinator(bw).decide(gpus[0], gpus[1:])
        assert d.accepted
        rate = sum(g.transfer_rate(d.intervals[g.name]) for g in gpus)
        assert rate == pytest.approx(d.total_rate)
        assert rate <= bw * (1 + 1e-9)
        for g in gpus:
            assert d.intervals[g.name] >= g.min_interval


def test_coordinator_more_bandwidth_never_less_host_memory():
    prev = -1
    for bw_gb in [1, 5, 20, 50, 100, 400]:
        d = LinkCoordinator(bw_gb * GB).decide(_gpu("a", 1), [_gpu("b", 2), _gpu("c", 4)])
        assert d.accepted and d.host_bytes >= prev
        prev = d.host_bytes


def test_coordinator_rejects_unattainable_slo():
    d = LinkCoordinator(64 * GB).decide(_gpu("a", None))
    assert not d.accepted and d.rejection is Rejection.SLO_UNATTAINABLE
    assert d.intervals == {} and "a" in d.reason


def test_coordinator_rejects_when_min_exceeds_gpu_capacity():
    # Fig. 8 lines 34-35: the SLO needs interval 6 but memory forces <= 4
    d = LinkCoordinator(64 * GB).decide(_gpu("a", 6, max_i=4))
    assert not d.accepted and d.rejection is Rejection.EXCEEDS_GPU_CAPACITY
    assert "6" in d.reason and "4" in d.reason


def test_coordinator_rejects_when_link_cannot_carry_forced_offload():
    # both models exceed their GPU, so both must offload; the link is too slow
    a = _gpu("a", 1, max_i=2)
    b = _gpu("b", 1, max_i=2)
    need = a.transfer_rate(2) + b.transfer_rate(2)
    d = LinkCoordinator(need * 0.9).decide(a, [b])
    assert not d.accepted and d.rejection is Rejection.LINK_BANDWIDTH
    ok = LinkCoordinator(need).decide(a, [b])
    assert ok.accepted and ok.intervals == {"a": 2, "b": 2}


def test_max_interval_for_capacity():
    lb = 100
    assert sn.max_interval_for_capacity(L, lb, L * lb) is None  # fits: unbounded
    # 24 layers fit: need >= 8 offloaded + 1 staging -> L - L//i + 1 <= 24 -> L//i >= 9 -> i <= 3
    assert sn.max_interval_for_capacity(L, lb, 24 * lb) == 3
    assert sn.max_interval_for_capacity(L, lb, 0) == 0  # nothing fits


def test_record_to_coordinator_end_to_end():
    rec = table1_record()
    lo = rec.lookup(TABLE1_DELTA, 4, 128)
    hi = rec.lookup(TABLE1_DELTA, 64, 1024)
    d = LinkCoordinator(1000 * GB).decide(_gpu("p", hi), [_gpu("q", lo)])
    assert d.accepted and d.intervals == {"p": 1, "q": 5}


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: LayerTiming(0, 1), "compute_s"),
        (lambda: LayerTiming(1, -1), "transfer_s"),
        (lambda: LayerTiming(float("nan"), 1), "compute_s"),
        (lambda: sn.iteration_latency(0, 1, LayerTiming(1, 1)), "num_layers"),
        (lambda: sn.iteration_latency(4, 0, LayerTiming(1, 1)), "interval"),
        (lambda: sn.meets_slo(4, 1, LayerTiming(1, 1), 0), "slo"),
        (lambda: sn.analyze(L, table1_timing, [0.5], (3, 4), (128,)), "batch_sizes"),
        (lambda: sn.analyze(L, table1_timing, [0.5], (4,), (100,)), "seq_lens"),
        (lambda: sn.analyze(L, table1_timing, [], (4,), (128,)), "slos"),
        (lambda: sn.analyze(L, table1_timing, [-1], (4,), (128,)), "slos"),
        (lambda: sn.analyze(L, table1_timing, [0.5], (), (128,)), "batch_sizes"),
        (lambda: sn.analyze(L, lambda b, s: 1.0, [0.5], (4,), (128,)), "timing_fn"),
        (lambda: table1_record().lookup(0.5, 0, 128), "batch"),
        (lambda: table1_record().lookup(0.5, 4, -1), "seq"),
        (lambda: table1_record().lookup(-0.5, 4, 128), "slo"),
        (lambda: LinkCoordinator(0), "bandwidth_bytes_per_s"),
        (lambda: GpuDemand("", L, 1, 1.0, 1), "name"),
        (lambda: GpuDemand("a", L, 0, 1.0, 1), "layer_bytes"),
        (lambda: GpuDemand("a", L, 1, 0.0, 1), "iter_time_s"),
        (lambda: GpuDemand("a", L, 1, 1.0, 0), "min_interval"),
        (lambda: GpuDemand("a", L, 1, 1.0, 1, -1), "max_interval"),
        (lambda: LinkCoordinator(1.0).decide(_gpu("a", 1), [_gpu("a", 1)]), "name"),
        (lambda: sn.max_interval_for_capacity(L, 0, 10), "layer_bytes"),
    ],
)
def test_bad_inputs_raise_value_error_naming_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_policy_module_is_engine_agnostic():
    import ast
    from pathlib import Path

    files = sorted(Path(sn.__file__).parent.glob("*.py"))
    assert len(files) > 1, "select_n is a package of several modules"
    mods = set()
    for node in (n for f in files for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mods.add((node.module or "").split(".")[0])
    assert not mods & {"torch", "sglang", "numpy", "memory_ext"}
