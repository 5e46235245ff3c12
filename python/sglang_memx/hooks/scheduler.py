"""Upstream subsystem: scheduler (``sglang.srt.managers``).

* ``SchedulerInternalStateController.get_internal_state`` (after): adds a
  ``memx`` section with live pool numbers to the internal state the scheduler
  already sends to the HTTP process on request, so /memx/status needs no new
  IPC channel.
* ``Scheduler.get_next_batch_to_run`` (before): one elastic-KV ``tick`` per
  loop iteration (reclaims, deflation, borrowing; ``elastic.driver``).
* ``PrefillAdder.add_one_req`` (around): with elastic KV, the batch being
  formed reserves its activation chunks first (``reserve_activation``: FREE,
  then idle KV); if they cannot be had the request waits (``NO_TOKEN``), so
  upstream's KV check that follows sees what is left after activations.
  With ``--memx-host-buffer-gb``, a new request upstream refuses for want of
  KV room is admitted as an offloaded prefill if its prompt fits the device
  now and its KV fits the host buffer (eLLM Alg. 1's CPU-buffer branch;
  parked after its prefill by ``elastic.host_buffer``); a request parked on
  the host that cannot resume yet lets later requests prefill into the buffer.
* ``PrefillAdder.add_chunked_req`` (around): the next chunk of a chunked
  prefill reserves its activation too (held since the tick; it cannot wait).
* ``ScheduleBatch.release_req`` (around): with ``--memx-host-buffer-gb``, a
  request being retracted has its KV copied to the host buffer before
  upstream frees it (``elastic.host_buffer``).
* ``Scheduler.abort_request`` (after): an abort for an offloaded prefill in
  limbo (between its prefill batch and the waiting queue) is remembered and
  replayed once the request is back in the queue.
* ``SchedulerPoolStatsObserver._get_token_info`` (after): with elastic KV the pool
  statistics (log lines, metrics, load reports and the idle leak check) count
  the pages of unmapped groups as free: they are free logical pages, merely
  unbacked. Admission does not read these statistics; it asks the allocator,
  whose ``available_size`` is physical (see ``hooks.kv_cache``).
"""

from __future__ import annotations

import logging

from sglang_memx.hooks import HookSpec
from sglang_memx.runtime import config_of
from sglang_memx.status import scheduler_status

logger = logging.getLogger("sglang_memx")


def after_get_internal_state(result, controller, *args, **kwargs):
    scheduler = controller.scheduler
    config = config_of(getattr(scheduler, "server_args", None))
    if config.disabled:
        return result
    try:
        result.internal_state["memx"] = scheduler_status(scheduler, config)
    except Exception as exc:  # never break upstream's /server_info
        logger.exception("memx: could not collect scheduler status")
        result.internal_state["memx"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def before_get_next_batch_to_run(scheduler, *args, **kwargs):
    from sglang_memx.elastic.driver import tick

    tick(scheduler)
    return None


def after_get_token_info(result, observer, *args, **kwargs):
    allocator = getattr(observer, "token_to_kv_pool_allocator", None)
    kv = getattr(allocator, "_memx_elastic", None)
    if kv is None:
        return result
    import dataclasses

    capacity = result.full_num_used + result.full_available_size + result.full_evictable_size
    available = kv.logical_free_pages(allocator) * allocator.page_size
    used = capacity - available - result.full_evictable_size
    return dataclasses.replace(
        result, full_available_size=available, full_num_used=used, full_token_usage=used / capacity if capacity else 0.0
    )


def _next_chunk_tokens(adder, req) -> int:
    """Tokens ``req`` would prefill in this batch: the rest of its input, at most the chunk left."""
    tokens = len(req.full_untruncated_fill_ids) - req.prefix_len
    if adder.rem_chunk_tokens is not None:
        tokens = min(tokens, max(int(adder.rem_chunk_tokens), 1))
    return max(tokens, 1)


def _decode_headroom(adder) -> int:
    """Device room an offloaded prefill leaves: one page per running request and one for itself."""
    return adder.page_size * (len(adder.running_batch.reqs) + 1)


def _admitted(adder, req) -> bool:
    return bool(adder.can_run_list) and adder.can_run_list[-1] is req


def around_add_one_req(original, adder, req, *args, **kwargs):
    """Admit ``req`` only if the batch's activation fits together with its KV (eLLM Alg. 1); with a
    host buffer, a request refused for want of KV may prefill with its KV going to the host."""
    allocator = getattr(adder, "token_to_kv_pool_allocator", None)
    kv = getattr(allocator, "_memx_elastic", None)
    if kv is None or (kv.activation is None and kv.host is None):
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_memx.elastic.driver import reserve_activation

    live_before = None
    if kv.activation is not None:
        admitted = list(adder.can_run_list)
        tokens = _next_chunk_tokens(adder, req) + sum(int(getattr(r, "extend_input_len", 0) or 0) for r in admitted)
        live_before = kv.activation.live
        # no eviction here: queued requests hold unlocked prefix matches (tick evicts for the head)
        if not reserve_activation(kv, allocator, None, tokens, len(admitted) + 1):
            kv.activation.stats["deferred_requests"] += 1
            return AddReqResult.NO_TOKEN
    host = kv.host
    from sglang_memx.elastic.host_buffer import note_admitted, offload_eligible

    if host is not None and getattr(adder, "_memx_behind_parked", False) and offload_eligible(req):
        result = AddReqResult.NO_TOKEN  # first come, first served: a request parked on the host is ahead
    else:
        result = original(adder, req, *args, **kwargs)
    if host is not None and result == AddReqResult.NO_TOKEN and not _admitted(adder, req):
        result = _offload_at_admission(original, adder, req, kv, args, kwargs)
    if not _admitted(adder, req):
        if live_before is not None:
            kv.activation.live = live_before  # not admitted: its share goes back to idle (KV may take it)
    elif host is not None:
        note_admitted(kv, req, adder.tree_cache)
    return result


class _PhysicalBudget:
    """While admitting an offloaded prefill, upstream's budget checks only what the device must
    hold now: the batch so far, this prompt and one decode step of the running requests, not
    their reserved future decode tokens nor this request's (its KV leaves after the prefill).
    Afterwards the budget keeps its reservations plus what this admission allocates now."""

    def __init__(self, budget, max_new: int, headroom: int):
        self.budget, self.max_new, self.headroom = budget, max_new, headroom

    def __enter__(self):
        self.total, self.current = self.budget.total_offset, self.budget.current_offset
        self.budget.total_offset = self.current + self.headroom - self.max_new
        return self

    def __exit__(self, *exc):
        self.budget.total_offset = self.total + (self.budget.current_offset - self.current)
        return False


def _offload_at_admission(original, adder, req, kv, args, kwargs):
    """eLLM Alg. 1's CPU-buffer branch for a request upstream refused (``NO_TOKEN``)."""
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    from sglang_memx.elastic.driver import remaining_new_tokens
    from sglang_memx.elastic.host_buffer import mark_offloaded, offload_bytes, offload_eligible

    host = kv.host
    if req.rid in host.buffer:  # prefilled already, waiting on the host for room to decode
        adder._memx_behind_parked = True
        return AddReqResult.CONTINUE  # requests behind it may still prefill into the buffer
    has_chunked = kwargs.get("has_chunked_req", args[0] if args else False) or adder.new_chunked_req is not None
    if has_chunked or not offload_eligible(req) or type(adder.memory_budget) is not PrefillBudget:
        return AddReqResult.NO_TOKEN  # (upstream tracks one chunked prefill at a time)
    nbytes = offload_bytes(req, adder.token_to_kv_pool_allocator)
    if nbytes > host.offload_room():
        host.offload["offload_no_room"] += 1
        return AddReqResult.NO_TOKEN
    max_new = remaining_new_tokens(req)
    headroom = _decode_headroom(adder)
    with _PhysicalBudget(adder.memory_budget, max_new, headroom):
        original(adder, req, *args, **kwargs)
    if not _admitted(adder, req):
        return AddReqResult.NO_TOKEN
    mark_offloaded(kv, req, nbytes)
    if adder.rem_input_tokens <= 0 or (adder.rem_chunk_tokens is not None and adder.rem_chunk_tokens <= 0):
        return AddReqResult.OTHER
    return AddReqResult.CONTINUE if adder.memory_budget.remaining_current > headroom else AddReqResult.NO_TOKEN


def around_add_chunked_req(original, adder, req, *args, **kwargs):
    """The next chunk of a chunked prefill makes its activation live (held since the tick), so
    KV cannot take it; it cannot wait (it holds KV), so a shortfall is only counted."""
    kv = getattr(getattr(adder, "token_to_kv_pool_allocator", None), "_memx_elastic", None)
    if kv is not None and kv.activation is not None:
        from sglang_memx.elastic.driver import reserve_activation

        if not reserve_activation(kv, adder.token_to_kv_pool_allocator, None, _next_chunk_tokens(adder, req), 1):
            kv.activation.stats["overcommitted_chunks"] += 1
    if kv is not None and getattr(req, "_memx_offload_bytes", 0):
        # an offloaded prefill's chunks are sized by what the device holds now, like its admission
        headroom = _decode_headroom(adder)
        with _PhysicalBudget(adder.memory_budget, 0, headroom):
            return original(adder, req, *args, **kwargs)
    return original(adder, req, *args, **kwargs)


def around_release_req(original, batch, idx, *args, **kwargs):
    """A request being retracted (``offload_kv`` true): park its KV in the host buffer first."""
    kv = getattr(batch.token_to_kv_pool_allocator, "_memx_elastic", None)
    offload = kwargs.get("offload_kv", args[1] if len(args) > 1 else True)
    if kv is not None and kv.host is not None and offload:
        from sglang_memx.elastic.host_buffer import park_kv

        try:
            park_kv(kv, batch.reqs[idx], batch.req_to_token_pool, batch.token_to_kv_pool_allocator)
        except Exception:  # the request is then recomputed, as in stock SGLang
            logger.exception("memx: could not park a retracted request's KV")
    return original(batch, idx, *args, **kwargs)


def after_abort_request(result, scheduler, recv_req, *args, **kwargs):
    """An abort for an offloaded prefill in limbo (in no batch and not in the queue, for one
    tick) would be missed; remember it, to be replayed once the request is back in the queue."""
    kv = getattr(getattr(scheduler, "token_to_kv_pool_allocator", None), "_memx_elastic", None)
    host = getattr(kv, "host", None)
    if host is not None:
        for req in host.limbo:
            if recv_req.abort_all or req.rid.startswith(recv_req.rid):
                req._memx_pending_abort = recv_req
    return result


HOOKS = (
    HookSpec(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        "after",
        after_get_internal_state,
        expects=("self", "recv_req"),
        why="report live KV pool numbers from the scheduler process",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        "before",
        before_get_next_batch_to_run,
        expects=("self",),
        why="elastic KV: answer reclaims, deflate, borrow once per iteration",
    ),
    HookSpec(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        "around",
        around_add_one_req,
        expects=("self", "req"),
        why="eLLM ballooning: admit a request only if KV and activation fit",
    ),
    HookSpec(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
        "around",
        around_add_chunked_req,
        expects=("self", "req"),
        why="eLLM ballooning: a chunked prefill's next chunk holds its activation",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler.abort_request",
        "after",
        after_abort_request,
        expects=("self", "recv_req"),
        why="host buffer: an abort for an offloaded prefill between batches is replayed, not lost",
    ),
    HookSpec(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.release_req",
        "around",
        around_release_req,
        expects=("self", "idx", "remaing_req_count", "offload_kv"),
        why="host buffer: park a retracted request's KV before upstream frees it",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver._get_token_info",
        "after",
        after_get_token_info,
        expects=("self",),
        why="count unmapped KV groups as free logical pages in pool stats",
    ),
)
