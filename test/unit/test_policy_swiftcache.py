"""memory_ext.policy.swiftcache: LSC/RC sizing (W2), minimum elastic unit (W3), Alg. 1 (W4)."""

import ast
from pathlib import Path

import pytest

from memory_ext.policy import swiftcache as sc
from memory_ext.policy.swiftcache import (
    ElasticWorkerPolicy,
    KVGeometry,
    RequestWindow,
    ScaleAction,
    block_elems,
    block_major_shape,
    blocks_for_tokens,
    layer_block_bytes,
    master_single_layer_blocks,
    min_elastic_unit,
    plan_lsc,
    plan_lsc_from_blocks,
    scale_down,
    scale_up,
    worker_full_layer_blocks,
)

# Table 2 shapes (float16), block size 16.
LWM = KVGeometry(num_layers=32, block_size=16, num_kv_heads=32, head_dim=128)
QWEN3_8B = KVGeometry(num_layers=36, block_size=16, num_kv_heads=8, head_dim=128)
QWEN3_14B = KVGeometry(num_layers=40, block_size=16, num_kv_heads=8, head_dim=128)


# ----------------------------------------------------------------- purity


def test_module_imports_only_stdlib():
    files = sorted(Path(sc.__file__).parent.glob("*.py"))
    assert len(files) > 1, "swiftcache is a package of several modules"
    roots = set()
    for node in (n for f in files for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add((node.module or "").split(".")[0])
    # Relative imports stay inside memory_ext.policy (shared input checks).
    assert roots <= {"__future__", "enum", "math", "collections", "dataclasses", "typing"}


# ----------------------------------------------------------------- W2


def test_worked_example_section_3_2():
    # L = 10, K_master = 100, K_1 = 9, K_2 = 8 (paper's numbers exactly).
    plan = plan_lsc_from_blocks(100, [9, 8], 10)
    assert plan.n_lsc == 17
    assert plan.k_master - plan.n_lsc == 83
    assert plan.n_rc == 8
    assert plan.max_context_blocks == 25
    assert plan.baseline_context_blocks == 10
    assert plan.unused_single_layer_blocks == 3
    assert plan.max_context_tokens is None


def test_lsc_takes_all_master_memory_when_workers_exceed_it():
    # R1: sum K_i >= K_master -> N_LSC = K_master, N_RC = 0 (not a negative floor).
    plan = plan_lsc_from_blocks(100, [60, 70], 10, block_size=16)
    assert (plan.n_lsc, plan.n_rc) == (100, 0)
    assert plan.max_context_tokens == 100 * 16
    assert plan_lsc_from_blocks(100, [100], 10).n_rc == 0
    # No workers: everything is regular cache.
    assert (plan_lsc_from_blocks(100, [], 10).n_lsc, plan_lsc_from_blocks(100, [], 10).n_rc) == (0, 10)


def test_eq1_to_eq5_from_bytes_reproduce_example():
    g = KVGeometry(num_layers=10, block_size=16, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    m = layer_block_bytes(g)
    assert m == 2 * 16 * 8 * 128 * 2 == 65536
    assert master_single_layer_blocks(100 * m + m - 1, m) == 100
    assert worker_full_layer_blocks(9 * 10 * m + 12345, m, 10) == 9
    assert worker_full_layer_blocks(8 * 10 * m, m, 10) == 8
    plan = plan_lsc(g, 100 * m + m - 1, [9 * 10 * m + 12345, 8 * 10 * m])
    assert (plan.k_workers, plan.n_lsc, plan.n_rc) == ((9, 8), 17, 8)
    assert plan.max_context_tokens == 25 * 16
    assert plan.lsc_bytes == 17 * m
    assert plan.rc_bytes == 8 * 10 * m
    assert plan.lsc_bytes + plan.rc_bytes <= 100 * m


def test_eq1_precision():
    fp8 = KVGeometry(10, 16, 8, 128, dtype_bytes=1)
    int4 = KVGeometry(10, 16, 8, 128, dtype_bytes=0.5)
    assert layer_block_bytes(fp8) == 32768
    assert layer_block_bytes(int4) == 16384
    # R2: fractional bytes per block are rejected.
    with pytest.raises(ValueError, match="Eq. 1"):
        layer_block_bytes(KVGeometry(1, 1, 1, 1, dtype_bytes=0.25))


# ----------------------------------------------------------------- W3


def test_block_major_shape():
    assert block_major_shape(QWEN3_8B, 7) == (7, 36, 16 * 8 * 128)
    assert block_elems(QWEN3_8B) == 36 * 16 * 8 * 128


@pytest.mark.parametrize(
    "master,worker,meu_m,meu_i",
    [
        (LWM, QWEN3_8B, 9, 32),  # 2^21 vs 2^16*9: different head counts and layers
        (QWEN3_14B, QWEN3_8B, 9, 10),  # 2^17*5 vs 2^16*9
        (QWEN3_8B, QWEN3_8B, 1, 1),
        (
            KVGeometry(24, 32, 4, 64),  # different head dim and block size
            KVGeometry(28, 16, 2, 96),
            7,
            16,
        ),
    ],
)
def test_meu_examples(master, worker, meu_m, meu_i):
    u = min_elastic_unit(master, worker)
    assert (u.meu_master, u.meu_worker) == (meu_m, meu_i)
    # Eq. 8-9 literally (same dtype): MEU = LCM_elem / BE.
    assert u.lcm_elems % u.master_block_elems == 0 and u.lcm_elems % u.worker_block_elems == 0
    assert u.lcm_elems // u.master_block_elems == meu_m
    assert u.lcm_elems // u.worker_block_elems == meu_i
    # Both sides of one unit cover the same bytes; unit is minimal.
    assert u.meu_bytes == meu_m * u.master_block_bytes == meu_i * u.worker_block_bytes
    assert u.meu_bytes == 2 * 2 * u.lcm_elems
    for k in range(1, meu_m):
        assert (k * u.master_block_bytes) % u.worker_block_bytes != 0
    assert u.master_blocks(3) == 3 * meu_m and u.worker_blocks(3) == 3 * meu_i
    assert u.bytes_for(2) == 2 * u.meu_bytes


def test_meu_lwm_qwen_bytes():
    u = min_elastic_unit(LWM, QWEN3_8B)
    assert u.master_block_elems == 2**21
    assert u.worker_block_elems == 9 * 2**16
    assert u.meu_bytes == 4 * 9 * 2**21 == 75_497_472


def test_meu_mixed_dtype_aligns_bytes():
    # R3: Eq. 9 in elements would say (1, 1); byte alignment needs 2 FP8 blocks per FP16 block.
    fp16 = KVGeometry(32, 16, 8, 128, dtype_bytes=2)
    fp8 = KVGeometry(32, 16, 8, 128, dtype_bytes=1)
    u = min_elastic_unit(fp16, fp8)
    assert u.lcm_elems // u.master_block_elems == 1
    assert (u.meu_master, u.meu_worker) == (1, 2)
    assert u.meu_bytes == u.master_block_bytes == 2 * u.worker_block_bytes


# ----------------------------------------------------------------- W4: SCALEUP


def test_scale_up_none_when_allocation_suffices():
    d = scale_up(10, 16, 4, 3, 160)  # need = 10
    assert d.action is ScaleAction.NONE and d.units == 0 and not d.changed
    assert (d.worker_blocks, d.master_blocks, d.worker_blocks_after) == (0, 0, 10)


def test_scale_up_demand_spike_whole_meus():
    # need = ceil(1000/16) = 63; diff = 53; k = ceil(53/4) = 14.
    d = scale_up(10, 16, 4, 3, 1000)
    assert d.action is ScaleAction.SCALE_UP
    assert d.needed_blocks == 63
    assert (d.units, d.worker_blocks, d.master_blocks) == (14, 56, 42)
    assert d.worker_blocks % 4 == 0 and d.master_blocks % 3 == 0
    assert d.worker_blocks_after == 66 >= 63
    assert d.shortfall_blocks == 0 and d.donated_blocks_after is None


def test_scale_up_one_token_over_takes_one_meu():
    d = scale_up(10, 16, 4, 3, 161)  # need 11
    assert (d.units, d.worker_blocks, d.master_blocks) == (1, 4, 3)


def test_scale_up_capped_by_donation():
    # R4: only 2 whole MEUs (9 blocks, MEU_i=4) lent; reclaim 8, report shortfall.
    d = scale_up(10, 16, 4, 3, 1000, donated_blocks=9)
    assert d.action is ScaleAction.SCALE_UP
    assert (d.units, d.worker_blocks, d.master_blocks) == (2, 8, 6)
    assert d.donated_blocks_after == 1
    assert d.shortfall_blocks == 63 - 18
    d0 = scale_up(10, 16, 4, 3, 1000, donated_blocks=3)
    assert d0.action is ScaleAction.NONE and d0.units == 0 and d0.shortfall_blocks == 53
    assert d0.donated_blocks_after == 3


# ----------------------------------------------------------------- W4: SCALEDOWN


def test_scale_down_idle_window_releases_all_whole_meus():
    # R5: empty window -> max_need 0; 66 blocks, MEU_i=4 -> 16 MEUs, 2 blocks stay.
    d = scale_down(66, 16, 4, 3, [])
    assert d.action is ScaleAction.SCALE_DOWN
    assert (d.units, d.worker_blocks, d.master_blocks) == (16, 64, 48)
    assert d.worker_blocks_after == 2 >= 0


def test_scale_down_keeps_window_max():
    # max_len 300 -> max_need 19; diff 47 -> k = 11.
    d = scale_down(66, 16, 4, 3, [100, 300, 17], donated_blocks=5)
    assert d.needed_blocks == 19
    assert (d.units, d.worker_blocks, d.master_blocks) == (11, 44, 33)
    assert d.worker_blocks_after == 22 >= 19
    assert d.donated_blocks_after == 49


def test_scale_down_none_when_window_needs_everything():
    d = scale_down(10, 16, 4, 3, [160])
    assert d.action is ScaleAction.NONE and d.units == 0
    d = scale_down(10, 16, 4, 3, [5000])
    assert d.action is ScaleAction.NONE and d.worker_blocks_after == 10
    d = scale_down(10, 16, 4, 3, [130])  # need 9, surplus 1 < MEU
    assert d.action is ScaleAction.NONE and d.units == 0


def test_scale_down_respects_min_blocks():
    d = scale_down(40, 16, 4, 3, [], min_blocks=10)
    assert d.worker_blocks_after >= 10 and d.units == 7


def test_scale_down_zero_allocation():
    d = scale_down(0, 16, 4, 3, [])
    assert d.action is ScaleAction.NONE and d.worker_blocks_after == 0


# ----------------------------------------------------------------- window + stateful policy


def test_request_window_inclusive_expiry():
    w = RequestWindow(60.0)
    w.record(0.0, 500)
    w.record(30.0, 100)
    assert w.max_len(60.0) == 500  # R6: ts == now - t still counts
    assert w.max_len(60.5) == 100
    assert w.max_len(200.0) == 0
    with pytest.raises(ValueError, match="now"):
        w.record(10.0, 1)


def test_policy_spike_then_idle_roundtrip():
    u = min_elastic_unit(QWEN3_14B, QWEN3_8B)  # MEU_m 9, MEU_i 10
    p = ElasticWorkerPolicy.from_unit(u, block_size=16, current_blocks=20, donated_blocks=100, window_s=60)
    total = p.total_blocks
    d = p.on_request(0.0, 16 * 45)  # need 45 -> diff 25 -> 3 MEUs
    assert d.action is ScaleAction.SCALE_UP
    assert (d.worker_blocks, d.master_blocks) == (30, 27)
    assert (p.current_blocks, p.donated_blocks) == (50, 70)
    assert p.total_blocks == total
    # Within the window the spike still counts: release down to 45 -> 0 MEUs (surplus 5).
    assert p.on_tick(30.0).action is ScaleAction.NONE
    # After the window the worker is idle: give back all 5 MEUs.
    d = p.on_tick(61.0)
    assert d.action is ScaleAction.SCALE_DOWN
    assert (d.worker_blocks, d.master_blocks) == (50, 45)
    assert (p.current_blocks, p.donated_blocks) == (0, 120)
    assert p.total_blocks == total


def test_policy_never_reclaims_above_donated_nor_goes_negative():
    p = ElasticWorkerPolicy(block_size=16, meu_worker=4, meu_master=3, current_blocks=8, donated_blocks=8)
    d = p.on_request(0.0, 16 * 1000)
    assert d.units == 2 and d.shortfall_blocks == 1000 - 16
    assert (p.current_blocks, p.donated_blocks) == (16, 0)
    d = p.on_request(1.0, 16 * 1000)
    assert d.action is ScaleAction.NONE and p.donated_blocks == 0
    for t in (100.0, 200.0, 300.0):
        p.on_tick(t)
        assert p.current_blocks >= 0 and p.donated_blocks >= 0
    assert (p.current_blocks, p.donated_blocks) == (0, 16)


# ----------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: KVGeometry(0, 16, 8, 128), "num_layers"),
        (lambda: KVGeometry(4, 0, 8, 128), "block_size"),
        (lambda: KVGeometry(4, 16, -1, 128), "num_kv_heads"),
        (lambda: KVGeometry(4, 16, 8, 1.5), "head_dim"),
        (lambda: KVGeometry(4, 16, 8, 128, dtype_bytes=0), "dtype_bytes"),
        (lambda: KVGeometry(4, 16, 8, 128, dtype_bytes=float("nan")), "dtype_bytes"),
        (lambda: plan_lsc_from_blocks(-1, [1], 10), "k_master"),
        (lambda: plan_lsc_from_blocks(100, [1, -2], 10), r"k_workers\[1\]"),
        (lambda: plan_lsc_from_blocks(100, [1], 0), "num_layers"),
        (lambda: plan_lsc(QWEN3_8B, -5, []), "master_cache_bytes"),
        (lambda: plan_lsc(QWEN3_8B, 10, [True]), r"worker_cache_bytes\[0\]"),
        (lambda: worker_full_layer_blocks(10, 0, 4), "m_block_bytes"),
        (lambda: min_elastic_unit(QWEN3_8B, "x"), "worker"),
        (lambda: block_major_shape(QWEN3_8B, -1), "n_blocks"),
        (lambda: blocks_for_tokens(10, 0), "block_size"),
        (lambda: scale_up(-1, 16, 4, 3, 10), "current_blocks"),
        (lambda: scale_up(1, 16, 0, 3, 10), "meu_worker"),
        (lambda: scale_up(1, 16, 4, 0, 10), "meu_master"),
        (lambda: scale_up(1, 16, 4, 3, -10), "request_len"),
        (lambda: scale_up(1, 16, 4, 3, 10, donated_blocks=-1), "donated_blocks"),
        (lambda: scale_down(1, 16, 4, 3, [1, -1]), r"window_lengths\[1\]"),
        (lambda: scale_down(1, 16, 4, 3, [], min_blocks=-1), "min_blocks"),
        (lambda: scale_down(1, 16, 4, 3, "abc"), "window_lengths"),
        (lambda: RequestWindow(0), "window_s"),
        (lambda: ElasticWorkerPolicy(block_size=16, meu_worker=4, meu_master=3, current_blocks=-1), "current_blocks"),
    ],
)
def test_bad_inputs_name_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()
