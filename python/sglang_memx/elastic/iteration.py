"""The KV core's own steps of a scheduler iteration, which ``coordinator.tick`` runs in its order
(the length cap, deflation, reopening admission for the host buffer or when the head fits again,
the premap).

Invariant: nothing here imports weights or peer; what they add to an iteration is composed above.
"""

from __future__ import annotations

import logging

from sglang_memx.elastic import demand
from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import radix as up_radix
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched

logger = logging.getLogger("sglang_memx")


def physical_max_tokens(kv: ElasticKV, budget_chunks: int, kept_chunks: int) -> int:
    """The most tokens this server can ever back: its whole budget (own pool or shared pool,
    ``budget_chunks``) less what other mechanisms always keep of it (``kept_chunks``: the
    coordinator sums them, ``Coordinator.physical_budget``)."""
    groups = min(kv.num_groups, max(0, budget_chunks - kept_chunks) // kv.buffers.chunks_per_group)
    return groups * kv.buffers.group_rows - kv.page_size  # page 0 is never allocatable


def cap_request_lengths(scheduler, kv: ElasticKV, budget_chunks: int, kept_chunks: int,
                        max_tokens=physical_max_tokens) -> None:  # fmt: skip
    """Refuse (with upstream's own length error) requests that could never fit the physical budget
    (``max_tokens(kv, budget, kept)``: one space's rule, or a hybrid sliding-window model's two spaces')."""
    if kv.lengths_capped:
        return
    cap = max_tokens(kv, budget_chunks, kept_chunks)
    if up_sched.cap_request_lengths(scheduler, cap):
        logger.info("memx: requests are limited to %d input tokens by the physical KV budget", cap - 6)
    kv.lengths_capped = True


def reopen_admission_for_offload(host: HostBufferState, scheduler) -> None:
    """Upstream stops trying to admit after a refusal until a running request leaves; with room
    in the host buffer a new request may still prefill there."""
    if (
        up_sched.admission_closed_for_memory(scheduler)
        and host.offload_room() > 0
        and any(up_req.is_plain_text_request(r) for r in up_sched.waiting(scheduler))
    ):
        up_sched.reopen_admission(up_sched.running_batch(scheduler))


def reopen_admission_when_head_fits(kv: ElasticKV, scheduler, allocator, tree) -> bool:
    """Upstream closes admission after a refusal for memory and opens it again only when a running
    request leaves. Memory memx adds in between (a borrow that landed, activation given back)
    would sit unused for as long as the longest running request takes: a burst then queues behind
    one or two decoding requests (measured: ``bench_serving`` against a shared pool queued 14 for
    two seconds at the load's first concurrent requests). Reopen it when the waiting head fits by
    upstream's own rule (``demand.upstream_admission_tokens``) in what is free (mapped, and
    mappable now) and evictable less the running requests' decode reserve. True: reopened (the
    next pass asks upstream)."""
    if not up_sched.admission_closed_for_memory(scheduler):
        return False
    head = up_sched.waiting(scheduler)[:1]
    if not head:
        return False
    room = up_kv.available_tokens(allocator) + up_radix.evictable_tokens(tree) - demand.decode_reserve_tokens(scheduler)
    if demand.upstream_admission_tokens(head[0], kv.page_size) > room:
        return False
    up_sched.reopen_admission(up_sched.running_batch(scheduler))
    kv.stats["admission_reopened"] += 1
    return True


def premap_pages(kv: ElasticKV, scheduler) -> int:
    """Free pages the next decode step may take: one page per admitted request (0 when idle)."""
    return len(up_sched.admitted_reqs(scheduler))


def has_work(scheduler) -> bool:
    """Requests wait or run: deflation keeps its spare groups and the tick premaps."""
    return bool(up_sched.waiting(scheduler)) or bool(up_sched.admitted_reqs(scheduler))


def deflate(kv: ElasticKV, allocator, busy: bool) -> None:
    """Unmap groups whose pages are all free, keeping ``spare_groups`` while the server has work
    (none when idle, so an idle server holds only its cached prefixes)."""
    kv.shrink(allocator, spare_groups=kv.spare_groups if busy else 0, lazy=True)


def premap(kv: ElasticKV, allocator, scheduler, keep_activation: int) -> None:
    """Map groups from FREE chunks (and idle activation when no prefill waits: it may back the
    premap only when no prefill waits to take it back) for the next decode step's pages, never
    from the chunks that step's activation reserve needs (``keep_activation``: the coordinator
    passes ``demand.admitted_activation_chunks``, 0 without an activation)."""
    kv.refill(allocator, premap_pages(kv, scheduler) + kv.spare_groups * kv.group_pages,
              free_only=bool(up_sched.waiting(scheduler)), keep_activation=keep_activation)  # fmt: skip
