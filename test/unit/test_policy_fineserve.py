"""FineServe policy (F1-F4): sizes, slab arithmetic, placement, EDF batching
(``memory_ext.policy.kv_format`` / ``slab_table`` / ``placement``; the simulator-only parts in
``benchmark.sim.core.fineserve_policy``).

All numbers below are worked by hand in the comments.
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmark/ (the simulator-only parts)

from benchmark.sim.core.fineserve_policy import ChunkedPrefillModel, Request, adaptive_batch, slab_bytes  # noqa: E402
from memory_ext.policy.kv_format import (  # noqa: E402
    BF16,
    FP8,
    FP16,
    INT4,
    KVLayout,
    KVPrecision,
    kv_block_bytes,
    precision_by_name,
    token_kv_bytes,
    token_qparam_bytes,
)
from memory_ext.policy.placement import (  # noqa: E402
    GpuCandidate,
    ModelDemand,
    PlacementInfeasible,
    place_models,
    placement_score,
)
from memory_ext.policy.slab_table import blocks_per_slab, engine_block_id, split_engine_block_id  # noqa: E402

# Llama-3-8B: 32 layers, 32 query heads but 8 KV heads (GQA), head_dim 128.
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)
MiB = 1 << 20


# ------------------------------------------------------------------ F2


def test_llama3_8b_token_sizes_fp16_fp8_int4():
    fp16 = KVLayout(**LLAMA3_8B, precision=FP16)
    fp8 = KVLayout(**LLAMA3_8B, precision=FP8)
    int4 = KVLayout(**LLAMA3_8B, precision=INT4)
    # 8 heads x 128 x 2 (K,V) x bytes
    assert token_kv_bytes(fp16) == 8 * 128 * 2 * 2 == 4096  # per layer
    assert token_kv_bytes(fp16, per_layer=False) == 4096 * 32 == 128 * 1024
    assert token_kv_bytes(fp8) == 2048
    assert token_kv_bytes(fp8, per_layer=False) == 64 * 1024
    assert token_kv_bytes(int4) == 1024
    # quantisation parameters: FP16 and FP8 none per token (per-tensor FP8
    # scale), INT4 fp16 scale + fp16 zero per head per K/V: 8 x 2 x 4 = 64
    assert token_qparam_bytes(fp16) == token_qparam_bytes(fp8) == 0
    assert token_qparam_bytes(int4) == 64
    assert token_qparam_bytes(int4, per_layer=False) == 64 * 32
    # KVblocksize = tokens x TokenSize + Quant.Params (16-token block)
    assert kv_block_bytes(fp16, 16) == 65536
    assert kv_block_bytes(fp8, 16) == 32768
    assert kv_block_bytes(int4, 16) == 16 * (1024 + 64) == 17408
    assert kv_block_bytes(fp16, 16, per_layer=False) == 65536 * 32
    assert BF16.bytes_per_elem == 2 and precision_by_name("INT4") is INT4


def test_fp8_with_per_token_scale_is_expressible():
    fp8_tok = KVPrecision("fp8_tok", 1, scale_bytes=4)
    layout = KVLayout(**LLAMA3_8B, precision=fp8_tok)
    assert token_qparam_bytes(layout) == 8 * 2 * 4 == 64
    assert kv_block_bytes(layout, 16) == 16 * (2048 + 64)


def test_tp_splits_heads_and_replicates_beyond_kv_heads():
    assert token_kv_bytes(KVLayout(**LLAMA3_8B, tp=2)) == 2048
    # TP 16 > 8 KV heads: each rank holds one (replicated) head
    assert token_kv_bytes(KVLayout(**LLAMA3_8B, tp=16)) == 1 * 128 * 2 * 2
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVLayout(**LLAMA3_8B, tp=3)


# ------------------------------------------------------------------ F1


def test_slab_is_smallest_lcm_multiple_above_minimum():
    assert slab_bytes([6, 4]) == 12
    assert slab_bytes([6, 4], 13) == 24
    assert slab_bytes([6, 4], 24) == 24
    # FP16 + FP8 Llama-3-8B 16-token blocks: lcm 65536, min 2 MiB -> 2 MiB
    s = slab_bytes([65536, 32768], 2 * MiB)
    assert s == 2 * MiB
    assert blocks_per_slab(s, 65536) == 32 and blocks_per_slab(s, 32768) == 64
    # FP16 + INT4: 65536 = 2^16, 17408 = 2^10*17 -> lcm 2^16*17 = 1114112;
    # 2 MiB needs two of them
    s = slab_bytes([65536, 17408], 2 * MiB)
    assert s == 2 * 1114112
    assert blocks_per_slab(s, 65536) == 34 and blocks_per_slab(s, 17408) == 128
    with pytest.raises(ValueError, match="block_size"):
        blocks_per_slab(100, 7)


def test_engine_block_id_round_trip():
    # Fig. 8 style: slab 1, local block 2, 4 blocks per slab -> engine id 6
    assert engine_block_id(1, 2, 4) == 6
    assert split_engine_block_id(6, 4) == (1, 2)
    for bps in (1, 3, 32, 128):
        for bid in range(5 * bps):
            assert engine_block_id(*split_engine_block_id(bid, bps), bps) == bid
    with pytest.raises(ValueError, match="local_id"):
        engine_block_id(0, 4, 4)


# ------------------------------------------------------------------ F3


def test_placement_worked_example():
    # Two 80 GB GPUs. Order by F_M: A(40) B(30) C(20) D(10).
    #  A: g0 1.0*(80-40)=40, g1 40      -> tie, first candidate g0
    #  B: g0 mean(1,2)=1.5*(80-70)=15, g1 2*(80-30)=100          -> g1
    #  C: g0 mean(1,3)=2*(80-60)=40, g1 mean(2,3)=2.5*(80-50)=75 -> g1
    #  D: g0 mean(1,1)=1*(80-50)=30, g1 mean(2,3,1)=2*(80-60)=40 -> g1
    models = [
        ModelDemand("D", 10, 1.0),
        ModelDemand("B", 30, 2.0),
        ModelDemand("A", 40, 1.0),
        ModelDemand("C", 20, 3.0),
    ]
    gpus = [GpuCandidate("g0", 80), GpuCandidate("g1", 80)]
    res = place_models(models, gpus)
    assert res.order == ("A", "B", "C", "D")
    assert res.assignment == {"A": "g0", "B": "g1", "C": "g1", "D": "g1"}
    assert res.residents == {"g0": ("A",), "g1": ("B", "C", "D")}
    assert res.k_rem == {"g0": 40, "g1": 20}
    assert [c.score for c in res.scores["B"]] == [15, 100]
    assert [c.score for c in res.scores["C"]] == [40, 75]
    assert [c.score for c in res.scores["D"]] == [30, 40]
    assert res.feasible and res.raise_if_infeasible() is res


def test_eq3_charges_the_new_model():
    # Eq. 3 uses K_rem(G'): 100 - (30 + 50) = 20, mean mu (1+3)/2 = 2 -> 40
    assert placement_score(100, [30], [1.0], 50, 3.0) == (True, 20, 2.0, 40)
    ok, k_rem, _, score = placement_score(100, [60], [1.0], 50, 3.0)
    assert not ok and k_rem == -10 and score == -math.inf
    assert placement_score(100, [50], [1.0], 50, 1.0)[0]  # exactly full is feasible


def test_placement_reports_infeasible_models_and_continues():
    models = [ModelDemand("huge", 90, 5.0), ModelDemand("a", 50, 1.0), ModelDemand("b", 40, 1.0)]
    res = place_models(models, [GpuCandidate("g0", 80), GpuCandidate("g1", 80)])
    assert res.unplaced == ("huge",) and not res.feasible
    assert all(not c.feasible for c in res.scores["huge"])
    assert res.assignment == {"a": "g0", "b": "g1"}
    with pytest.raises(PlacementInfeasible, match="huge"):
        res.raise_if_infeasible()


def test_mu_fn_sees_the_candidate_group():
    seen = []

    def mu_fn(name, group):
        seen.append((name, group))
        return 1.0

    place_models([ModelDemand("a", 20, 9.0), ModelDemand("b", 10, 9.0)], [GpuCandidate("g0", 80)], mu_fn=mu_fn)
    assert ("a", ("a",)) in seen and ("a", ("a", "b")) in seen and ("b", ("a", "b")) in seen


# ------------------------------------------------------------------ F4

# TTFT(R) = ceil(tokens/100) * 1 s: easy to check by hand
PRED = ChunkedPrefillModel(chunk_tokens=100, per_chunk_s=1.0, per_token_s=0.0)


def test_predictor_linear_per_chunk():
    p = ChunkedPrefillModel(chunk_tokens=256, per_chunk_s=0.002, per_token_s=1e-5, per_request_s=0.001)
    reqs = [Request("x", 0, 300), Request("y", 0, 300)]
    # 600 tokens -> 3 chunks
    assert p.ttft(reqs) == pytest.approx(3 * 0.002 + 600e-5 + 2 * 0.001)
    assert p.ttft([]) == 0.0


def test_drop_requests_that_cannot_make_it_alone():
    reqs = [
        Request("late", -9.5, 50),  # d=0.5, alone 1 s -> drop
        Request("edge", -9.0, 50),  # d=1.0, 0+1 < 1 false (strict) -> drop
        Request("ok", -5.0, 50),
    ]  # d=5
    dec = adaptive_batch(reqs, now=0.0, slo=10.0, n_max=8, t_max=10_000, predictor=PRED)
    assert [r.rid for r in dec.dropped] == ["late", "edge"]
    assert [r.rid for r in dec.batch] == ["ok"]
    assert dec.remaining == () and dec.predicted_finish == 1.0


QUEUE = [Request("c", 2.0, 300), Request("a", 0.0, 100), Request("d", 3.0, 200), Request("b", 1.0, 500)]


def test_remove_longest_until_anchor_deadline_met():
    # deadlines a=10 b=11 c=12 d=13; all 1100 tokens -> 11 s >= 10: remove b
    # (500) -> 600 tokens -> 6 s < 10
    dec = adaptive_batch(QUEUE, now=0.0, slo=10.0, n_max=8, t_max=10_000, predictor=PRED)
    assert [r.rid for r in dec.batch] == ["a", "c", "d"]  # EDF order
    assert [r.rid for r in dec.removed_longest] == ["b"]
    assert [r.rid for r in dec.remaining] == ["b"]  # b stays waiting
    assert dec.dropped == () and dec.predicted_finish == 6.0
    assert dec.deadlines == {"a": 10.0, "b": 11.0, "c": 12.0, "d": 13.0}


def test_anchor_itself_can_be_the_longest():
    reqs = [Request("big", 0.0, 900), Request("small", 0.5, 100)]
    # 1000 tokens -> 10 s, not < 10 -> remove big; small alone 1 s < 10.5
    dec = adaptive_batch(reqs, now=0.0, slo=10.0, n_max=8, t_max=10_000, predictor=PRED)
    assert [r.rid for r in dec.batch] == ["small"]
    assert [r.rid for r in dec.removed_longest] == ["big"]


def test_trim_to_n_max_and_t_max_keeps_edf_prefix():
    dec = adaptive_batch(QUEUE, now=0.0, slo=10.0, n_max=2, t_max=10_000, predictor=PRED)
    assert [r.rid for r in dec.batch] == ["a", "c"]
    assert [r.rid for r in dec.trimmed] == ["d"]
    assert sorted(r.rid for r in dec.remaining) == ["b", "d"]
    # t_max 350: a (100) fits, c would make 400 -> stop; d (200) would fit
    # but may not jump ahead of c (prefix reading)
    dec = adaptive_batch(QUEUE, now=0.0, slo=10.0, n_max=8, t_max=350, predictor=PRED)
    assert [r.rid for r in dec.batch] == ["a"]
    assert [r.rid for r in dec.trimmed] == ["c", "d"]


def test_empty_queue():
    dec = adaptive_batch([], now=5.0, slo=1.0, n_max=1, t_max=1, predictor=PRED)
    assert dec.batch == () and dec.predicted_finish == 5.0


# ------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: KVLayout(num_layers=32, num_kv_heads=8, head_dim=0), "head_dim"),
        (lambda: KVLayout(num_layers=0, num_kv_heads=8, head_dim=128), "num_layers"),
        (lambda: KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, tp=True), "tp"),
        (lambda: KVPrecision("x", 0), "bytes_per_elem"),
        (lambda: KVPrecision("x", 1, scale_bytes=-1), "scale_bytes"),
        (lambda: precision_by_name("fp7"), "precision"),
        (lambda: kv_block_bytes(KVLayout(**LLAMA3_8B), 0), "tokens_per_block"),
        (lambda: slab_bytes([]), "block_sizes"),
        (lambda: slab_bytes([64, 0]), r"block_sizes\[1\]"),
        (lambda: slab_bytes([64], -1), "min_slab_bytes"),
        (lambda: split_engine_block_id(-1, 4), "block_id"),
        (lambda: engine_block_id(0, 0, 0), "blocks_per_slab"),
        (lambda: ModelDemand("m", -1, 1.0), "base_footprint"),
        (lambda: ModelDemand("m", 1, float("nan")), "mu"),
        (lambda: GpuCandidate("g", 0), "total_memory"),
        (lambda: place_models([], []), "gpus"),
        (lambda: place_models([ModelDemand("m", 1, 1), ModelDemand("m", 2, 1)], [GpuCandidate("g", 8)]), "models"),
        (lambda: Request("r", 0.0, 0), "prompt_tokens"),
        (lambda: Request("", 0.0, 1), "rid"),
        (lambda: ChunkedPrefillModel(0, 1.0, 0.0), "chunk_tokens"),
        (lambda: ChunkedPrefillModel(10, -1.0, 0.0), "per_chunk_s"),
        (lambda: adaptive_batch([], 0.0, 0.0, 1, 1, PRED), "slo"),
        (lambda: adaptive_batch([], 0.0, 1.0, 0, 1, PRED), "n_max"),
        (lambda: adaptive_batch([], 0.0, 1.0, 1, 0, PRED), "t_max"),
        (lambda: adaptive_batch([], float("inf"), 1.0, 1, 1, PRED), "now"),
        (lambda: adaptive_batch([Request("r", 0, 1)] * 2, 0.0, 1.0, 1, 1, PRED), "rid"),
    ],
)
def test_bad_inputs_raise_value_error_naming_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


# ------------------------------------------------ F1: slab table (paper §5.2)

from benchmark.sim.core.fineserve_policy import (  # noqa: E402
    base_footprint,
    model_demand,
    place_with_pins,
    smallest_batch_for_rate,
    static_partition,
)
from memory_ext.policy.slab_table import SlabTable  # noqa: E402


def test_slab_table_formats_slabs_per_key_and_numbers_blocks_like_the_paper():
    # 4 slabs of 4 MiB; key "fp16" blocks of 2 MiB (2 per slab), key "fp8" of 1 MiB (4 per slab)
    t = SlabTable(4, 4 * MiB)
    a = t.alloc("fp16", 2 * MiB, 3)
    assert a == [0, 1, 2]  # slab 0 local 0,1 then slab 1 local 0: id = slab x 2 + local
    assert [split_engine_block_id(b, 2) for b in a] == [(0, 0), (0, 1), (1, 0)]
    assert (t.state(0), t.state(1), t.state(2)) == (t.FULL, t.PARTIAL, t.FREE)
    b = t.alloc("fp8", 1 * MiB, 5)
    assert b == [8, 9, 10, 11, 12]  # slabs 2 and 3 (id = slab x 4 + local)
    assert t.free_slabs == 0 and t.alloc("fp8", MiB, 4) is None  # all or nothing: 3 fp8 blocks are free
    assert t.used_blocks("fp8") == 5 and t.stranded_blocks("fp8") == 3 and t.stranded_blocks("fp16") == 1
    # a block of the fp16 key can never land in an fp8 slab
    assert t.alloc("fp16", 2 * MiB, 2) is None and t.alloc("fp16", 2 * MiB, 1) == [3]
    t.check()


def test_slab_goes_back_to_free_only_when_empty_and_then_serves_any_key():
    t = SlabTable(2, 4 * MiB)
    a = t.alloc("x", MiB, 5)  # slab 0 full, slab 1 holds one block
    assert t.free(("x"), a[:4]) == 1 and t.state(0) == t.FREE  # slab 0 emptied -> FREE
    assert t.free("x", a[4:], keep_empty=True) == 0 and t.state(1) == t.PARTIAL  # kept formatted
    assert t.held_slabs("x") == 1 and t.release_empty("x") == 1 and t.free_slabs == 2
    # no external fragmentation: freed slabs take another block size
    assert len(t.alloc("y", 2 * MiB, 4)) == 4 and t.free_slabs == 0
    t.check()


def test_partially_used_slab_strands_its_free_blocks():
    t = SlabTable(3, 4 * MiB)
    ids = t.alloc("x", MiB, 12)  # three full slabs
    t.free("x", [ids[0], ids[4], ids[8]])  # one block freed in each: no slab empties
    assert t.held_slabs("x") == 3 and t.free_slabs == 0 and t.stranded_blocks("x") == 3
    assert t.alloc("y", MiB, 1) is None  # 3 MiB free in all, none usable by another key
    assert t.alloc("x", MiB, 2) == [0, 4]  # reused by its own key, lowest slab first
    t.check()


def test_slab_table_pin_and_bad_inputs():
    t = SlabTable(3, 4 * MiB)
    assert t.pin("x", MiB, 2) == 2 and t.held_slabs("x") == 2
    ids = t.alloc("x", MiB, 1)
    t.free("x", ids)
    assert t.held_slabs("x") == 2 and t.release_empty("x") == 0  # pinned slabs stay
    with pytest.raises(ValueError, match="block size"):
        t.alloc("x", 2 * MiB, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        t.alloc("z", 3 * MiB, 1)
    with pytest.raises(ValueError, match="not allocated"):
        t.free("x", [5])
    with pytest.raises(ValueError, match="pin"):
        t.pin("y", MiB, 5)
    t.check()


# ---------------------------------- F3: sizes -> demands, pins, Static* split


def test_model_demand_from_sizes():
    assert base_footprint(1000, 10, 50, 7) == 1000 + 7 + 500
    d = model_demand("m", 1000, 10, 50, 7)
    assert d == ModelDemand("m", 1507, 0.1)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        model_demand("m", 1, 0)


def test_smallest_batch_for_rate():
    thr = lambda b: 2.0 * b  # noqa: E731
    assert smallest_batch_for_rate(7.0, thr, 100) == (4, True)  # 2x3 = 6 < 7 <= 8
    assert smallest_batch_for_rate(8.0, thr, 100) == (4, True)
    assert smallest_batch_for_rate(500.0, thr, 100) == (100, False)
    assert smallest_batch_for_rate(0.0, thr, 100) == (1, True)


def test_place_with_pins_is_place_models_without_pins_and_charges_pins_first():
    ms = [ModelDemand("a", 6, 1.0), ModelDemand("b", 3, 2.0), ModelDemand("c", 2, 1.0)]
    gs = [GpuCandidate("g0", 10), GpuCandidate("g1", 10)]
    free = place_with_pins(ms, gs)
    assert free.alg1 == place_models(ms, gs) and free.assignment == place_models(ms, gs).assignment
    p = place_with_pins(ms, gs, {"a": "g1"})
    assert p.assignment["a"] == "g1" and p.left == {"g0": 10, "g1": 4}
    assert p.alg1 == place_models(ms[1:], [GpuCandidate("g0", 10), GpuCandidate("g1", 4)])
    over = place_with_pins(ms, gs, {"a": "g1", "b": "g1", "c": "g1"})
    assert over.overflow == (("c", "g1", 1),) and not over.feasible
    full = place_with_pins([ModelDemand("a", 10, 1), ModelDemand("b", 1, 1)], [GpuCandidate("g", 10)], {"a": "g"})
    assert full.candidates == () and full.alg1.unplaced == ("b",)
    with pytest.raises(ValueError, match="unknown device"):
        place_with_pins(ms, gs, {"a": "g9"})


def test_static_partition_is_proportional_to_footprint():
    # 72 GB, F = 19.5 / 35 GB: shares 25.76 / 46.24 GB; weights come out of each share
    s = static_partition(72.0, {"a": 19.5, "d": 35.0})
    assert s["a"] == pytest.approx(72 * 19.5 / 54.5) and s["d"] == pytest.approx(72 * 35 / 54.5)
    assert sum(s.values()) == pytest.approx(72.0)
    with pytest.raises(ValueError, match="footprints"):
        static_partition(1.0, {})


def test_place_models_spread_puts_replicas_of_one_model_on_different_devices():
    gpus = [GpuCandidate("g0", 100), GpuCandidate("g1", 40)]
    reps = [ModelDemand("m", 10, 1.0), ModelDemand("m#1", 10, 1.0)]
    # Eq. 3 alone co-locates them on the roomier device (score 80 on g0 vs 30 on g1).
    assert place_models(reps, gpus).assignment == {"m": "g0", "m#1": "g0"}
    spread = {"m": "m", "m#1": "m"}
    res = place_models(reps, gpus, spread=spread)
    assert res.assignment == {"m": "g0", "m#1": "g1"}
    # an instance outside the group may still join a replica's device by score
    other = place_models([*reps, ModelDemand("x", 5, 1.0)], gpus, spread=spread)
    assert other.assignment["x"] == "g0"
    # when the only device apart cannot hold the replica, it co-locates instead of failing
    tight = place_models(reps, [GpuCandidate("g0", 100), GpuCandidate("g1", 5)], spread=spread)
    assert tight.assignment == {"m": "g0", "m#1": "g0"} and not tight.unplaced
    # one device: all replicas there
    one = place_models([*reps, ModelDemand("m#2", 10, 1.0)], [GpuCandidate("g0", 100)], spread={**spread, "m#2": "m"})
    assert set(one.assignment.values()) == {"g0"} and not one.unplaced
