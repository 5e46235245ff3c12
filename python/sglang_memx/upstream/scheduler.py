"""The scheduler (``sglang.srt.managers``): its state, batches, admission pass and the
actions memx takes on it (requeue, abort, release a request's KV).

Upstream names only through here (see ``manifest``).
"""

from __future__ import annotations

import contextlib
import functools
import types

from sglang_memx.upstream.manifest import resolve

ADDER_STATE_ATTR = "_memx"


# ------------------------------------------------------------------ scheduler state
def allocator(scheduler):
    return scheduler.token_to_kv_pool_allocator


def tp_cpu_group():
    """This process's tensor parallel ranks' CPU process group (gloo): memx's rank checks run on it."""
    return resolve("sglang.srt.distributed.parallel_state.get_tp_group")().cpu_group


def tree_cache(scheduler):
    return scheduler.tree_cache


def server_args(scheduler):
    return scheduler.server_args


def waiting(scheduler) -> list:
    return scheduler.waiting_queue


def running_batch(scheduler):
    return scheduler.running_batch


def running_reqs(scheduler) -> list:
    """Requests of the running (decode) batch."""
    return list(batch_reqs(scheduler.running_batch))


def chunked_req(scheduler):
    """The request whose chunked prefill is under way, or None."""
    return scheduler.chunked_req


def unmerged_prefill_batch(scheduler):
    """The last batch if it is a prefill batch not merged into the running batch yet, else None
    (upstream merges it inside ``get_next_batch_to_run``, after memx's tick)."""
    last = scheduler.last_batch
    if last is None or last is scheduler.running_batch or not last.forward_mode.is_extend():
        return None
    return last


def last_decode_batch(scheduler):
    """The batch the last iteration ran if it was a pure decode batch, else None (a prefill or
    mixed batch, or no batch: an idle iteration)."""
    last = scheduler.last_batch
    if last is None or not last.forward_mode.is_decode():
        return None
    return last


def last_batch_prefill_tokens(scheduler, decoded: int = 0) -> int:
    """Prompt tokens the last iteration's extend batch computed (``decoded``: the decode tokens a
    mixed batch counts among them); 0 without one."""
    last = scheduler.last_batch
    tokens = 0 if last is None else last.extend_num_tokens or 0
    return max(0, int(tokens) - decoded)


def last_batch_mode(scheduler) -> str | None:
    """What the last iteration ran: ``"decode"`` (a pure decode batch), ``"prefill"`` (an extend
    batch: the running requests got no token from it), ``"mixed"`` (prefill chunks beside their
    decode), or None (no batch: an idle iteration, or a mode that is neither)."""
    last = scheduler.last_batch
    if last is None:
        return None
    mode = last.forward_mode
    if mode.is_decode():
        return "decode"
    if mode.is_mixed():
        return "mixed"
    return "prefill" if mode.is_extend() else None


def admitted_reqs(scheduler) -> list:
    """Requests holding KV, unfinished, each once: the running batch, a prefill batch not
    merged into it yet, and a request whose chunked prefill is under way."""
    seen, out = set(), []
    groups = [batch_reqs(scheduler.running_batch), batch_reqs(scheduler.last_batch)]
    if scheduler.chunked_req is not None:
        groups.append([scheduler.chunked_req])
    for reqs in groups:
        for req in reqs:
            if id(req) in seen or req.finished():
                continue
            seen.add(id(req))
            out.append(req)
    return out


def page_size(scheduler) -> int:
    return scheduler.page_size


def chunked_prefill_size(scheduler) -> int | None:
    """Upstream's chunk size (None when chunked prefill is off)."""
    return scheduler.chunked_prefill_size


def prefill_token_budget(scheduler) -> int:
    """Input tokens one prefill batch may take (``--max-prefill-tokens``); upstream's admission
    stops adding requests once they are spent (the first request is admitted above it)."""
    return int(scheduler.max_prefill_tokens)


def logical_capacity_tokens(scheduler) -> int:
    return int(scheduler.max_total_num_tokens)


def new_token_ratio(scheduler) -> float:
    """The ratio upstream's admission applies to running requests' remaining decode."""
    return float(scheduler.new_token_ratio_tracker.current)


def cap_request_lengths(scheduler, max_len: int) -> bool:
    """Lower upstream's request length limits to ``max_len`` tokens; True if the input limit fell."""
    if scheduler.max_req_len > max_len - 1:
        scheduler.max_req_len = max_len - 1
    if scheduler.max_req_input_len > max_len - 6:
        scheduler.max_req_input_len = max_len - 6
        return True
    return False


def add_idle_wakeup(scheduler, fd: int) -> bool:
    """Make the scheduler's idle sleep (``--sleep-on-idle``) end when ``fd`` becomes readable;
    False when it has no zmq idle sleeper (sleep-on-idle off, or another kind)."""
    sleeper = scheduler.idle_sleeper
    if not isinstance(sleeper, resolve("sglang.srt.managers.scheduler_components.idle_sleeper.IdleSleeper")):
        return False
    import zmq

    sleeper.poller.register(fd, zmq.POLLIN)
    return True


def req_to_token_rows(scheduler):
    return scheduler.req_to_token_pool.req_to_token


def requeue_retracted(scheduler, req) -> None:
    """Put ``req`` back into the waiting queue the way upstream requeues a retracted request."""
    scheduler._add_request_to_queue(req, is_retracted=True)


def abort(scheduler, abort_req) -> None:
    scheduler.abort_request(abort_req)


def release_req_kv(scheduler, req) -> None:
    """Free ``req``'s KV the way retraction does (its cached prefix goes to the radix cache)."""
    release = resolve("sglang.srt.managers.schedule_batch.release_req")
    release(
        req=req,
        remaing_req_count=0,
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache,
        hisparse_coordinator=scheduler.hisparse_coordinator,
        offload_kv=False,
    )


# ------------------------------------------------------------------ status plumbing
def controller_scheduler(controller):
    """The scheduler of a ``SchedulerInternalStateController``."""
    return controller.scheduler


def add_internal_state(state_reply, name: str, section: dict) -> None:
    """Add ``section`` under ``name`` to a scheduler's internal-state answer."""
    state_reply.internal_state[name] = section


def set_request_args(set_req) -> dict:
    """The ``server_args`` numbers of a ``SetInternalStateReq`` (``/set_internal_state``)."""
    return set_req.server_args


def set_internal_state_reply(updated: bool):
    """Upstream's answer to a ``SetInternalStateReq``."""
    return resolve("sglang.srt.managers.io_struct.SetInternalStateReqOutput")(updated=updated)


def observer_allocator(observer):
    """The token allocator a ``SchedulerPoolStatsObserver`` reports on."""
    return observer.token_to_kv_pool_allocator


def pool_stats_capacity(stats) -> tuple[int, int]:
    """(capacity, evictable) tokens of a ``PoolStats`` (full pool)."""
    capacity = stats.full_num_used + stats.full_available_size + stats.full_evictable_size
    return capacity, stats.full_evictable_size


def pool_stats_fields(available: int, used: int, capacity: int) -> dict:
    """``PoolStats`` fields for these full-pool numbers (for ``dataclasses.replace``)."""
    return {
        "full_available_size": available,
        "full_num_used": used,
        "full_token_usage": used / capacity if capacity else 0.0,
    }


# ------------------------------------------------------------------ batches
def batch_reqs(batch) -> list:
    return [] if batch is None or batch.reqs is None else batch.reqs


def batch_allocator(batch):
    return batch.token_to_kv_pool_allocator


def batch_req_to_token_rows(batch):
    return batch.req_to_token_pool.req_to_token


def exclude_from_batch(batch, reqs) -> None:
    batch.filter_batch(reqs_to_exclude=reqs)


def admission_closed(batch) -> bool:
    return bool(batch.batch_is_full)


def request_slots_left(scheduler) -> int:
    """More requests upstream's request limits would admit now (``--max-running-requests``,
    request rows), KV memory aside."""
    return int(scheduler.get_num_allocatable_reqs(len(batch_reqs(scheduler.running_batch))))


def admission_closed_for_memory(scheduler) -> bool:
    """Upstream closed admission while request slots remain: the refusal was KV memory.
    (``batch_is_full`` is also set when the request limits are reached; that is no pressure.)"""
    batch = scheduler.running_batch
    return batch is not None and admission_closed(batch) and request_slots_left(scheduler) > 0


def reopen_admission(batch) -> None:
    """Upstream stops admitting after a refusal until a running request leaves; clear that."""
    batch.batch_is_full = False


# ------------------------------------------------------------------ the admission pass
def adder_state(adder) -> types.SimpleNamespace:
    """memx's state of one admission pass (a PrefillAdder lives for one pass)."""
    state = vars(adder).get(ADDER_STATE_ATTR)
    if state is None:
        state = types.SimpleNamespace(batch_tokens=0, behind_parked=False, offload_rest=0)
        setattr(adder, ADDER_STATE_ATTR, state)
    return state


def adder_allocator(adder):
    return adder.token_to_kv_pool_allocator


def adder_tree_cache(adder):
    return adder.tree_cache


def adder_budget(adder):
    return adder.memory_budget


def adder_admitted(adder, req) -> bool:
    """Whether the last ``add_one_req`` put ``req`` into this pass's batch."""
    return bool(adder.can_run_list) and adder.can_run_list[-1] is req


def adder_batch_size(adder) -> int:
    return len(adder.can_run_list)


def adder_batch_reqs(adder) -> list:
    """The requests decoding after this pass: the running batch's and those this pass added so far."""
    return [*batch_reqs(adder.running_batch), *adder.can_run_list]


def adder_running_reqs(adder) -> list:
    """The running batch's requests (decoding)."""
    return batch_reqs(adder.running_batch)


def adder_admitted_list(adder) -> list:
    """The requests this pass admitted so far (their prompts are not on the device yet)."""
    return list(adder.can_run_list)


def adder_running_count(adder) -> int:
    return len(batch_reqs(adder.running_batch))


def adder_page_size(adder) -> int:
    return adder.page_size


def adder_new_token_ratio(adder) -> float:
    """The ratio this pass applies to a running request's remaining decode (upstream's adaptive
    estimate of how much of ``max_new_tokens`` a request that may stop at EOS will generate)."""
    return float(adder.new_token_ratio)


def adder_chunk_room(adder) -> int | None:
    """Tokens left in this pass's chunk (None: not chunking)."""
    return adder.rem_chunk_tokens


def adder_input_room(adder) -> int:
    return adder.rem_input_tokens


def adder_has_chunked(adder) -> bool:
    """Whether this pass already started a chunked prefill (upstream tracks one at a time)."""
    return adder.new_chunked_req is not None


def add_result(name: str):
    """``AddReqResult.<name>`` (NO_TOKEN, CONTINUE, OTHER)."""
    return resolve("sglang.srt.managers.schedule_policy.AddReqResult")[name]


# ------------------------------------------------------------------ the prefill budget
def prefill_budget_class():
    return resolve("sglang.srt.mem_cache.prefill_budget.PrefillBudget")


def budget_offsets(budget) -> tuple[int, int]:
    """(total, current): tokens reserved against the pool for all admitted work, and now."""
    return int(budget.total_offset), int(budget.current_offset)


def budget_free(budget) -> int:
    """Free + evictable KV tokens the budget sees (before its offsets)."""
    return int(budget.remaining_current + budget.current_offset)


@functools.cache
def physical_budget_class():
    """Upstream's ``PrefillBudget`` with a physical mode (``physical_check``): while on, the total
    check counts what the device must hold now (the batch so far, the request's prompt and a
    decode headroom), not the running requests' reserved future decode nor the request's own,
    and the request reserves no decode tokens (its KV leaves after the prefill). Off, it is
    upstream's budget unchanged."""
    base = prefill_budget_class()

    class PhysicalPrefillBudget(base):
        physical = None  # (headroom, max_new) while a physical check runs

        @property
        def remaining_total(self):
            if self.physical is None:
                return super().remaining_total
            headroom, max_new = self.physical
            return self.remaining_current - headroom + max_new

        def reserve(self, extend_input_len, max_new_tokens, **kwargs):
            if self.physical is not None:
                max_new_tokens = 0
            return super().reserve(extend_input_len, max_new_tokens, **kwargs)

    return PhysicalPrefillBudget


def new_physical_budget(allocator, tree, num_mixed_decode_tokens: int):
    return physical_budget_class()(allocator, tree, num_mixed_decode_tokens=num_mixed_decode_tokens)


def is_physical_budget(budget) -> bool:
    return isinstance(budget, physical_budget_class())


@contextlib.contextmanager
def physical_check(budget, headroom: int, max_new: int):
    """Run upstream's admission of one request against the device's physical room only."""
    budget.physical = (headroom, max_new)
    try:
        yield budget
    finally:
        budget.physical = None
