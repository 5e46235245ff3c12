"""Upstream subsystem: scheduler (``sglang.srt.managers``).

* ``SchedulerInternalStateController.get_internal_state`` (after): adds a ``memx``
  section (``sglang_memx.status``) to the internal state the scheduler already sends to
  the HTTP process on request, so /memx/status needs no new IPC channel.
* ``SchedulerInternalStateController.set_internal_state`` (around): the router's activity
  (``POST /memx/activity``) reaches the scheduler as ``memx_activity_*`` numbers of
  upstream's own request (``sglang_memx.router_activity``), a new TPOT SLO (``POST /memx/slo``) as
  ``memx_slo_tpot_ms`` (``sglang_memx.slo_update``); other keys go to upstream.
* ``Scheduler.get_next_batch_to_run`` (before): memx's steps of one loop iteration
  (``coordinator.tick.per_iteration``: the coordinator's iteration order); the
  first one checks that the hooks of every feature on are in force in this process.
* ``PrefillAdder.add_one_req`` (around): memx's admission rule in front of upstream's
  (``elastic.admission``: one eLLM Alg. 1 question per request, ``judge_prefill``, whose
  verdict it acts on: on the device with ballooning, offloaded to the CPU buffer, or deferred);
  with ``--memx-tpot-slo-ms``, the governor's batch decision before it
  (``coordinator.governor``: a request that would push the running batch's predicted TPOT
  past the SLO waits).
* ``PrefillAdder.add_chunked_req`` (around): a chunked prefill's next chunk holds its
  activation; an offloaded prefill's chunks are sized by the physical room.
* ``ScheduleBatch.release_req`` (around): with ``--memx-host-buffer-gb``, a request being
  retracted has its KV copied to the host buffer before upstream frees it.
* ``Scheduler.abort_request`` (after): an abort for an offloaded prefill in limbo is
  remembered and replayed once the request is back in the queue.
* ``SchedulerPoolStatsObserver._get_token_info`` (after): with elastic KV the pool
  statistics (log lines, metrics, load reports and the idle leak check) count the pages
  of unmapped groups as free: free logical pages, merely unbacked. Admission does not
  read these statistics; it asks the allocator, whose ``available_size`` is physical.
"""

from __future__ import annotations

import dataclasses
import logging

from sglang_memx import router_activity, slo_update
from sglang_memx.coordinator import device
from sglang_memx.coordinator.components import ActivationBalloonPart, HostBufferPart
from sglang_memx.coordinator.governor import GovernorPart
from sglang_memx.coordinator.tick import per_iteration
from sglang_memx.elastic import admission, host_buffer
from sglang_memx.hooks import hooks_status
from sglang_memx.status import scheduler_status
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.upstream import server_args as up_args
from sglang_memx.upstream.registry import HookSpec

logger = logging.getLogger("sglang_memx")


def after_get_internal_state(result, controller, recv_req):
    scheduler = up_sched.controller_scheduler(controller)
    config = up_args.config_of(up_sched.server_args(scheduler))
    if config.disabled:
        return result
    try:
        section = scheduler_status(scheduler, config, hooks_status(config))
    except Exception as exc:  # never break upstream's /server_info
        logger.exception("memx: could not collect scheduler status")
        section = {"error": f"{type(exc).__name__}: {exc}"}
    up_sched.add_internal_state(result, "memx", section)
    return result


def around_set_internal_state(original, controller, recv_req):
    """``POST /memx/activity`` arrives as memx's own ``memx_activity_*`` numbers, ``POST /memx/slo`` as
    ``memx_slo_tpot_ms``; anything else is upstream's."""
    numbers = up_sched.set_request_args(recv_req)
    if slo_update.is_update(numbers):
        allocator = up_sched.allocator(up_sched.controller_scheduler(controller))
        try:
            applied = slo_update.apply(device.of(allocator), slo_update.from_wire(numbers))
        except ValueError:  # the HTTP process checked it already; never break upstream's request loop
            logger.exception("memx: malformed SLO update")
            applied = False
        return up_sched.set_internal_state_reply(applied)
    if not router_activity.is_activity(numbers):
        return original(controller, recv_req)
    try:
        router_activity.receive(numbers)
    except ValueError:  # the HTTP process checked it already; never break upstream's request loop
        logger.exception("memx: malformed router activity")
        return up_sched.set_internal_state_reply(False)
    return up_sched.set_internal_state_reply(True)


_verified = False


def before_get_next_batch_to_run(scheduler, *args, **kwargs):
    global _verified
    if not _verified:
        from sglang_memx.hooks import verify_hooks

        verify_hooks(up_args.config_of(up_sched.server_args(scheduler)))
        _verified = True
    per_iteration(scheduler)


def around_add_one_req(original, adder, req, has_chunked_req, truncation_align_size):
    coordinator = device.of(up_sched.adder_allocator(adder))
    governor = None if coordinator is None else coordinator.part(GovernorPart)
    if governor is not None:  # the TPOT SLO's batch decision first: a refused request waits
        refused = admission.governor_refusal(governor, adder, req)
        if refused is not None:
            return refused
    if coordinator is None or (
        coordinator.part(ActivationBalloonPart) is None and coordinator.part(HostBufferPart) is None
    ):
        return original(adder, req, has_chunked_req, truncation_align_size)
    activation, host, lent = coordinator.activation_side(), coordinator.host_buffer(), coordinator.borrow_pool()
    return admission.add_one(original, adder, req, has_chunked_req, truncation_align_size, activation, host, lent,
                             governor)  # fmt: skip


def around_add_chunked_req(original, adder, req):
    coordinator = device.of(up_sched.adder_allocator(adder))
    if coordinator is None:
        return original(adder, req)
    return admission.add_chunk(original, adder, req, coordinator.activation_side(), coordinator.borrow_pool())


def around_release_req(original, batch, idx, remaing_req_count, offload_kv=True):
    coordinator = device.of(up_sched.batch_allocator(batch))
    host = None if coordinator is None else coordinator.host_buffer()
    if host is not None and offload_kv:
        try:
            host_buffer.park_kv(host, up_sched.batch_reqs(batch)[idx],
                                up_sched.batch_req_to_token_rows(batch), up_sched.batch_allocator(batch))  # fmt: skip
        except Exception:  # the request is then recomputed, as in stock SGLang
            logger.exception("memx: could not park a retracted request's KV")
    return original(batch, idx, remaing_req_count, offload_kv)


def after_abort_request(result, scheduler, recv_req):
    coordinator = device.of(up_sched.allocator(scheduler))
    host = None if coordinator is None else coordinator.host_buffer()
    if host is not None:
        host_buffer.remember_abort(host, recv_req)
    return result


def after_get_token_info(result, observer):
    allocator = up_sched.observer_allocator(observer)
    coordinator = device.of(allocator)
    if coordinator is None:
        return result
    capacity, evictable = up_sched.pool_stats_capacity(result)
    available = coordinator.kv.logical_free_pages(allocator) * up_kv.page_size(allocator)
    used = capacity - available - evictable
    return dataclasses.replace(result, **up_sched.pool_stats_fields(available, used, capacity))


_S = "sglang.srt.managers."
HOOKS = (
    HookSpec(_S + "scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
             "after", after_get_internal_state, "status_endpoint", "report live pool numbers from the scheduler"),
    HookSpec(_S + "scheduler_components.internal_state.SchedulerInternalStateController.set_internal_state",
             "around", around_set_internal_state, "status_endpoint",
             "receive the router's activity (POST /memx/activity) and a TPOT SLO (POST /memx/slo) in the scheduler"),
    HookSpec(_S + "scheduler.Scheduler.get_next_batch_to_run", "before", before_get_next_batch_to_run, "elastic_kv",
             "elastic KV housekeeping once per iteration (reclaims, deflation, borrowing, premapping)"),
    HookSpec(_S + "schedule_policy.PrefillAdder.add_one_req", "around", around_add_one_req, "elastic_kv",
             "eLLM Alg. 1: admit a request only if its KV and the batch's activation fit, else offload or wait"),
    HookSpec(_S + "schedule_policy.PrefillAdder.add_chunked_req", "around", around_add_chunked_req, "elastic_kv",
             "eLLM ballooning: a chunked prefill's next chunk holds its activation"),
    HookSpec(_S + "scheduler.Scheduler.abort_request", "after", after_abort_request, "host_buffer",
             "an abort for an offloaded prefill between batches is replayed, not lost"),
    HookSpec(_S + "schedule_batch.ScheduleBatch.release_req", "around", around_release_req, "host_buffer",
             "park a retracted request's KV on the host before upstream frees it"),
    HookSpec(_S + "scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver._get_token_info", "after",
             after_get_token_info, "elastic_kv", "count unmapped KV groups as free logical pages in pool stats"),
)  # fmt: skip
