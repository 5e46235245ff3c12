"""The portable kernels are plain torch: on a CUDA device they must give the
same results as on the CPU (they are the fallback when upstream's CUDA
sgl_kernel cannot load, e.g. a driver/toolkit mismatch)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sgl_kernel():
    import sgl_kernel as mod

    if not hasattr(mod, "_unsupported"):
        pytest.skip("upstream's CUDA sgl_kernel is installed here, not the portable one")
    return mod


def test_norm_and_activation_match_cpu(sgl_kernel):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(256, generator=gen).to(torch.bfloat16)
    for fn in (lambda t, w: sgl_kernel.rmsnorm(t, w, 1e-6), lambda t, w: sgl_kernel.gemma_rmsnorm(t, w, 1e-6)):
        torch.testing.assert_close(fn(x.cuda(), w.cuda()).cpu(), fn(x, w), rtol=1e-2, atol=1e-2)
    gate = torch.randn(64, 512, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(
        sgl_kernel.silu_and_mul(gate.cuda()).cpu(), sgl_kernel.silu_and_mul(gate), rtol=1e-2, atol=1e-2
    )


def test_kv_transfer_host_to_device_and_back(sgl_kernel):
    from sgl_kernel.kvcacheio import transfer_kv_per_layer

    tokens, heads, dim = 128, 2, 16
    item = heads * dim * 2  # bytes of one token row in bf16
    host_k = torch.randn(tokens, heads, dim).to(torch.bfloat16).pin_memory()
    host_v = torch.randn(tokens, heads, dim).to(torch.bfloat16).pin_memory()
    dev_k = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
    dev_v = torch.zeros_like(dev_k)
    src = torch.randperm(tokens)[:40]
    dst = torch.randperm(tokens)[:40]
    transfer_kv_per_layer(host_k, dev_k, host_v, dev_v, src, dst.cuda(), item)
    torch.cuda.synchronize()
    assert torch.equal(dev_k[dst.cuda()].cpu(), host_k[src])
    assert torch.equal(dev_v[dst.cuda()].cpu(), host_v[src])
