"""Once per scheduler iteration: answer reclaims, give idle memory back, borrow for the queue.

``tick`` runs on the scheduler thread before upstream picks the next batch.

* Reclaim (shared pool): the chunks the arbiter asked for are answered here,
  on the scheduler thread: FREE chunks first, then by evicting cached
  prefixes (radix cache, LRU) until enough groups empty, which are unmapped
  and returned.
* Deflation: mapped groups whose pages are all free are unmapped (keeping
  ``spare_groups``); with a shared pool their chunks go back to the arbiter
  as soon as nothing waits, except what running requests may still decode
  into, so an idle server holds only what its cached prefixes use.
* Borrowing (shared pool): if the waiting queue plus the running requests'
  remaining decode need more tokens than are free, evictable or growable, the
  shortfall (in whole groups, up to the logical capacity) is borrowed. A
  refusal backs off (``borrow_tokens``); requests then wait in the queue
  (upstream's admission sees the real free memory), never fail. The decode
  path borrows only what the arbiter has free at once, never waiting.
* Host buffer (``--memx-host-buffer-gb``, ``elastic.host_buffer``): first,
  offloaded prefills leave the last prefill batch and are parked once their
  first token is in; last, the first parked request's KV is fetched and
  pinned when its reservation fits, and admission is reopened while the
  buffer has room for new prefills.
"""

from __future__ import annotations

import logging
import time

from memory_ext.pool import Owner
from sglang_memx.elastic.host_buffer import fetch_parked, observe_slos, offload_eligible, park_offloaded_prefills

logger = logging.getLogger("sglang_memx")

BORROW_BACKOFF_S = 0.5
BORROW_BACKOFF_MAX_S = 1.0
QUEUE_WAIT_S = 0.02  # longest a scheduler iteration waits for a grant for its queue
URGENT_WAIT_S = 0.5  # ... for a decode step that would otherwise retract
MAX_NEW_CLIP = 4096  # upstream's default SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION


def _evictable(tree_cache) -> int:
    try:
        return int(tree_cache.evictable_size())
    except Exception:
        return 0


def _evict(tree_cache, tokens: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    if tokens <= 0 or tree_cache is None or not tree_cache.supports_prefix_sharing():
        return 0
    result = tree_cache.evict(EvictParams(num_tokens=tokens))
    return int(getattr(result, "num_tokens_evicted", 0) or 0)


def _admitted_requests(scheduler) -> list:
    """Requests holding KV: the running batch, a prefill batch not merged into it yet
    (upstream merges the last prefill batch inside ``get_next_batch_to_run``, after our tick)
    and a request whose chunked prefill is under way."""
    seen, out = set(), []
    chunked = getattr(scheduler, "chunked_req", None)
    groups = [
        list(getattr(getattr(scheduler, name, None), "reqs", None) or []) for name in ("running_batch", "last_batch")
    ] + [[chunked] if chunked is not None else []]
    for reqs in groups:
        for req in reqs:
            finished = getattr(req, "finished", None)
            if id(req) in seen or (callable(finished) and finished()):
                continue
            seen.add(id(req))
            out.append(req)
    return out


def running_demand_tokens(scheduler) -> int:
    """Tokens the admitted requests still need: the rest of a chunked prompt and their remaining
    max_new_tokens (prompt + max_new minus what is allocated, or minus prompt + output so far)."""
    demand = 0
    for req in _admitted_requests(scheduler):
        max_new = int(getattr(getattr(req, "sampling_params", None), "max_new_tokens", None) or 0)
        prompt = len(getattr(req, "origin_input_ids", ()) or ())
        done = prompt + len(getattr(req, "output_ids", ()) or ())
        allocated = getattr(getattr(req, "kv", None), "kv_allocated_len", None)
        if isinstance(allocated, int) and allocated < prompt:  # chunked prefill under way
            done = allocated
        demand += max(0, prompt + max_new - done)
    return demand


def remaining_new_tokens(req) -> int:
    """A request's remaining max_new_tokens, clipped the way upstream's admission estimates it."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    return min(max(int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)


def decode_reserve_tokens(scheduler) -> float:
    """What upstream's admission reserves for the running requests' remaining decode: each one's
    remaining max_new_tokens (clipped) times the current new-token ratio."""
    batch = getattr(scheduler, "running_batch", None)
    tracker = getattr(scheduler, "new_token_ratio_tracker", None)
    ratio = float(getattr(tracker, "current", 1.0))
    return sum(
        remaining_new_tokens(req) * (1.0 if getattr(req.sampling_params, "ignore_eos", False) else ratio)
        for req in list(getattr(batch, "reqs", None) or [])
    )


def reopen_admission_for_offload(kv, scheduler) -> None:
    """Upstream stops trying to admit after a refusal until a running request leaves
    (``batch_is_full``); with room in the host buffer a new request may still prefill there."""
    batch = getattr(scheduler, "running_batch", None)
    if (
        batch is not None
        and batch.batch_is_full
        and kv.host.offload_room() > 0
        and any(offload_eligible(r) for r in getattr(scheduler, "waiting_queue", []))
    ):
        batch.batch_is_full = False


def decode_activation_chunks(kv, scheduler) -> int:
    """Activation chunks one decode step of the admitted requests needs (0 without ballooning)."""
    if kv.activation is None or scheduler is None:
        return 0
    n = len(_admitted_requests(scheduler))
    return kv.activation.need_chunks(n, n)


def spare_free_chunks(kv, allocator, scheduler) -> int:
    """FREE chunks not needed for the running requests' remaining decode (those may go back).

    A running request was admitted against memory counted as available; giving that memory
    away would make its later decode steps fail (upstream then retracts or aborts it).
    """
    need = running_demand_tokens(scheduler) - kv.free_page_count(allocator) * kv.page_size
    keep = -(-max(0, need) // kv.buffers.group_rows) * kv.buffers.chunks_per_group
    if kv.activation is not None:  # and their decode steps' activation
        keep += max(0, decode_activation_chunks(kv, scheduler) - kv.activation.held)
    return max(0, kv.buffers.pool.usage()[Owner.FREE] - keep)


def queue_demand_tokens(scheduler) -> int:
    """Tokens the head of the waiting queue and the running requests' remaining decode would need.

    Only the head request counts from the queue: admission is first come, first served, so
    memory for it is what unblocks progress; the next ones are borrowed for on later ticks.
    """
    demand = 0
    for req in list(getattr(scheduler, "waiting_queue", []))[:1]:
        max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None) or 0
        # upstream admits a request only if input + max_new (clipped) + one page is strictly
        # below what is free and evictable; ask for exactly that much
        demand += (
            len(getattr(req, "origin_input_ids", ()) or ())
            + min(int(max_new), MAX_NEW_CLIP)
            + int(getattr(scheduler, "page_size", 1))
            + 1
        )
    return demand + running_demand_tokens(scheduler)


def head_prefill_tokens(scheduler) -> int:
    """Tokens of the next prefill chunk: of the request whose chunked prefill is under way,
    else of the waiting head request (0 if nothing waits)."""
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        allocated = getattr(getattr(chunked, "kv", None), "kv_allocated_len", 0) or 0
        tokens = max(1, len(getattr(chunked, "origin_input_ids", ()) or ()) - int(allocated))
    else:
        head = list(getattr(scheduler, "waiting_queue", []))[:1]
        if not head:
            return 0
        req = head[0]
        tokens = len(getattr(req, "origin_input_ids", ()) or ()) + len(getattr(req, "output_ids", ()) or ())
        kv = getattr(getattr(scheduler, "token_to_kv_pool_allocator", None), "_memx_elastic", None)
        host = getattr(kv, "host", None)
        entry = host.buffer.peek(req.rid) if host is not None else None
        if entry is not None and req.rid in host.pins:  # its parked KV is back and pinned: a cached prefix
            tokens = max(1, tokens - len(entry))
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    return min(tokens, chunk) if chunk and chunk > 0 else tokens


def activation_demand_tokens(kv, scheduler) -> int:
    """The head request's prefill activation, in KV-token equivalents of pool memory.

    All of it, held or not: the allocator's ``available_size`` counts idle activation chunks
    as growable KV, and the head's prefill will make them live again.
    """
    tokens = head_prefill_tokens(scheduler)
    if kv.activation is None or tokens <= 0:
        return 0
    return -(-kv.activation.need_chunks(tokens, 1) // kv.buffers.chunks_per_group) * kv.buffers.group_rows


def prepare_head_activation(kv, allocator, tree_cache, scheduler) -> None:
    """Before batch selection (no prefix match is pending yet, so evicting cached prefixes is
    safe): hold the head request's prefill activation, so that a server whose memory is all
    cached prefixes still admits it. The chunks stay idle until the batch reserves them."""
    tokens = head_prefill_tokens(scheduler)
    if kv.activation is None or tokens <= 0:
        return
    reserve_activation(kv, allocator, tree_cache, tokens, 1)
    kv.activation.end_iteration()


def borrow_tokens(kv, tokens: int, *, may_wait: bool = True, urgent: bool = False) -> int:
    """Borrow enough whole groups for ``tokens`` more tokens (shared pool only); return groups borrowed.

    ``may_wait=False`` takes only what the arbiter has free right now. ``may_wait=True`` may
    make the arbiter reclaim from other servers; the scheduler waits for the grant at most
    ``QUEUE_WAIT_S`` (``URGENT_WAIT_S`` when ``urgent``: a decode step that would otherwise
    retract), and a grant that comes later lands in the pool for the next iteration (see
    ``LentPool.borrow``): a scheduler never blocks on another server. After a refusal it backs
    off, doubling from ``BORROW_BACKOFF_S`` up to ``BORROW_BACKOFF_MAX_S`` (``urgent`` ignores
    the back-off); a grant resets it.
    """
    lent = kv.lent
    if lent is None or tokens <= 0:
        return 0
    now = time.monotonic()
    if not urgent and now < kv.borrow_backoff_until:
        return 0
    unmapped = kv.num_groups - kv.buffers.num_mapped - kv.affordable_groups()
    groups = min(-(-tokens // kv.buffers.group_rows), max(0, unmapped))
    cpg = kv.buffers.chunks_per_group
    if not may_wait:
        groups = min(groups, lent.available_now() // cpg)
    if groups <= 0:
        return 0
    wait = URGENT_WAIT_S if urgent else QUEUE_WAIT_S
    got = groups if lent.borrow(groups * cpg, wait=wait) else 0
    if not got and may_wait:
        fewer = min(groups - 1, lent.last_denied_available // cpg)  # take what can be had now
        got = fewer if fewer > 0 and lent.borrow(fewer * cpg, wait=wait) else 0
    if got:
        kv.borrow_backoff_s = BORROW_BACKOFF_S
    elif may_wait:
        delay = kv.borrow_backoff_s or BORROW_BACKOFF_S
        kv.borrow_backoff_until = now + delay
        kv.borrow_backoff_s = min(BORROW_BACKOFF_MAX_S, delay * 2)
    return got


def free_groups(kv, allocator, tree_cache, groups: int) -> int:
    """Unmap up to ``groups`` free KV groups into FREE, evicting cached prefixes (LRU) as needed.

    Cached pages of one group may be spread over the LRU order, so eviction continues until
    enough whole groups are empty (or nothing evictable is left). Returns groups unmapped.
    """
    freed = kv.shrink(allocator, max_groups=groups, spare_groups=0)
    while freed < groups and _evict(tree_cache, (groups - freed) * kv.buffers.group_rows) > 0:
        freed += kv.shrink(allocator, max_groups=groups - freed, spare_groups=0)
    return freed


def reserve_activation(kv, allocator, tree_cache, tokens: int, seqs: int, *, urgent: bool = False) -> bool:
    """eLLM Alg. 1 for one batch: its activation chunks, from FREE, then idle KV (lazy deflation).

    With a shared pool a shortfall is then borrowed: what the arbiter has free now, or, when
    ``urgent`` (a decode step that would otherwise retract), letting it reclaim from peers.
    False: the batch does not fit with its activation; nothing was taken.
    """
    balloon = kv.activation
    if balloon is None or tokens <= 0:
        return True
    cpg = kv.buffers.chunks_per_group

    def kv_idle() -> int:  # tree_cache None: free groups only, nothing evicted
        empty = len(kv.empty_groups(allocator))
        evictable = _evictable(tree_cache) if tree_cache is not None else 0
        return (empty + evictable // kv.buffers.group_rows) * cpg

    def deflate(chunks: int) -> int:
        return free_groups(kv, allocator, tree_cache, -(-chunks // cpg)) * cpg

    if balloon.reserve(tokens, seqs, kv_idle, deflate):
        return True
    if kv.lent is None:
        return False
    # shared pool: borrow the shortfall (urgent: the arbiter may reclaim from idle peers), retry once
    short = balloon.need_chunks(tokens, seqs) - balloon.held - kv.buffers.pool.available()
    groups = -(-max(short, 1) // cpg)
    if not borrow_tokens(kv, groups * kv.buffers.group_rows, may_wait=urgent, urgent=urgent):
        return False
    return balloon.reserve(tokens, seqs, kv_idle, deflate)


def answer_reclaim(kv, allocator, tree_cache, scheduler=None) -> int:
    """Free and return the chunks the arbiter asked for (idle activation, free groups, then
    cached prefixes); return how many chunks went back."""
    lent = kv.lent
    pending = lent.take_pending_reclaim() if lent is not None else 0
    if pending <= 0:
        return 0
    if kv.activation is not None:  # idle activation memory is the cheapest to give
        kv.activation.release_idle(keep=decode_activation_chunks(kv, scheduler))
    free_groups(kv, allocator, tree_cache, -(-pending // kv.buffers.chunks_per_group))
    spare = spare_free_chunks(kv, allocator, scheduler) if scheduler is not None else pending
    return lent.give_back(min(pending, spare))  # never what running requests will decode into


def physical_max_tokens(kv) -> int:
    """The most tokens this server can ever back: its whole budget (own pool or shared pool)."""
    budget = kv.lent.budget_chunks if kv.lent is not None else kv.buffers.pool.capacity_chunks
    if kv.activation is not None:  # the largest prefill batch's activation shares the budget
        budget -= kv.activation.need_chunks(kv.activation.max_batch_tokens, 1)
    groups = min(kv.num_groups, max(0, budget) // kv.buffers.chunks_per_group)
    return groups * kv.buffers.group_rows - kv.page_size  # page 0 is never allocatable


def cap_request_lengths(scheduler, kv) -> None:
    """Refuse (with upstream's own length error) requests that could never fit the physical budget."""
    if kv.lengths_capped:
        return
    cap = physical_max_tokens(kv)
    if hasattr(scheduler, "max_req_len") and scheduler.max_req_len > cap - 1:
        scheduler.max_req_len = cap - 1
    if hasattr(scheduler, "max_req_input_len") and scheduler.max_req_input_len > cap - 6:
        scheduler.max_req_input_len = cap - 6
        logger.info("memx: requests are limited to %d input tokens by the physical KV budget", cap - 6)
    kv.lengths_capped = True


def balance_shared_pool(kv, allocator, tree_cache, scheduler) -> None:
    """Shared pool: give unused chunks back when nothing waits, borrow the queue's shortfall."""
    demand = queue_demand_tokens(scheduler) + activation_demand_tokens(kv, scheduler)
    if not getattr(scheduler, "waiting_queue", None):  # nothing waits: unused chunks go back
        if kv.activation is not None:  # keep what the running requests' decode steps need
            kv.activation.release_idle(keep=decode_activation_chunks(kv, scheduler))
        kv.lent.give_back(spare_free_chunks(kv, allocator, scheduler))
    shortfall = demand - allocator.available_size() - _evictable(tree_cache)
    if shortfall > 0:
        borrow_tokens(kv, shortfall)


def tick(scheduler) -> None:
    allocator = scheduler.token_to_kv_pool_allocator
    kv = getattr(allocator, "_memx_elastic", None)
    if kv is None:
        return
    cap_request_lengths(scheduler, kv)
    if kv.host is not None:  # before anything reads the last batch: offloaded prefills leave it
        park_offloaded_prefills(kv, scheduler)
    if kv.activation is not None:
        kv.activation.end_iteration()  # the previous forward is done: its activations are idle
    tree_cache = getattr(scheduler, "tree_cache", None)
    answer_reclaim(kv, allocator, tree_cache, scheduler)
    kv.shrink(allocator)
    if kv.host is not None:
        observe_slos(kv, scheduler)
    if kv.lent is not None:
        balance_shared_pool(kv, allocator, tree_cache, scheduler)
    if kv.host is not None:  # first: the head's prefill size depends on its parked KV being back
        fetch_parked(kv, scheduler, int(decode_reserve_tokens(scheduler)))
        reopen_admission_for_offload(kv, scheduler)
    prepare_head_activation(kv, allocator, tree_cache, scheduler)
