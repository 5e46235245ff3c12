"""The server glue of the layer stream cache (peer.layer_stream + hooks.layer_stream) against a real donor
in this process, found by the pool's discovery: the plan from the local budget and the donation, the
buffer aliasing, the attention hook over fake forward batches (rows read and written, bytes per
forward), and the named error when no donor listens."""

from __future__ import annotations

import time
import types

import pytest
import torch

from memory_ext.peer import PeerDonor, PeerKVLayout, donor_socket
from memory_ext.pool import ChunkPool
from memory_ext.vmm import host_backend
from sglang_memx.config import MemxConfig, MemxConfigError
from sglang_memx.hooks import layer_stream as hooks
from sglang_memx.peer import layer_stream

G = 1 << 16
LAYERS, HEADS, DIM, LOCAL = 4, 2, 8, 256  # a stock server's 256 tokens of 4 layers is the local budget
TOKEN_LAYER = 2 * HEADS * DIM * 4


@pytest.fixture
def donor(tmp_path):
    vmm = host_backend(G)
    pool = ChunkPool(vmm, capacity_chunks=128)
    layout = PeerKVLayout(num_layers=LAYERS, block_tokens=16, num_kv_heads=HEADS, head_dim=DIM, dtype="float32",
                          model="tiny")  # fmt: skip
    d = PeerDonor(pool, donor_socket(tmp_path, "p", "d1"), max_bytes_per_lease=64 * G, name="d1",
                  accept_layout=layout.check_same)  # fmt: skip
    grower = {"stop": False}

    def donate():  # the donor's tick: give a new lease 40 chunks
        import threading

        def run():
            while not grower["stop"]:
                for lid in d.leases():
                    if d.region(lid).units == 0:
                        d.grow(lid, 40)
                time.sleep(0.01)

        threading.Thread(target=run, daemon=True).start()

    donate()
    yield d, MemxConfig(elastic_kv=True, pool="p", pool_dir=str(tmp_path), peer_kv="borrow", peer_layer_stream=True)
    grower["stop"] = True
    setup = layer_stream.active()
    if setup is not None:
        setup.link.close()
        layer_stream._active = None
    d.close()
    vmm.close()


def _plan(config):
    return layer_stream.plan(config, stock_tokens=LOCAL, layers=LAYERS, kv_heads=HEADS, head_dim=DIM,
                             dtype=torch.float32, page_size=1, model="tiny", name="b", chunk_bytes=G)  # fmt: skip


def test_plan_alias_and_stream_through_the_attention_hook(donor, monkeypatch):
    monkeypatch.setattr(layer_stream, "SETTLE_S", 0.3)
    d, config = donor
    setup = _plan(config)
    p = setup.plan
    assert setup.granted_bytes == 40 * G and setup.stock_tokens == LOCAL
    # 40 chunks = 2.5 MiB: every layer streams, capacity = L x stock (one staging layer)
    assert (p.resident_layers, p.streamed_layers) == (0, LAYERS) and p.capacity_tokens == LAYERS * LOCAL
    assert p.local_bytes <= LOCAL * LAYERS * TOKEN_LAYER
    rows = p.capacity_tokens + 1  # upstream's padded page
    own, index_of = layer_stream.buffer_index(setup, LAYERS)
    assert own == 1 and [index_of(i) for i in range(2 * LAYERS)] == [0] * LAYERS + [1] * LAYERS
    staging = [torch.zeros(rows, HEADS, DIM) for _ in range(2)]
    k_buf = [staging[0]] * LAYERS  # what the pool's views are: one buffer for every streamed layer
    v_buf = [staging[1]] * LAYERS
    layer_stream.attach(setup, LAYERS, *staging)
    req_to_token = torch.zeros(4, rows, dtype=torch.int32)
    req_to_token[0, :300] = torch.randperm(rows - 1)[:300].to(torch.int32) + 1
    setup.req_to_token = req_to_token
    ref = {layer: torch.zeros(rows, HEADS, DIM) for layer in range(LAYERS)}
    g = torch.Generator().manual_seed(0)

    def attention(attn_layer, q, k, v, forward_batch):  # upstream: write the new rows, read every row
        layer = attn_layer.layer_id
        loc = forward_batch.out_cache_loc.long()
        new = torch.randn(len(loc), HEADS, DIM, generator=g)
        k_buf[layer][loc] = new
        v_buf[layer][loc] = -new
        ref[layer][loc] = new
        used = req_to_token[0, : int(forward_batch.seq_lens[0])].long()
        assert torch.equal(k_buf[layer][used], ref[layer][used]) and torch.equal(v_buf[layer][used], -ref[layer][used])
        return layer

    for start, end in ((0, 200), (200, 299), (299, 300)):  # a prefill in two chunks, then a decode step
        batch = types.SimpleNamespace(req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([end]),
                                      out_cache_loc=req_to_token[0, start:end])  # fmt: skip
        for layer in range(LAYERS):
            assert hooks.around_attention(attention, types.SimpleNamespace(layer_id=layer), None, None, None,
                                          batch) == layer  # fmt: skip
    st = setup.status()
    assert st["forwards"] == 3 and st["lsc_layers_loaded"] == 3 * LAYERS and st["lsc_layers_stored"] == 3 * LAYERS
    assert st["bytes_last_forward"] == LAYERS * (299 + 99) * TOKEN_LAYER  # forward 2: 299 rows loaded, 99 stored
    assert st["lsc_broken"] is None and layer_stream.broken(setup) is None


def test_no_donor_is_a_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(layer_stream, "WAIT_DONOR_S", 0.5)
    config = MemxConfig(elastic_kv=True, pool="p", pool_dir=str(tmp_path), peer_kv="borrow", peer_layer_stream=True)
    with pytest.raises(MemxConfigError) as err:
        _plan(config)
    assert err.value.flag == "--memx-peer-layer-stream" and "no donor of pool 'p'" in str(err.value)
