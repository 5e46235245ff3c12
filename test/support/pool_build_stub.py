"""``coordinator.pool_build.finish`` on a stub pool build: what it registers on the coordinator,
without upstream's pool, allocator or server arguments (the governor's registration tests)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_memx.coordinator import pool_build
from sglang_memx.coordinator.governor import GovernorPart


def governor_parts(monkeypatch, config) -> list[GovernorPart]:
    """The governors ``pool_build.finish`` registers for ``config`` (a validated ``MemxConfig``):
    upstream's configured pool and allocator, its server-argument checks and the host buffer stubbed."""
    seen = {}
    monkeypatch.setattr(pool_build.device, "attach", lambda allocator, kv, extra, **_: seen.setdefault("extra", extra))
    monkeypatch.setattr(pool_build.up_kv, "configured_pool_and_allocator",
                        lambda result: (None, type("TokenToKVPoolAllocator", (), {})()))  # fmt: skip
    monkeypatch.setattr(pool_build.up_args, "radix_cache_disabled", lambda args: False)
    monkeypatch.setattr(pool_build.up_args, "cuda_graphs_possible", lambda args: False)
    monkeypatch.setattr(pool_build, "build_host_buffer", lambda config, group_bytes: None)
    kv = SimpleNamespace(restrict_free_list=lambda allocator: None, buffers=SimpleNamespace(group_bytes=4096))
    pool_build.finish(pool_build.Build(config, SimpleNamespace(), None, 0, kv=kv), None)
    return [p for p in seen["extra"] if isinstance(p, GovernorPart)]
