"""Portable sgl_kernel ops against independent float64 / loop references."""

from __future__ import annotations

import math

import pytest
import torch

import sgl_kernel
from sgl_kernel import elementwise, kvcacheio, sampling, speculative
from sgl_kernel.scalar_type import scalar_types

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _close(actual, expected64, dtype):
    torch.testing.assert_close(actual.double(), expected64, **_tol(dtype))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# ====================================================================== norms
def _ref_rms(x64, w64, eps):
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w64


NORM_SHAPES = [(1, 8), (7, 64), (3, 5, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm(shape, dtype, gemma):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    eps = 1e-6
    x_before = x.clone()
    op = sgl_kernel.gemma_rmsnorm if gemma else sgl_kernel.rmsnorm
    y = op(x, w, eps)
    scale = w.double() + 1 if gemma else w.double()
    expected = _ref_rms(x.double(), scale, eps)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, expected, dtype)
    assert torch.equal(x, x_before)

    out = torch.empty_like(x)
    returned = op(x, w, eps, out=out, enable_pdl=True)
    assert returned is out
    _close(out, expected, dtype)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_in_place(shape, dtype, gemma):
    x = torch.randn(shape, dtype=dtype)
    r = torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    total = x.double() + r.double()
    scale = w.double() + 1 if gemma else w.double()
    expected = _ref_rms(total, scale, 1e-5)
    op = sgl_kernel.gemma_fused_add_rmsnorm if gemma else sgl_kernel.fused_add_rmsnorm
    x_ptr, r_ptr = x.data_ptr(), r.data_ptr()
    assert op(x, r, w, 1e-5, enable_pdl=False) is None
    assert x.data_ptr() == x_ptr and r.data_ptr() == r_ptr
    _close(r, total, dtype)
    _close(x, expected, dtype)


def test_rmsnorm_rejects_bad_weight():
    with pytest.raises(ValueError):
        sgl_kernel.rmsnorm(torch.randn(2, 8), torch.randn(4))


# ================================================================ activations
def _silu64(a):
    return a / (1 + torch.exp(-a))


def _gelu64(a):
    return 0.5 * a * (1 + torch.special.erf(a / math.sqrt(2)))


def _gelu_tanh64(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 64), (2, 3, 256)])
@pytest.mark.parametrize(
    "name,act",
    [("silu_and_mul", _silu64), ("gelu_and_mul", _gelu64), ("gelu_tanh_and_mul", _gelu_tanh64)],
)
def test_gated_activations(name, act, shape, dtype):
    op = getattr(sgl_kernel, name)
    x = torch.randn(shape, dtype=dtype) * 2
    d = shape[-1] // 2
    x64 = x.double()
    expected = act(x64[..., :d]) * x64[..., d:]
    y = op(x)
    assert y.shape == shape[:-1] + (d,) and y.dtype == dtype
    _close(y, expected, dtype)

    out = torch.empty(shape[:-1] + (d,), dtype=dtype)
    assert op(x, out) is out
    _close(out, expected, dtype)
    with pytest.raises(ValueError):
        op(x, torch.empty(shape, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_quick(dtype):
    x = torch.randn(4, 32, dtype=dtype) * 3
    expected = x.double() / (1 + torch.exp(-1.702 * x.double()))
    _close(sgl_kernel.gelu_quick(x), expected, dtype)
    out = torch.empty_like(x)
    assert sgl_kernel.gelu_quick(x, out) is out
    _close(out, expected, dtype)


# ======================================================================= rope
def _cos_sin_cache(max_pos, rotary_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _ref_rope(x64, positions, head_size, cache64, is_neox):
    """Loop over rotation pairs, independent of the implementation's slicing."""
    n = positions.numel()
    out = x64.clone().reshape(n, -1, head_size)
    rotary_dim = cache64.shape[-1]
    half = rotary_dim // 2
    for i in range(half):
        if is_neox:
            a_idx, b_idx = i, i + half
        else:
            a_idx, b_idx = 2 * i, 2 * i + 1
        cos = cache64[positions, i][:, None]
        sin = cache64[positions, half + i][:, None]
        a = out[:, :, a_idx].clone()
        b = out[:, :, b_idx].clone()
        out[:, :, a_idx] = a * cos - b * sin
        out[:, :, b_idx] = b * cos + a * sin
    return out.reshape(x64.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    "num_tokens,q_heads,k_heads,head_size,rotary_dim",
    [(1, 1, 1, 16, 16), (7, 4, 2, 64, 64), (5, 3, 1, 32, 16)],
)
def test_rotary_embedding(num_tokens, q_heads, k_heads, head_size, rotary_dim, is_neox, dtype):
    cache64 = _cos_sin_cache(64, rotary_dim)
    cache = cache64.to(dtype)
    positions = torch.randint(0, 64, (num_tokens,))
    q = torch.randn(num_tokens, q_heads * head_size, dtype=dtype)
    k = torch.randn(num_tokens, k_heads, head_size, dtype=dtype)
    exp_q = _ref_rope(q.double(), positions, head_size, cache.double(), is_neox)
    exp_k = _ref_rope(k.double(), positions, head_size, cache.double(), is_neox)
    q_ptr = q.data_ptr()
    assert sgl_kernel.rotary_embedding(positions, q, k, head_size, cache, is_neox) is None
    assert q.data_ptr() == q_ptr
    _close(q, exp_q, dtype)
    _close(k, exp_k, dtype)
    if rotary_dim < head_size:  # channels past rotary_dim are untouched
        torch.testing.assert_close(
            q.reshape(num_tokens, q_heads, head_size)[..., rotary_dim:].double(),
            exp_q.reshape(num_tokens, q_heads, head_size)[..., rotary_dim:],
            atol=0,
            rtol=0,
        )


def test_rotary_embedding_strided_views_and_no_key():
    head_size, heads, n = 32, 2, 6
    cache = _cos_sin_cache(16, head_size).float()
    positions = torch.randint(0, 16, (n,))
    qkv = torch.randn(n, 3 * heads * head_size)
    q, k, _ = qkv.split([heads * head_size] * 3, dim=-1)  # strided views into qkv
    exp_q = _ref_rope(q.double(), positions, head_size, cache.double(), True)
    exp_k = _ref_rope(k.double(), positions, head_size, cache.double(), True)
    sgl_kernel.rotary_embedding(positions, q, k, head_size, cache, True)
    torch.testing.assert_close(qkv[:, : heads * head_size].double(), exp_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, heads * head_size : 2 * heads * head_size].double(), exp_k, atol=1e-5, rtol=1e-5)

    q2 = torch.randn(n, heads * head_size)
    exp_q2 = _ref_rope(q2.double(), positions, head_size, cache.double(), False)
    sgl_kernel.rotary_embedding(positions, q2, None, head_size, cache, False)
    torch.testing.assert_close(q2.double(), exp_q2, atol=1e-5, rtol=1e-5)

    # A layout no view can express (transposed) still gets written in place.
    q3_t = torch.randn(heads * head_size, n)
    q3 = q3_t.t()
    exp_q3 = _ref_rope(q3.double(), positions, head_size, cache.double(), True)
    sgl_kernel.rotary_embedding(positions, q3, None, head_size, cache, True)
    torch.testing.assert_close(q3_t.t().double(), exp_q3, atol=1e-5, rtol=1e-5)


def test_copy_to_gpu_no_ce():
    src = torch.arange(10, dtype=torch.int32)
    dst = torch.zeros(10, dtype=torch.int32)
    sgl_kernel.elementwise.copy_to_gpu_no_ce(src, dst)
    assert torch.equal(src, dst)


# =================================================================== sampling
def _random_probs(batch, vocab, dtype=torch.float32):
    logits = torch.randn(batch, vocab, dtype=torch.float64) * 2
    return torch.softmax(logits, -1).to(dtype)


def _ref_top_k_support(p64, k):
    vocab = p64.shape[-1]
    if k <= 0 or k >= vocab:
        return torch.ones_like(p64, dtype=torch.bool)
    order = sorted(range(vocab), key=lambda j: -float(p64[j]))
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[:k]] = True
    return keep


def _ref_top_p_support(p64, top_p):
    vocab = p64.shape[-1]
    if top_p >= 1:
        return torch.ones(vocab, dtype=torch.bool)
    order = sorted(range(vocab), key=lambda j: -float(p64[j]))
    keep = torch.zeros(vocab, dtype=torch.bool)
    mass = 0.0
    for j in order:
        if keep.any() and mass >= top_p:
            break
        keep[j] = True
        mass += float(p64[j])
    return keep


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_renorm_prob(dtype):
    probs = _random_probs(6, 40, dtype)
    ks = torch.tensor([1, 3, 10, 0, 40, 100])
    out = sgl_kernel.top_k_renorm_prob(probs, ks)
    assert out.dtype == dtype and out.shape == probs.shape
    for i, k in enumerate(ks.tolist()):
        keep = _ref_top_k_support(probs[i].double(), k)
        assert torch.equal(out[i] > 0, keep)
        expected = torch.where(keep, probs[i].double(), 0.0)
        expected = expected / expected.sum()
        _close(out[i], expected, dtype)
        assert abs(float(out[i].double().sum()) - 1) < (1e-5 if dtype == torch.float32 else 2e-2)
    # Scalar k applies to every row.
    out_scalar = sgl_kernel.top_k_renorm_prob(probs, 3)
    assert torch.equal((out_scalar > 0).sum(-1), torch.full((6,), 3))


def test_top_k_keeps_ties_together():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]])
    out = sgl_kernel.top_k_renorm_prob(probs, 2)
    assert torch.equal(out[0] > 0, torch.tensor([True, True, True, False, False]))
    torch.testing.assert_close(out[0], torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_p_renorm_prob(dtype):
    probs = _random_probs(6, 50).to(dtype)
    top_ps = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
    out = sgl_kernel.top_p_renorm_prob(probs, top_ps)
    assert out.dtype == dtype
    for i, tp in enumerate(top_ps.tolist()):
        keep = _ref_top_p_support(probs[i].float().double(), tp)
        assert torch.equal(out[i] > 0, keep), (i, tp)
        expected = torch.where(keep, probs[i].double(), 0.0)
        _close(out[i], expected / expected.sum(), dtype)
    # The top entry always survives, even for top_p = 0.
    out0 = sgl_kernel.top_p_renorm_prob(probs.float(), 0.0)
    assert torch.equal((out0 > 0).sum(-1), torch.ones(6, dtype=torch.int64))


def _draws(op, probs, repeats, **kwargs):
    batch = probs.shape[0]
    big = probs.repeat(repeats, 1)
    expanded = {}
    for key, value in kwargs.items():
        expanded[key] = value.repeat(repeats) if isinstance(value, torch.Tensor) else value
    gen = torch.Generator().manual_seed(7)
    ids = op(big, generator=gen, **expanded)
    assert ids.dtype == torch.int32 and ids.shape == (batch * repeats,)
    return ids.view(repeats, batch)


@pytest.mark.parametrize("order", ["top_k_first", "joint"])
def test_top_k_top_p_sampling_never_returns_filtered(order):
    probs = _random_probs(4, 30)
    top_k = torch.tensor([1, 5, 12, 30])
    top_p = torch.tensor([0.9, 0.5, 0.8, 0.3])
    ids = _draws(
        sgl_kernel.top_k_top_p_sampling_from_probs,
        probs,
        500,
        top_k=top_k,
        top_p=top_p,
        filter_apply_order=order,
    )
    for i in range(4):
        p64 = probs[i].double()
        k_keep = _ref_top_k_support(p64, int(top_k[i]))
        if order == "joint":
            allowed = k_keep & _ref_top_p_support(p64, float(top_p[i]))
        else:
            renormed = torch.where(k_keep, p64, 0.0)
            renormed = renormed / renormed.sum()
            allowed = k_keep & _ref_top_p_support(renormed, float(top_p[i]))
        drawn = torch.unique(ids[:, i].long())
        assert allowed[drawn].all(), (i, drawn, allowed.nonzero())
        if int(allowed.sum()) > 1:
            assert drawn.numel() > 1  # it really samples
    assert torch.all(ids[:, 0].long() == probs[0].argmax())  # top_k = 1 is greedy


def test_min_p_sampling_never_returns_filtered():
    probs = _random_probs(3, 40)
    min_p = torch.tensor([0.05, 0.3, 0.9])
    ids = _draws(sgl_kernel.min_p_sampling_from_probs, probs, 600, min_p=min_p)
    for i in range(3):
        allowed = probs[i] >= min_p[i] * probs[i].max()
        assert allowed[torch.unique(ids[:, i].long())].all()


def test_sampling_generator_indices_and_nan():
    probs = _random_probs(3, 20)
    a = sgl_kernel.min_p_sampling_from_probs(probs, 0.1, generator=torch.Generator().manual_seed(3))
    b = sgl_kernel.min_p_sampling_from_probs(probs, 0.1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)

    indices = torch.tensor([2, 2, 0])
    ids = sgl_kernel.top_k_top_p_sampling_from_probs(probs, 1, 1.0, indices=indices)
    assert torch.equal(ids.long(), probs.argmax(-1)[indices])

    bad = probs.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError):
        sgl_kernel.top_k_top_p_sampling_from_probs(bad, 5, 0.9, check_nan=True)
    with pytest.raises(ValueError):
        sgl_kernel.min_p_sampling_from_probs(bad, 0.1, check_nan=True)
    with pytest.raises(ValueError):
        sgl_kernel.top_k_top_p_sampling_from_probs(probs, 5, 0.9, filter_apply_order="bogus")


# ================================================================ kv transfer
LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
DEVICE_TOKENS, HOST_TOKENS = 32, 48  # multiples of PAGE


def _ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def _device_pool(dtype=torch.bfloat16, heads=HEADS, dim=HEAD_DIM):
    k = [torch.randn(DEVICE_TOKENS, heads, dim).to(dtype) for _ in range(LAYERS)]
    v = [torch.randn(DEVICE_TOKENS, heads, dim).to(dtype) for _ in range(LAYERS)]
    return k, v


def _empty_like_pool(pool):
    return [torch.zeros_like(t) for t in pool]


def _indices(index_dtype=torch.int64, n=10, page_aligned=False):
    if page_aligned:  # whole pages, as the page-granular host layouts are used
        dev_pages = torch.randperm(DEVICE_TOKENS // PAGE)[: n // PAGE]
        host_pages = torch.randperm(HOST_TOKENS // PAGE)[: n // PAGE]
        offs = torch.arange(PAGE)
        dev = (dev_pages[:, None] * PAGE + offs).reshape(-1)
        host = (host_pages[:, None] * PAGE + offs).reshape(-1)
    else:
        dev = torch.randperm(DEVICE_TOKENS)[:n]
        host = torch.randperm(HOST_TOKENS)[:n]
    return dev.to(index_dtype), host.to(index_dtype)


def _assert_rows_equal(dst_layers, dst_idx, src_layers, src_idx):
    for d, s in zip(dst_layers, src_layers):
        assert torch.equal(d[dst_idx.long()], s[src_idx.long()])


def _untouched(before_layers, after_layers, touched):
    mask = torch.ones(before_layers[0].shape[0], dtype=torch.bool)
    mask[touched.long()] = False
    for b, a in zip(before_layers, after_layers):
        assert torch.equal(b[mask], a[mask])


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("table", ["pointers", "tensors"])
def test_kv_layer_first_round_trip(index_dtype, table):
    k, v = _device_pool()
    item = HEADS * HEAD_DIM * k[0].element_size()
    host = torch.zeros(2, LAYERS, HOST_TOKENS, HEADS, HEAD_DIM, dtype=k[0].dtype)
    host_k = [host[0, i] for i in range(LAYERS)]
    host_v = [host[1, i] for i in range(LAYERS)]
    dev_idx, host_idx = _indices(index_dtype)
    wrap = _ptrs if table == "pointers" else list
    sgl_kernel.transfer_kv_all_layer(wrap(k), wrap(host_k), wrap(v), wrap(host_v), dev_idx, host_idx, item, LAYERS)
    _assert_rows_equal(host_k + host_v, host_idx, k + v, dev_idx)

    k2, v2 = _empty_like_pool(k), _empty_like_pool(v)
    new_dev = torch.randperm(DEVICE_TOKENS)[: dev_idx.numel()].to(index_dtype)
    for layer in range(LAYERS):
        sgl_kernel.transfer_kv_per_layer(host_k[layer], k2[layer], host_v[layer], v2[layer], host_idx, new_dev, item)
    _assert_rows_equal(k2 + v2, new_dev, k + v, dev_idx)
    _untouched(_empty_like_pool(k), k2, new_dev)


def test_kv_page_first_round_trip():
    k, v = _device_pool()
    item = HEADS * HEAD_DIM * k[0].element_size()
    layout_dim = item * LAYERS
    host = torch.zeros(2, HOST_TOKENS, LAYERS, HEADS, HEAD_DIM, dtype=k[0].dtype)
    dev_idx, host_idx = _indices()
    kvcacheio.transfer_kv_all_layer_lf_pf(
        _ptrs(k), host[0], _ptrs(v), host[1], dev_idx, host_idx, item, layout_dim, LAYERS
    )
    for layer in range(LAYERS):
        assert torch.equal(host[0][host_idx, layer], k[layer][dev_idx])
        assert torch.equal(host[1][host_idx, layer], v[layer][dev_idx])

    k2, v2 = _empty_like_pool(k), _empty_like_pool(v)
    for layer in range(LAYERS):
        kvcacheio.transfer_kv_per_layer_pf_lf(
            host[0], k2[layer], host[1], v2[layer], host_idx, dev_idx, layer, item, layout_dim
        )
    _assert_rows_equal(k2 + v2, dev_idx, k + v, dev_idx)


def test_kv_page_head_round_trip():
    k, v = _device_pool()
    item = HEADS * HEAD_DIM * k[0].element_size()
    layout_dim = item * LAYERS
    pages = HOST_TOKENS // PAGE
    host = torch.zeros(2, pages, HEADS, PAGE, LAYERS, HEAD_DIM, dtype=k[0].dtype)
    dev_idx, host_idx = _indices(page_aligned=True, n=8)
    kvcacheio.transfer_kv_all_layer_lf_ph(
        _ptrs(k), host[0], _ptrs(v), host[1], dev_idx, host_idx, item, layout_dim, LAYERS, PAGE, HEADS
    )
    for i in range(dev_idx.numel()):
        t, d = int(host_idx[i]), int(dev_idx[i])
        for layer in range(LAYERS):
            for h in range(HEADS):
                assert torch.equal(host[0, t // PAGE, h, t % PAGE, layer], k[layer][d, h])
                assert torch.equal(host[1, t // PAGE, h, t % PAGE, layer], v[layer][d, h])

    k2, v2 = _empty_like_pool(k), _empty_like_pool(v)
    for layer in range(LAYERS):
        kvcacheio.transfer_kv_per_layer_ph_lf(
            host[0], k2[layer], host[1], v2[layer], host_idx, dev_idx, layer, item, layout_dim, PAGE, HEADS
        )
    _assert_rows_equal(k2 + v2, dev_idx, k + v, dev_idx)


def test_kv_direct_layer_first_round_trip():
    k, v = _device_pool(torch.float32)
    host = torch.zeros(2, LAYERS, HOST_TOKENS, HEADS, HEAD_DIM)
    host_layers = [host[0, i] for i in range(LAYERS)] + [host[1, i] for i in range(LAYERS)]
    dev_idx, host_idx = _indices()
    kvcacheio.transfer_kv_direct(k + v, host_layers, dev_idx, host_idx, PAGE)
    _assert_rows_equal(host_layers, host_idx, k + v, dev_idx)
    k2, v2 = _empty_like_pool(k), _empty_like_pool(v)
    for layer in range(LAYERS):
        kvcacheio.transfer_kv_direct([host[0, layer], host[1, layer]], [k2[layer], v2[layer]], host_idx, dev_idx, PAGE)
    _assert_rows_equal(k2 + v2, dev_idx, k + v, dev_idx)


def test_kv_page_first_direct_round_trip():
    k, v = _device_pool()
    pages = HOST_TOKENS // PAGE
    host = torch.zeros(2, pages, LAYERS, PAGE, HEADS, HEAD_DIM, dtype=k[0].dtype)
    dev_idx, host_idx = _indices(page_aligned=True, n=8)
    kvcacheio.transfer_kv_all_layer_direct_lf_pf(k + v, [host[0], host[1]], dev_idx, host_idx, PAGE)
    for layer in range(LAYERS):
        assert torch.equal(host[0][host_idx // PAGE, layer, host_idx % PAGE], k[layer][dev_idx])
        assert torch.equal(host[1][host_idx // PAGE, layer, host_idx % PAGE], v[layer][dev_idx])
    k2, v2 = _empty_like_pool(k), _empty_like_pool(v)
    for layer in range(LAYERS):
        kvcacheio.transfer_kv_per_layer_direct_pf_lf(
            [host[0], host[1]], [k2[layer], v2[layer]], host_idx, dev_idx, layer, PAGE
        )
    _assert_rows_equal(k2 + v2, dev_idx, k + v, dev_idx)


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_kv_mla_round_trip(host_layout):
    kv_dim = 12
    dev = [torch.randn(DEVICE_TOKENS, 1, kv_dim).to(torch.bfloat16) for _ in range(LAYERS)]
    item = kv_dim * 2
    dev_idx, host_idx = _indices(torch.int32)
    dev2 = _empty_like_pool(dev)
    if host_layout == "layer_first":
        host = torch.zeros(LAYERS, HOST_TOKENS, 1, kv_dim, dtype=torch.bfloat16)
        host_layers = [host[i] for i in range(LAYERS)]
        kvcacheio.transfer_kv_all_layer_mla(_ptrs(dev), _ptrs(host_layers), dev_idx, host_idx, item, LAYERS)
        _assert_rows_equal(host_layers, host_idx, dev, dev_idx)
        for layer in range(LAYERS):
            kvcacheio.transfer_kv_per_layer_mla(host[layer], dev2[layer], host_idx, dev_idx, item)
    else:
        host = torch.zeros(HOST_TOKENS, LAYERS, 1, kv_dim, dtype=torch.bfloat16)
        kvcacheio.transfer_kv_all_layer_mla_lf_pf(_ptrs(dev), host, dev_idx, host_idx, item, item * LAYERS, LAYERS)
        for layer in range(LAYERS):
            assert torch.equal(host[host_idx.long(), layer], dev[layer][dev_idx.long()])
            kvcacheio.transfer_kv_per_layer_mla_pf_lf(host, dev2[layer], host_idx, dev_idx, layer, item, item * LAYERS)
    _assert_rows_equal(dev2, dev_idx, dev, dev_idx)


def test_kv_out_of_range_index_raises_for_tensors():
    k, v = _device_pool()
    item = HEADS * HEAD_DIM * 2
    host = torch.zeros(LAYERS, HOST_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    # Row HOST_TOKENS is past layer 0's view although still inside the buffer.
    for bad_src, bad_dst in ((HOST_TOKENS, 0), (0, DEVICE_TOKENS)):
        with pytest.raises(IndexError):
            sgl_kernel.transfer_kv_per_layer(
                host[0], k[0], host[1], v[0], torch.tensor([bad_src]), torch.tensor([bad_dst]), item
            )
    assert torch.count_nonzero(host) == 0


def test_kv_pointer_table_must_be_on_cpu():
    k, v = _device_pool()
    table = torch.empty(LAYERS, dtype=torch.uint64, device="meta")
    with pytest.raises(NotImplementedError, match="host"):
        sgl_kernel.transfer_kv_all_layer(table, table, table, table, torch.tensor([0]), torch.tensor([0]), 32, LAYERS)


def test_transfer_embedding_ranges_direct():
    src = torch.randn(20, 6)
    dst = torch.zeros(30, 6)
    kvcacheio.transfer_embedding_ranges_direct(src, dst, [0, 10], [5, 20], [3, 4])
    assert torch.equal(dst[5:8], src[0:3]) and torch.equal(dst[20:24], src[10:14])
    mask = torch.ones(30, dtype=torch.bool)
    mask[5:8] = mask[20:24] = False
    assert torch.count_nonzero(dst[mask]) == 0


def test_copy_all_layer_kv_cache_cpu():
    buffers = [torch.randn(16, 2, 4), torch.randn(16, 3).to(torch.bfloat16)]
    before = [b.clone() for b in buffers]
    ptrs = _ptrs(buffers)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    src = torch.tensor([0, 1, 2, 9])
    tgt = torch.tensor([1, 2, 3, 12])  # overlaps the sources: reads happen first
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(buffers, before):
        assert torch.equal(b[tgt], old[src])
        untouched = [i for i in range(16) if i not in tgt.tolist()]
        assert torch.equal(b[untouched], old[untouched])


# =============================================================== speculative
def test_assign_req_to_token_pool_and_extend_cache_locs():
    pool_len = 12
    table = torch.zeros(5, pool_len, dtype=torch.int32)
    req = torch.tensor([3, 0, 4])
    start = torch.tensor([2, 0, 5])
    end = torch.tensor([5, 4, 5])  # last request adds nothing
    locs = torch.arange(100, 107, dtype=torch.int64)
    speculative.assign_req_to_token_pool_cpu(req, table, start, end, locs, pool_len)
    expected = torch.zeros_like(table)
    offset = 0
    for r, s, e in zip(req.tolist(), start.tolist(), end.tolist()):
        for j in range(e - s):
            expected[r, s + j] = int(locs[offset + j])
        offset += e - s
    assert torch.equal(table, expected)

    out = torch.full((7,), -1, dtype=torch.int64)
    sgl_kernel.assign_extend_cache_locs_cpu(req, table, start, end, out, pool_len)
    assert torch.equal(out, locs)


def test_assign_draft_cache_locs_contiguous():
    table = torch.arange(60, dtype=torch.int64).view(4, 15)
    req = torch.tensor([2, 0])
    seq_lens = torch.tensor([3, 7])
    topk, steps = 2, 3
    out = torch.zeros(12, dtype=torch.int64)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(req, table, seq_lens, out, 15, topk, steps)
    expected = []
    for r, s in zip(req.tolist(), seq_lens.tolist()):
        expected += [int(table[r, s + j]) for j in range(topk * steps)]
    assert out.tolist() == expected


def test_fill_accept_out_cache_loc_and_bonus_tokens():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(200, 209)
    dst = torch.full((9,), -5, dtype=torch.int64)
    sgl_kernel.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, dst)
    assert dst.tolist() == [200, 202, 204, 206, 207, 208, -5, -5, -5]

    accept_tokens = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    accept_lens = torch.tensor([2, 1, 3], dtype=torch.int32)
    bonus = torch.zeros(3, dtype=torch.int64)
    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 3)
    assert bonus.tolist() == [12, 21, 33]


@pytest.mark.parametrize("with_select", [False, True])
def test_rotate_input_ids(with_select):
    ids = torch.arange(10, 22)
    original = ids.tolist()
    start = torch.tensor([0, 5, 9])
    lens = torch.tensor([5, 4, 0])
    new_tok = torch.tensor([[100], [200], [300]])
    select = torch.tensor([2, 6, 0]) if with_select else None
    sgl_kernel.rotate_input_ids_cpu(ids, start, lens, new_tok, select)
    expected = list(original)
    for i, (s, n) in enumerate(zip(start.tolist(), lens.tolist())):
        for j in range(n - 1):
            expected[s + j] = original[s + j + 1]
        if n > 0:
            pos = int(select[i]) if with_select else s + n - 1
            expected[pos] = int(new_tok[i, 0])
    assert ids.tolist() == expected


# ===================================================== misc, unsupported names
def test_misc():
    assert sgl_kernel.__version__ == "0.1.0"
    assert sgl_kernel.utils.is_arch_support_pdl() is False
    t = torch.randn(3)
    assert sgl_kernel.weak_ref_tensor(t) is t
    assert sgl_kernel.weak_ref_tensor(5) == 5
    assert sgl_kernel.metal._metal is None and isinstance(sgl_kernel.metal._IMPORT_ERROR, ImportError)


def _unsupported_names():
    modules = [
        sgl_kernel.allreduce,
        sgl_kernel.attention,
        sgl_kernel.elementwise,
        sgl_kernel.flash_attn,
        sgl_kernel.gemm,
        sgl_kernel.kvcacheio,
        sgl_kernel.mamba,
        sgl_kernel.metal,
        sgl_kernel.moe,
        sgl_kernel.quantization,
        sgl_kernel.sampling,
        sgl_kernel.spatial,
        sgl_kernel.speculative,
    ]
    return [(m, name) for m in modules for name in m.UNSUPPORTED]


@pytest.mark.parametrize("module,name", _unsupported_names(), ids=lambda x: getattr(x, "__name__", x))
def test_unsupported_ops_raise(module, name):
    with pytest.raises(NotImplementedError, match=name):
        getattr(module, name)(torch.zeros(1), 1, key="value")
    top = getattr(sgl_kernel, name, None)
    if top is not None:  # re-exported at top level: the very same callable
        assert top is getattr(module, name)


def test_implemented_ops_are_not_stubs():
    for module in (elementwise, sampling, kvcacheio, speculative):
        for name in module.__all__:
            fn = getattr(module, name)
            assert getattr(fn, "memx_unsupported", False) == (name in module.UNSUPPORTED), name


# =============================================================== scalar types
def test_scalar_types():
    assert scalar_types.uint4b8.size_bits == 4 and scalar_types.uint4b8.bias == 8
    assert scalar_types.float8_e4m3fn.max() == 448.0
    assert scalar_types.float4_e2m1f.max() == 6.0
    assert scalar_types.int8.min() == -128 and scalar_types.int8.max() == 127
    named = {
        name: value
        for name, value in vars(scalar_types).items()
        if isinstance(value, sgl_kernel.scalar_type.ScalarType)
    }
    distinct = {value.id for name, value in named.items() if name not in ("bfloat16", "float16")}
    assert len(distinct) == len(named) - 2
