"""WeightStore on the CUDA backend: pinned master copies, the copy stream, and a streamed
layer pipeline giving the same outputs as the unpooled model. Written, not run on a GPU."""

import pytest
import torch

from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import cuda_backend
from memory_ext.weights import CudaCopier, LayerPipeline, WeightStore

pytestmark = pytest.mark.gpu


def test_streamed_layers_on_cuda_match_the_unpooled_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    x = torch.randn(16, 1024, device="cuda")
    with torch.no_grad():
        expect = model(x)
    vmm = cuda_backend(0)
    pool = ChunkPool(vmm, 64)
    store = WeightStore(pool, CudaCopier(torch.device("cuda:0")))
    for i, layer in enumerate(model):
        params = list(layer.parameters())
        for p, v in zip(params, store.add_layer(i, [p.data for p in params])):
            p.data = v
    assert all(m.device.type == "cpu" and m.is_pinned() for lay in store._layers.values() for m in lay.masters)
    pipe = LayerPipeline(store, list(range(8)))
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda m, a, i=i: pipe.before_layer(i))
        layer.register_forward_hook(lambda m, a, o, i=i: pipe.after_layer(i))
    pipe.request(range(0, 8, 2), 2)
    for _ in range(3):
        pipe.begin_forward()
        with torch.no_grad():
            got = model(x)
        pipe.end_forward()
        torch.cuda.synchronize()
        assert torch.equal(got, expect)
    assert pool.usage()[Owner.FREE] == store.lent_chunks() > 0
    store.check_invariants()
    store.close()
