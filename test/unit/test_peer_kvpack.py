"""Layer-major KV buffers <-> block-major peer blocks (memory_ext.peer.kvpack)."""

import pytest
import torch

from memory_ext.peer.kvpack import gather_block, layout_of_buffers, scatter_block


def buffers(layers=3, slots=64, heads=2, dim=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(slots, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(slots, heads, dim, generator=g).to(dtype) for _ in range(layers)]
    return k, v


def test_layout_from_buffers():
    k, v = buffers()
    lay = layout_of_buffers(k, v, block_tokens=16, model="m")
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (3, 2, 8, "bfloat16")
    assert lay.block_bytes == 3 * 2 * 16 * 2 * 8 * 2
    with pytest.raises(ValueError, match=r"v_layers\[1\]"):
        layout_of_buffers(k, [v[0], v[1][:, :1], v[2]], 16)
    with pytest.raises(ValueError, match="dtype"):
        layout_of_buffers([t.to(torch.float64) for t in k], [t.to(torch.float64) for t in v], 16)


def test_gather_then_scatter_elsewhere_is_exact():
    k, v = buffers()
    lay = layout_of_buffers(k, v, block_tokens=16)
    src = torch.arange(16, 32)  # one page
    block = gather_block(lay, k, v, src, torch.empty(lay.block_shape, dtype=torch.bfloat16))
    for layer in range(3):
        assert torch.equal(block[layer, 0], k[layer][16:32]) and torch.equal(block[layer, 1], v[layer][16:32])
    dst = torch.tensor([40 + (i * 7) % 16 for i in range(16)])  # other, shuffled slots
    k2, v2 = buffers(seed=1)
    scatter_block(lay, block, k2, v2, dst)
    for layer in range(3):
        assert torch.equal(k2[layer][dst], k[layer][src]) and torch.equal(v2[layer][dst], v[layer][src])
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(k2[layer][untouched], buffers(seed=1)[0][layer][untouched])


def test_mismatches_name_the_field():
    k, v = buffers()
    lay = layout_of_buffers(k, v, block_tokens=16)
    good = torch.empty(lay.block_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="slots"):
        gather_block(lay, k, v, torch.arange(8), good)
    with pytest.raises(ValueError, match="block: shape"):
        gather_block(lay, k, v, torch.arange(16), good[:2])
    with pytest.raises(ValueError, match="block: dtype"):
        scatter_block(lay, good.float(), k, v, torch.arange(16))
    with pytest.raises(ValueError, match="k_layers"):
        gather_block(lay, k[:2], v[:2], torch.arange(16), good)
