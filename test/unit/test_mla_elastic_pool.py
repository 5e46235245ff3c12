"""Elastic KV on upstream's MLA pool, on CPU (issue 28): the pool built through memx's hook, tied to
the coordinator, driven through upstream's own allocator and MLA write / read methods, and compared
row for row with a stock MLA pool given the same latents.

DeepSeek models do not run on this CPU (upstream's torch_native prefill reads the latent as per-head
keys, docs/models.md), so this is the pool level; the same scenario on CUDA is
``test/gpu/test_mla_elastic_cuda.py`` (written, not run on a GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from memory_ext.pool.host_kv_buffer import HostKVBuffer  # noqa: E402
from sglang_memx.config import MemxConfig, MemxConfigError  # noqa: E402
from sglang_memx.coordinator import pool_build  # noqa: E402
from sglang_memx.elastic import demand  # noqa: E402
from sglang_memx.elastic.host_buffer import rows_on_host  # noqa: E402
from sglang_memx.elastic.slab import slab_status  # noqa: E402
from sglang_memx.hooks import kv_cache as kv_hooks  # noqa: E402
from sglang_memx.upstream import kv as up_kv  # noqa: E402
from support import mla_elastic as mla  # noqa: E402

SIZE = 4096


@pytest.fixture(autouse=True)
def _close_pools():
    """Every pool a test built is unmapped and its chunks destroyed (they are file descriptors)."""
    yield
    from support.elastic_pool_build import close_built

    close_built()


CONFIG = MemxConfig(elastic_kv=True, chunk_kb=4)


def _latents_equal(got, written) -> bool:
    return all(torch.equal(k[..., : mla.KV_LORA_RANK], nope) and torch.equal(k[..., mla.KV_LORA_RANK :], rope)
               and torch.equal(v, nope) for (k, v), (nope, rope) in zip(got, written))  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16])
def test_an_elastic_mla_pool_maps_as_it_fills_and_reads_what_stock_reads(monkeypatch, page_size):
    pool, allocator, coordinator = mla.elastic_server(monkeypatch, CONFIG, SIZE, page_size, torch.float32, "cpu")
    stock = mla.new_pool(SIZE, page_size, torch.float32, "cpu")
    stock_allocator = mla.new_allocator(stock, "cpu")
    kv = coordinator.kv
    assert kv.cell["kv_lora_rank"] == mla.KV_LORA_RANK and kv.slab.key == "float32 L2 MLA 32+8"
    # upstream's pointer table was built from memx's views: the latents live in pooled groups
    assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]
    assert [tuple(b.shape) for b in pool.kv_buffer] == [tuple(b.shape) for b in stock.kv_buffer]
    assert up_kv.kv_buffers(allocator) == list(pool.kv_buffer)
    assert demand.kv_row_bytes(allocator) == mla.LAYERS * (mla.KV_LORA_RANK + mla.QK_ROPE) * 4
    assert up_kv.pool_description(allocator)["bytes"] == stock.get_kv_size_bytes()
    start_mapped = kv.buffers.num_mapped
    assert start_mapped * kv.buffers.group_rows < SIZE // 4  # almost nothing backed before a token is held
    # the pool reports stock's capacity: what it has mapped plus what its own pool could map now
    assert kv_hooks.after_available_size(allocator.available_size(), allocator) == stock_allocator.available_size()

    n = (2 * kv.buffers.group_rows // page_size + 1) * page_size  # two groups and a page
    loc, stock_loc = mla.alloc(allocator, n), stock_allocator.alloc(n)
    assert loc is not None and stock_loc is not None
    written = mla.write_latents(pool, loc, seed=page_size)
    mla.write_latents(stock, stock_loc, seed=page_size)  # the same latents into the stock pool
    assert _latents_equal(mla.read_latents(pool, loc), written)
    assert _latents_equal(mla.read_latents(stock, stock_loc), written)
    assert all(torch.equal(a, b) for x, y in zip(mla.read_latents(pool, loc), mla.read_latents(stock, stock_loc))
               for a, b in zip(x, y))  # fmt: skip
    held = kv.buffers.num_mapped
    assert held > start_mapped and held * kv.buffers.group_rows < SIZE  # mapped as pages were taken, not all

    allocator.free(loc)
    assert kv.shrink(allocator) > 0 and kv.buffers.num_mapped <= start_mapped + kv.spare_groups
    kv.check(allocator)


def test_latents_parked_on_the_host_come_back_into_remapped_groups(monkeypatch):
    """The host buffer's copy and restore loops over ``kv_buffers``: on MLA the per-layer latents.
    The rows outlive their groups being unmapped and are written into the groups mapped next."""
    pool, allocator, coordinator = mla.elastic_server(monkeypatch, CONFIG, SIZE, 1, torch.float32, "cpu")
    kv = coordinator.kv
    loc = mla.alloc(allocator, 700)
    written = mla.write_latents(pool, loc, seed=7)
    host = HostKVBuffer(1 << 20)
    assert host.park("r", list(range(700)), [rows_on_host(b, loc) for b in up_kv.kv_buffers(allocator)])
    allocator.free(loc)
    assert kv.shrink(allocator, spare_groups=0) > 0
    again = mla.alloc(allocator, 700)
    entry = host.take("r")
    for buf, rows in zip(up_kv.kv_buffers(allocator), entry.rows):
        buf[again] = rows
    assert _latents_equal(mla.read_latents(pool, again), written)
    assert slab_status(kv, allocator)["used_tokens"] == 700


def test_a_budget_caps_the_mla_pool_and_upstream_sees_it(monkeypatch):
    """With --memx-pool-budget-gb the pool maps at most the budget; upstream's allocator reports no
    more than that as available, and an allocation beyond it is refused (None), never a crash."""
    group_bytes_probe = mla.elastic_server(monkeypatch, CONFIG, SIZE, 1, torch.float32, "cpu")[2].kv.buffers
    budget_groups = 4
    gb = budget_groups * group_bytes_probe.group_bytes / (1 << 30)
    config = MemxConfig(elastic_kv=True, chunk_kb=4, pool_budget_gb=gb)
    pool, allocator, coordinator = mla.elastic_server(monkeypatch, config, SIZE, 1, torch.float32, "cpu")
    rows = coordinator.kv.buffers.group_rows
    available = kv_hooks.after_available_size(allocator.available_size(), allocator)
    assert available < budget_groups * rows <= SIZE
    assert mla.alloc(allocator, available) is not None
    assert coordinator.kv.buffers.num_mapped == budget_groups
    assert mla.alloc(allocator, rows) is None


@pytest.mark.parametrize(
    "fields,named",
    [({"use_dsa": True}, "sparse attention"), ({"store_dtype": torch.uint8}, "quantized"),
     ({"enable_custom_mem_pool": True}, "custom memory pool"), ({"layer_shard_enabled": True}, "layer-sharded")],
)  # fmt: skip
def test_an_mla_pool_elastic_kv_cannot_back_is_refused_naming_the_flag(monkeypatch, fields, named):
    cls = mla.mla_pool_class()
    pool = object.__new__(cls)
    base = {"use_dsa": False, "dtype": torch.float32, "store_dtype": torch.float32, "enable_custom_mem_pool": False,
            "layer_shard_enabled": False}  # fmt: skip
    for name, value in {**base, **fields}.items():
        setattr(pool, name, value)
    assert named in up_kv.elastic_pool_refusal(pool)
    monkeypatch.setattr(pool_build._current, "build", pool_build.Build(CONFIG, object(), None, 0), raising=False)
    with pytest.raises(MemxConfigError, match=named) as info:
        pool_build.make_elastic(pool)
    assert info.value.flag == "--memx-elastic-kv"


def test_a_subclass_of_the_mla_pool_is_not_backed():
    """FP4 and DeepSeek sparse attention subclass the MLA pool with other buffer layouts."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPoolFP4

    for cls in (MLATokenToKVPoolFP4, DSATokenToKVPool):
        pool = object.__new__(cls)
        assert not up_kv.is_mla_pool(pool)
        assert f"{cls.__name__} (a variant of the MLA pool)" in up_kv.elastic_pool_refusal(pool)


def test_an_mla_pool_borrows_its_groups_from_the_devices_arbiter_and_gives_them_back(monkeypatch):
    """On a shared pool (``--memx-pool``) the MLA space's groups are chunks the device's arbiter lends:
    an allocation short of mapped pages borrows at once (the coordinator's short-allocation order), the
    latents read back, and freed groups go back to the arbiter."""
    import shutil
    import tempfile

    from memory_ext.pool.arbiter import Arbiter
    from memory_ext.vmm import host_backend
    from sglang_memx.elastic.paths import pool_socket

    directory = tempfile.mkdtemp(prefix="mla-", dir="/tmp")  # a short path: the arbiter's unix socket
    config = MemxConfig(elastic_kv=True, chunk_kb=4, pool="mla", pool_dir=directory)
    try:
        with Arbiter(str(pool_socket(config)), host_backend(4096), 400) as arbiter:
            pool, allocator, coordinator = mla.elastic_server(monkeypatch, config, SIZE, 1, torch.float32, "cpu")

            def held() -> int:
                return sum(c["held"] for c in arbiter.status()["clients"])

            lent, kv = coordinator.shared_pool(), coordinator.kv
            assert lent is not None and held() == kv.buffers.chunks_per_group  # the first group, borrowed at join
            loc = mla.alloc(allocator, 3 * kv.buffers.group_rows)
            assert loc is not None and held() >= 4 * kv.buffers.chunks_per_group
            written = mla.write_latents(pool, loc, seed=11)
            assert _latents_equal(mla.read_latents(pool, loc), written)
            allocator.free(loc)
            assert kv.shrink(allocator, spare_groups=0) >= 3
            assert lent.give_back() >= 3 * kv.buffers.chunks_per_group  # every FREE chunk, the ACK waited for
            assert held() == kv.buffers.chunks_per_group
            lent.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
