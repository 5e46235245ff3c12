"""Once per scheduler iteration, before upstream picks the next batch: the elastic-KV housekeeping.

In order:

1. cap request lengths to the physical budget (once);
2. host buffer: offloaded prefills leave the last prefill batch and are parked once their
   first token is in (before anything reads that batch);
3. the previous forward is done: its activation chunks become idle;
4. shared pool: wake-ups consumed (an idle server sleeping with ``--sleep-on-idle`` is woken
   by the arbiter's requests), the arbiter's reclaims answered;
5. deflation: unmap groups whose pages are all free, keeping ``spare_groups`` while the
   server has work (none when idle, so an idle server holds only its cached prefixes);
6. host buffer: one Alg. 2 step from this iteration's TTFT / TPOT samples;
7. shared pool: give idle chunks back, borrow the queue's shortfall, report to the arbiter;
8. host buffer: fetch the first parked request's KV when it can be admitted; reopen
   admission while the buffer has room for new prefills;
9. weights: one Oneiros step (release a layer under KV pressure, restore one when its lent
   memory is empty); applied by the layer pipeline at the next forward boundary;
10. hold the head request's prefill activation (evicting cached prefixes is safe here);
11. premap: map groups from FREE chunks (and idle activation when no prefill waits) so the
    next decode step finds its pages mapped (the request path then makes no map call),
    never from the chunks that step's activation reserve needs
    (``demand.decode_activation_chunks``): the step's path then makes no map and no unmap.
"""

from __future__ import annotations

import logging
import time

from sglang_memx.elastic import demand, host_buffer, shared_pool, slo
from sglang_memx.elastic.ballooning import hold_head_activation
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.weights import remap, sleep

logger = logging.getLogger("sglang_memx")


def physical_max_tokens(kv) -> int:
    """The most tokens this server can ever back: its whole budget (own pool or shared pool)."""
    budget = kv.lent.budget_chunks if kv.lent is not None else kv.buffers.pool.capacity_chunks
    if kv.weights is not None:  # weights share the budget; remap may lend all but a minimum to KV
        budget -= kv.weights.min_held_chunks()
    if kv.activation is not None:  # the largest prefill batch's activation shares the budget
        budget -= kv.activation.need_chunks(kv.activation.max_batch_tokens, 1)
    groups = min(kv.num_groups, max(0, budget) // kv.buffers.chunks_per_group)
    return groups * kv.buffers.group_rows - kv.page_size  # page 0 is never allocatable


def cap_request_lengths(scheduler, kv) -> None:
    """Refuse (with upstream's own length error) requests that could never fit the physical budget."""
    if kv.lengths_capped:
        return
    cap = physical_max_tokens(kv)
    if up_sched.cap_request_lengths(scheduler, cap):
        logger.info("memx: requests are limited to %d input tokens by the physical KV budget", cap - 6)
    kv.lengths_capped = True


def reopen_admission_for_offload(kv, scheduler) -> None:
    """Upstream stops trying to admit after a refusal until a running request leaves; with room
    in the host buffer a new request may still prefill there."""
    if (
        up_sched.admission_closed_for_memory(scheduler)
        and kv.host.offload_room() > 0
        and any(up_req.is_plain_text_request(r) for r in up_sched.waiting(scheduler))
    ):
        up_sched.reopen_admission(up_sched.running_batch(scheduler))


def premap_pages(kv, scheduler) -> int:
    """Free pages the next decode step may take: one page per admitted request (0 when idle)."""
    return len(up_sched.admitted_reqs(scheduler))


def tick(scheduler) -> None:
    allocator = up_sched.allocator(scheduler)
    kv = up_kv.elastic_of(allocator)
    if kv is None:
        return
    t0 = time.perf_counter()
    kv.phase = "tick"  # its unmaps are background work, not a request's path (ElasticKV.unmap_calls)
    try:
        _tick(scheduler, allocator, kv)
    finally:
        kv.phase = "request"
    kv.stats["ticks"] += 1
    kv.stats["tick_seconds"] += time.perf_counter() - t0


def _tick(scheduler, allocator, kv) -> None:
    tree = up_sched.tree_cache(scheduler)
    cap_request_lengths(scheduler, kv)
    if kv.host is not None:
        host_buffer.park_offloaded_prefills(kv, scheduler)
    if kv.activation is not None:
        kv.activation.end_iteration()
    if kv.lent is not None:
        shared_pool.attend(kv, scheduler)
        shared_pool.answer_reclaim(kv, allocator, tree, scheduler)
    busy = bool(up_sched.waiting(scheduler)) or bool(up_sched.admitted_reqs(scheduler))
    kv.shrink(allocator, spare_groups=kv.spare_groups if busy else 0, lazy=True)
    if kv.host is not None:
        slo.observe(kv, scheduler)
    if kv.lent is not None:
        shared_pool.balance(kv, allocator, tree, scheduler, demand.head_activation_chunks(kv, scheduler))
    if kv.host is not None:  # first: the head's prefill size depends on its parked KV being back
        host_buffer.fetch_parked(kv, scheduler, int(demand.decode_reserve_tokens(scheduler)))
        reopen_admission_for_offload(kv, scheduler)
    if kv.weights is not None:  # after the reclaims and borrows: the demand it sees is this iteration's
        sleep.step(kv, allocator, tree, scheduler)
        remap.step(kv, allocator, scheduler)
    hold_head_activation(kv, allocator, tree, scheduler)
    if busy:  # idle activation may back the premap only when no prefill waits to take it back
        kv.refill(allocator, premap_pages(kv, scheduler) + kv.spare_groups * kv.group_pages,
                  free_only=bool(up_sched.waiting(scheduler)),
                  keep_activation=demand.admitted_activation_chunks(kv, scheduler))  # fmt: skip
