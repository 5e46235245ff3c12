"""Which upstream MHA pools elastic KV refuses to back, read on upstream's real class.

The pool objects are upstream's ``MHATokenToKVPool`` with only the attributes the refusal
reads set (building one allocates its buffers, which is what the hook replaces).
"""

from __future__ import annotations

import threading

import pytest

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from sglang_memx.config import MemxConfigError  # noqa: E402
from sglang_memx.coordinator import pool_build  # noqa: E402
from sglang_memx.upstream.kv import plain_mha_refusal  # noqa: E402


def _pool(**overrides):
    pool = object.__new__(memory_pool.MHATokenToKVPool)
    fields = {
        "quant_method": memory_pool.UnquantizedKVCacheMethod(),
        "post_capture_active": False,
        "kv_cache_layout": "nhd",
        "enable_custom_mem_pool": False,
        "custom_mem_pool": None,
    }
    fields.update(overrides)
    for name, value in fields.items():
        setattr(pool, name, value)
    return pool


def test_the_plain_mha_pool_is_accepted():
    assert plain_mha_refusal(_pool()) is None


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"enable_custom_mem_pool": True, "custom_mem_pool": object()}, "custom memory pool"),
        ({"post_capture_active": True}, "post-capture"),
        ({"kv_cache_layout": "hnd"}, "'hnd' KV layout"),
    ],
)
def test_a_pool_elastic_kv_cannot_back_is_refused_by_name(overrides, named):
    assert named in plain_mha_refusal(_pool(**overrides))


def test_the_hook_refuses_a_custom_memory_pool_with_an_error_naming_the_flag(monkeypatch):
    """Inside an open build, ``_create_buffers_normal``'s hook must not replace buffers that
    upstream would have placed in its custom memory pool (Mooncake's NVLink pool)."""
    current = threading.local()
    current.build = object()  # never read: the refusal comes first
    monkeypatch.setattr(pool_build, "_current", current)
    with pytest.raises(MemxConfigError, match="custom memory pool") as info:
        pool_build.make_elastic(_pool(enable_custom_mem_pool=True, custom_mem_pool=object()))
    assert info.value.flag == "--memx-elastic-kv"
