"""Build the elastic KV of one server: backend, pool (own or shared), buffers, activation balloon.

Called once per scheduler process, from the KV pool build (``hooks.kv_cache``). Group 0 (the
padded page) is mapped on return; the rest follows the pages in use (``elastic.kv``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from memory_ext.policy.activation import ActivationProfile
from memory_ext.pool import ChunkPool
from memory_ext.pool.activation_balloon import ActivationBalloon
from memory_ext.pool.layered_kv import LayeredKVBuffers, group_rows_for
from memory_ext.pool.lent_pool import LentPool
from sglang_memx.config import MemxConfig, MemxConfigError
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.elastic.shared_pool import GB, join_pool, register_server

logger = logging.getLogger("sglang_memx")

SPARE_GROUPS = 1  # empty KV groups kept mapped while the server has work (premapped for the next steps)
# A (re)starting server on a full shared pool waits this long for its first KV group: the pool's
# other servers give memory back as their requests finish (an engine restarted under load).
JOIN_WAIT_S = 300.0
JOIN_RETRY_S = 1.0
JOIN_LOG_EVERY_S = 15.0


def make_backend(config: MemxConfig, device: str):
    if str(device).startswith("cuda"):
        from memory_ext.vmm import cuda_backend

        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        return cuda_backend(index)
    from memory_ext.vmm import host_backend

    return host_backend(config.chunk_kb << 10, name=f"memx-kv-{os.getpid()}")


def activation_profile(dims: dict | None, itemsize: int) -> ActivationProfile | None:
    """The activation profile of the served model from its decoder dims (``upstream.model.decoder_dims``);
    None (no ballooning, logged) when the model's config lacks some of them."""
    if dims is None:
        logger.warning("memx: the model's config lacks decoder dimensions; activations are not ballooned")
        return None
    return ActivationProfile.from_model_dims(**dims, itemsize=itemsize)


def activation_arena(config: MemxConfig, backend, pool, ranks: int = 1):
    """On CUDA, the arena + MemPool the forward's activations are allocated from; ``(None, None)``
    on CPU, with ``--memx-torch-activations``, at tensor parallel ``ranks`` > 1 (the arena maps chunks
    while a forward runs, as each rank's allocator asks: the ranks' pools could part) or when the
    arena cannot be built here (logged: the activations then come from torch and are also counted
    against the pool, as before)."""
    if config.torch_activations or backend.device.type != "cuda" or ranks > 1:
        return None, None
    try:
        from memory_ext.pool.segment_arena import ArenaMemPool, SegmentArena, cuda_driver_hooks

        arena = SegmentArena(backend, pool.capacity_chunks, **cuda_driver_hooks())
        try:
            return arena, ArenaMemPool()
        except BaseException:
            arena.close()
            raise
    except Exception as exc:
        logger.warning(
            "memx: activation arena unavailable (%s); activations stay with torch's allocator "
            "and are counted against the pool as well",
            exc,
        )
        return None, None


def _own_pool_capacity(
    config: MemxConfig, logical_chunks: int, group_chunks: int, act_chunks: int, batch_tokens: int, chunk_bytes: int
) -> int:
    if config.pool_budget_gb is None:
        return logical_chunks + act_chunks
    capacity = int(config.pool_budget_gb * GB) // chunk_bytes
    if capacity < group_chunks + act_chunks:
        raise MemxConfigError(
            "--memx-pool-budget-gb",
            f"{config.pool_budget_gb} GB is less than one KV group ({group_chunks * chunk_bytes / GB:.6f} GB) "
            f"plus the activation of a {batch_tokens}-token prefill batch ({act_chunks * chunk_bytes / GB:.6f} GB); "
            f"raise the budget or lower --chunked-prefill-size",
        )
    return capacity


def _join_shared_pool(config: MemxConfig, backend, group_chunks: int, act_chunks: int, batch_tokens: int,
                      ranks: int):  # fmt: skip
    lent = join_pool(config, backend, ranks=ranks)
    if lent.budget_chunks < group_chunks + act_chunks:
        lent.close()
        raise MemxConfigError(
            "--memx-pool-budget-gb",
            f"pool {config.pool!r} ({lent.budget_chunks} chunks) cannot hold one KV group ({group_chunks} chunks) "
            f"plus the activation of a {batch_tokens}-token prefill batch ({act_chunks} chunks); raise the budget "
            f"or lower --chunked-prefill-size",
        )
    try:
        borrow_first_group(lent, group_chunks, config.pool, backend.granularity)
    except BaseException:
        lent.close()
        raise
    return lent


def borrow_first_group(
    lent,
    group_chunks: int,
    pool_name: str,
    chunk_bytes: int,
    wait_s: float = JOIN_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Borrow the server's first KV group from the shared pool, retrying every ``JOIN_RETRY_S``
    while the pool cannot lend it (full, its servers busy), for at most ``wait_s`` seconds (logged
    every ``JOIN_LOG_EVERY_S``); then MemxConfigError naming the budget flag."""
    start = clock()
    next_log = start
    while lent.borrow(group_chunks) == 0:
        now = clock()
        if now - start >= wait_s:
            raise MemxConfigError(
                "--memx-pool-budget-gb",
                f"pool {pool_name!r} could not lend one KV group ({group_chunks * chunk_bytes / GB:.3f} GB) "
                f"in {wait_s:g} s: its other servers keep the whole budget busy; raise the budget",
            )
        if now >= next_log:
            next_log = now + JOIN_LOG_EVERY_S
            logger.warning(
                "memx: pool %r cannot lend one KV group (%d chunks) now (at most %d could be gathered); "
                "waiting up to %.0f s more for its servers to give memory back",
                pool_name, group_chunks, lent.last_denied_available, wait_s - (now - start),
            )  # fmt: skip
        sleep(JOIN_RETRY_S)


def build_elastic_kv(
    config: MemxConfig,
    row_bytes: Sequence[int],
    num_rows: int,
    page_size: int,
    num_pages: int,
    device,
    server_url: str | None = None,
    profile: ActivationProfile | None = None,
    batch_tokens: int = 0,
    ranks: int = 1,
) -> tuple[ElasticKV, LentPool | None]:
    """Everything elastic KV needs: the KV space and, on a shared pool (``--memx-pool``), its link to it.

    With a ``profile``, activations share the pool (``ActivationBalloon``): an own pool
    without a budget gets room for the largest prefill batch's activation on top of the
    logical KV size; a budget must hold one KV group plus that activation.
    """
    backend = make_backend(config, str(device))
    group_rows = group_rows_for(row_bytes, backend.granularity, page_size)
    group_chunks = sum(group_rows * rb // backend.granularity for rb in row_bytes)
    groups = -(-num_rows // group_rows)
    act_chunks = profile.chunks_for(batch_tokens, 1, backend.granularity) if profile and batch_tokens else 0
    lent = None
    if config.pool:
        lent = _join_shared_pool(config, backend, group_chunks, act_chunks, batch_tokens, ranks=ranks)
        pool = lent.pool
    else:
        capacity = _own_pool_capacity(
            config, groups * group_chunks, group_chunks, act_chunks, batch_tokens, backend.granularity
        )
        pool = ChunkPool(backend, capacity)
    buffers = LayeredKVBuffers(pool, row_bytes, num_rows, page_size)
    kv = ElasticKV(buffers, page_size, num_pages, spare_groups=SPARE_GROUPS, device=device)
    if profile is not None:
        arena, mempool = activation_arena(config, backend, pool, ranks)
        kv.activation = ActivationBalloon(pool, profile, batch_tokens, arena=arena, mempool=mempool)
    register_server(config, server_url)
    logger.info(
        "memx: elastic KV on %s: %d token rows reserved in %d groups of %d tokens (%.1f MiB each); pool %s",
        type(backend).__name__,
        num_rows,
        groups,
        group_rows,
        buffers.group_bytes / (1 << 20),
        f"{config.pool!r} (shared)" if lent else f"of {pool.capacity_chunks} chunks (own)",
    )
    return kv, lent


def build_sibling_kv(config: MemxConfig, row_bytes: Sequence[int], num_rows: int, page_size: int, num_pages: int,
                     device, pool: ChunkPool) -> ElasticKV:  # fmt: skip
    """A second KV space of the same server on its pool (a hybrid sliding-window model's sliding-window
    sub-pool beside its full-attention one, ``coordinator.swa_spaces``). Without a budget the own pool
    grows by this space's logical size, as it was sized by the first space's; with one, both share it."""
    buffers = LayeredKVBuffers(pool, row_bytes, num_rows, page_size)
    if config.pool_budget_gb is None:
        pool.add_capacity(buffers.num_groups * buffers.chunks_per_group)
    kv = ElasticKV(buffers, page_size, num_pages, spare_groups=SPARE_GROUPS, device=device)
    logger.info(
        "memx: elastic KV, second space on the same pool: %d token rows reserved in %d groups of %d tokens "
        "(%.1f MiB each); pool of %d chunks",
        num_rows, buffers.num_groups, buffers.group_rows, buffers.group_bytes / (1 << 20), pool.capacity_chunks,
    )  # fmt: skip
    return kv
