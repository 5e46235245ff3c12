"""The status document: arithmetic on a scheduler's numbers and rank merging."""

from types import SimpleNamespace

import torch
from fastapi import FastAPI

from sglang_memx.config import MemxConfig
from sglang_memx.endpoints import add_status_routes as add_status_route
from sglang_memx.hooks import hooks_status
from sglang_memx.hooks.scheduler import after_get_internal_state
from sglang_memx.status import kv_pool_status, scheduler_status, status_document


class FakeAllocator:
    def __init__(self, kv, available):
        self._kv, self._available = kv, available

    def available_size(self):
        return self._available

    def get_kvcache(self):
        return self._kv


def fake_scheduler(capacity=1000, available=600, evictable=150, running=2, waiting=3):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool.__new__(MHATokenToKVPool)  # upstream's pool class, its buffers set by hand
    kv.dtype = kv.store_dtype = torch.bfloat16
    kv.device, kv.layer_num = "cpu", 2
    kv.k_buffer = [torch.zeros(capacity + 1, 2, 8, dtype=torch.bfloat16)] * 2
    kv.v_buffer = [torch.zeros(capacity + 1, 2, 8, dtype=torch.bfloat16)] * 2
    return SimpleNamespace(
        max_total_num_tokens=capacity,
        page_size=16,
        token_to_kv_pool_allocator=FakeAllocator(kv, available),
        tree_cache=SimpleNamespace(evictable_size=lambda: evictable),
        running_batch=SimpleNamespace(reqs=[object()] * running),
        waiting_queue=[object()] * waiting,
        server_args=None,
    )


def test_kv_pool_numbers_follow_upstream_formula():
    pool = kv_pool_status(fake_scheduler())
    assert pool["used_tokens"] == 1000 - 600 - 150 == 250
    assert pool["usage"] == 0.25
    assert pool["page_size"] == 16 and pool["dtype"] == "bfloat16"
    assert pool["bytes"] == 4 * 1001 * 2 * 8 * 2  # what the pool itself reports
    assert pool["kind"] == "MHATokenToKVPool"


def test_scheduler_status_counts_requests_and_features():
    st = scheduler_status(fake_scheduler(), MemxConfig(), hooks_status(MemxConfig()))
    assert st["requests"] == {"running": 2, "waiting": 3}
    assert st["features"] == {
        "status_endpoint": True,
        "elastic_kv": False,
        "shared_pool": False,
        "host_buffer": False,
        "weights": False,
        "peer_kv": False,
    }


def test_status_document_merges_ranks_and_flags_missing_ones():
    rank = scheduler_status(fake_scheduler(), MemxConfig(), hooks_status(MemxConfig()))
    doc = status_document(MemxConfig(), [{"memx": rank}, {"other": 1}])
    assert doc["schedulers"] == [dict(rank, dp_rank=0)] and doc["ranks_without_memx"] == [1]
    assert doc["enabled"] is True


def test_internal_state_hook_adds_section_and_survives_errors():
    result = SimpleNamespace(internal_state={})
    controller = SimpleNamespace(scheduler=fake_scheduler())
    after_get_internal_state(result, controller, None)
    assert result.internal_state["memx"]["kv_pool"]["capacity_tokens"] == 1000
    broken = SimpleNamespace(scheduler=SimpleNamespace(server_args=None))
    result = SimpleNamespace(internal_state={"upstream": True})
    after_get_internal_state(result, broken, None)
    assert result.internal_state["upstream"] is True
    assert "AttributeError" in result.internal_state["memx"]["error"]


def test_status_route_added_once_and_not_when_disabled():
    app = FastAPI()
    assert add_status_route(app, MemxConfig(status_path="/ops/memx"))
    assert not add_status_route(app, MemxConfig(status_path="/ops/memx"))
    assert [r.path for r in app.router.routes].count("/ops/memx") == 1
    other = FastAPI()
    assert not add_status_route(other, MemxConfig(disabled=True))
    assert "/memx/status" not in [r.path for r in other.router.routes]
