"""A KV pool built inside an open elastic build, with memx's buffer hook on the pool class as
upstream's registry applies it, and its allocator tied to the coordinator by ``pool_build.finish``,
as ``KVCacheConfigurator.configure``'s hook does (the pool-level tests of elastic KV on upstream's
MLA and hybrid sliding-window pools, ``mla_elastic`` and ``swa_elastic``)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from sglang_memx.config import MemxConfig
from sglang_memx.coordinator import device as coordinator_device
from sglang_memx.coordinator import pool_build
from sglang_memx.hooks import kv_cache as kv_hooks

BUILT: list = []  # the coordinators built here and not closed yet (``close_built``)


def elastic_build(monkeypatch, config: MemxConfig, model_class: str, hooked: tuple[type, str],
                  make_pool: Callable[[], object], make_allocator: Callable[[object], object], *,
                  hybrid_swa: bool = False):  # fmt: skip
    """(pool, allocator, coordinator): ``make_pool()`` with ``hooked`` (class, buffer method) wrapped by
    memx's hook inside the build, then ``make_allocator(pool)`` tied."""
    monkeypatch.setattr(pool_build.up_args, "radix_cache_disabled", lambda args: False)
    monkeypatch.setattr(pool_build.up_args, "cuda_graphs_possible", lambda args: False)
    build = pool_build.Build(config, SimpleNamespace(host="127.0.0.1", port=0), None, 0, model_class=model_class,
                             hybrid_swa=hybrid_swa)  # fmt: skip
    cls, method = hooked
    original = getattr(cls, method)
    with monkeypatch.context() as m:
        m.setattr(cls, method, lambda p: kv_hooks.around_create_buffers(original, p))
        pool_build._current.build = build
        try:
            pool = make_pool()
        finally:
            pool_build._current.build = None
    if build.kv is not None:  # built: closed by ``close_built`` even when the tie below refuses
        BUILT.append(build)
    allocator = make_allocator(pool)
    pool_build.finish(build, SimpleNamespace(token_to_kv_pool=pool, token_to_kv_pool_allocator=allocator))
    return pool, allocator, coordinator_device.of(allocator)


def close_built() -> None:
    """Unmap and destroy what every build here mapped (each host chunk is a file descriptor: a test
    run that leaks them pushes later tests' descriptors past what ``select()`` takes)."""
    while BUILT:
        build = BUILT.pop()
        for kv in build.spaces.values() or [build.kv]:
            kv.buffers.close()
        if build.lent is not None:
            build.lent.close()
        else:
            build.kv.buffers.pool.trim()
