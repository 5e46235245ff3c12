"""Simulator: hardware table, model sizes, roofline timing."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark.sim.core.hardware import GPUS, gpu_spec  # noqa: E402
from benchmark.sim.core.models import model_spec  # noqa: E402
from benchmark.sim.core.roofline import BatchShape, Roofline  # noqa: E402


def test_every_gpu_states_a_datasheet_source_and_sane_numbers():
    assert set(GPUS) >= {"H100-SXM", "H200", "GH200", "A100-80G", "H20", "A10", "L40S"}
    for g in GPUS.values():
        assert "datasheet" in g.source or "product brief" in g.source
        assert 10 < g.hbm_gb < 200 and 100 < g.hbm_gbps < 10000 and 50 < g.bf16_tflops < 2000
        assert g.host_link in ("pcie", "c2c")
    assert GPUS["GH200"].host_gbps > 5 * GPUS["H100-SXM"].host_gbps  # C2C vs PCIe Gen5
    with pytest.raises(ValueError):
        GPUS["A100-80G"].flops("fp8")


@pytest.mark.parametrize(
    "name,billions",
    [
        ("Llama-3.1-8B", 8.03),
        ("Llama-2-7B", 6.74),
        ("Llama-2-13B", 13.0),
        ("Llama-3-70B", 70.6),
        ("Qwen2.5-7B", 7.6),
        ("OPT-13B", 13.1),
        ("OPT-30B", 30.3),
        ("Mistral-7B", 7.24),
    ],
)
def test_parameter_counts_match_published_sizes(name, billions):
    assert model_spec(name).params / 1e9 == pytest.approx(billions, rel=0.02)


def test_kv_bytes_per_token_gqa_and_mha():
    assert model_spec("Llama-3.1-8B").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert model_spec("Llama-2-7B").kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2  # 512 KiB
    assert model_spec("Llama-3.1-8B").kv_bytes_per_token("fp8") == 64 * 1024


def test_decode_8b_on_h100_is_weight_bandwidth_bound():
    m, g = model_spec("Llama-3.1-8B"), gpu_spec("H100-SXM")
    rf = Roofline(m, g, overhead_s=0.0)
    t = rf.decode_time(1, 100)
    floor = m.weight_bytes() / (g.hbm_gbps * 1e9)  # at peak bandwidth
    assert floor <= t <= floor / g.memory_eff * 1.05  # ~4.8 ms .. ~6.3 ms
    # batch 32 decode still memory bound: nearly the same weights read, plus KV
    t32 = rf.decode_time(32, 1000)
    kv = 32 * 1001 * m.kv_bytes_per_token() / (g.hbm_gbps * 1e9 * g.memory_eff)
    assert t32 == pytest.approx(t + kv, rel=0.05)


def test_prefill_is_compute_bound_and_scales_with_tokens():
    m, g = model_spec("Llama-3.1-8B"), gpu_spec("H100-SXM")
    rf = Roofline(m, g, overhead_s=0.0)
    t = rf.prefill_time(4096)
    flops = 2 * m.params * 4096
    assert t >= flops / (g.bf16_tflops * 1e12 * g.compute_eff) * 0.9
    assert t > 5 * rf.decode_time(1, 0)
    assert rf.prefill_time(8192) > 1.9 * t


def test_slower_gpu_is_slower_and_share_scales():
    m = model_spec("Llama-3.1-8B")
    s = BatchShape()
    s.add_prefill(0, 1024, True)
    h100 = Roofline(m, gpu_spec("H100-SXM"), overhead_s=0).iteration_time(s)
    a10 = Roofline(m, gpu_spec("A10"), overhead_s=0).iteration_time(s)
    half = Roofline(m, gpu_spec("H100-SXM"), overhead_s=0, share=0.5).iteration_time(s)
    assert a10 > 5 * h100
    assert half == pytest.approx(2 * h100)
    assert Roofline(m, gpu_spec("H100-SXM")).iteration_time(BatchShape()) == 0.0
