"""Activation profile and eLLM ballooning plan (memory_ext.policy.activation)."""

import pytest

from memory_ext.policy.activation import ActivationProfile, BalloonStep, plan_activation


def test_profile_from_model_dims_counts_one_layer_per_token_and_logits_per_sequence():
    p = ActivationProfile.from_model_dims(
        hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab=512, itemsize=4
    )
    # 4 B * (2*64 + (2*4 + 2*2)*16 + 3*128) = 2816 B per token; 2 * 512 * 4 B per sequence
    assert p.per_token_bytes == 2816 and p.per_seq_bytes == 4096
    assert p.bytes_for(0, 0) == 0
    assert p.bytes_for(64, 1) == 64 * 2816 + 4096
    assert p.bytes_for(8, 8) == 8 * 2816 + 8 * 4096
    assert p.bytes_for(2, 5) == 2 * 2816 + 2 * 4096  # never more sequences than tokens
    assert p.chunks_for(64, 1, 4096) == -(-(64 * 2816 + 4096) // 4096) == 45


def test_observe_only_raises_the_profile():
    p = ActivationProfile(per_token_bytes=100, per_seq_bytes=50, fixed_bytes=10)
    assert not p.observe(10, 1, 500)  # below the prediction (1060): unchanged
    assert p.per_token_bytes == 100 and p.source == "given"
    assert p.observe(10, 1, 2060)  # 2060 - 10 - 50 = 2000 over 10 tokens
    assert p.per_token_bytes == 200 and p.source == "measured" and p.observations == 2
    assert p.bytes_for(10, 1) >= 2060


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("per_token_bytes", dict(per_token_bytes=-1)),
        ("per_seq_bytes", dict(per_token_bytes=1, per_seq_bytes=1.5)),
    ],
)
def test_profile_rejects_bad_fields(field, kwargs):
    with pytest.raises(ValueError, match=field):
        ActivationProfile(**kwargs)


def test_plan_takes_free_first_then_only_the_kv_shortfall():
    assert plan_activation(need=5, held=8, free_chunks=0, kv_idle_chunks=0) == BalloonStep(True)
    assert plan_activation(need=10, held=4, free_chunks=10, kv_idle_chunks=0) == BalloonStep(True, 6, 0)
    step = plan_activation(need=10, held=4, free_chunks=2, kv_idle_chunks=9)
    assert step == BalloonStep(True, 2, 4) and step.shortfall == 6  # lazy: deflate only what is short


def test_plan_refuses_without_taking_anything():
    assert plan_activation(need=10, held=4, free_chunks=2, kv_idle_chunks=3) == BalloonStep(False)


def test_plan_rejects_negative_inputs_naming_the_field():
    with pytest.raises(ValueError, match="kv_idle_chunks"):
        plan_activation(1, 0, 0, -1)
