"""CPU elastic buffer (eLLM E3, ``--memx-host-buffer-gb``): KV that waits on the host.

Two kinds of request keep their KV in a ``HostKVBuffer`` while they wait:

* **Prefills offloaded at admission** (Alg. 1's CPU-buffer branch, decided in
  ``elastic.admission``). After its prefill (first token streamed),
  ``park_offloaded_prefills`` keeps the request out of the running batch,
  copies its KV to the host and puts it back at the front of the waiting
  queue, like a retraction that recomputes nothing. Under the overlap loop a
  prefill's result is processed one iteration after the next batch is
  scheduled, so the request waits one tick in ``limbo`` (excluded from the
  running batch, KV still held) until its first token is in.
* **Retracted requests** (``park_kv``, called as upstream releases a request
  it retracts): their committed KV is copied before upstream frees it.

``fetch_parked`` (once per iteration, before batch selection) puts parked KV
back on the device for every waiting request with some that the next prefill
batch could admit, in queue order: while the device has room for each one's
decode reservation on top of those kept before it, and upstream's request and
prefill-token limits would take it; it stops at the first that does not fit
(none behind it passes it). For each it allocates slots, copies the rows back
and inserts them into the radix cache under the request's tokens (skipped when
the cache still holds them), then pins them with a radix lock until the
request is admitted; the pins of requests it no longer fetches are released. Upstream's admission then
finds them as a cached prefix and computes only the last token. The entry
stays until the request is admitted (``note_admitted``: taken if its prefix
came from the device, dropped if it had to be recomputed). Entries of
requests that left the queue are dropped.

The buffer's logical size follows eLLM Alg. 2 when SLOs are given
(``HostBufferState.rule``, fed by ``elastic.slo``). Needs the radix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_memx.elastic import demand
from sglang_memx.elastic.activation_side import ActivationSide
from sglang_memx.elastic.eviction import idle_kv_chunks
from sglang_memx.elastic.host_state import HostBufferState, build_host_buffer  # noqa: F401  (re-exported)
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import radix as up_radix
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched

logger = logging.getLogger("sglang_memx")


def offload_bytes(req, allocator) -> int:
    return up_req.fill_len(req) * demand.kv_row_bytes(allocator)


def mark_offloaded(host: HostBufferState, req, nbytes: int) -> None:
    """``req`` was admitted as an offloaded prefill: its KV goes to the host after the prefill."""
    up_req.memx_state(req).offload_bytes = nbytes
    host.pending_bytes += nbytes
    host.offload["prefill_offloads"] += 1


def is_offloaded(req) -> bool:
    return up_req.memx_state(req).offload_bytes > 0


def park_kv(host: HostBufferState, req, req_to_token_rows, allocator) -> bool:
    """Copy a request's committed KV to the host buffer (before it is freed); False: not kept."""
    if up_req.is_finished(req) or up_req.has_input_embeds(req):
        return False
    if not up_req.holds_kv(req) or up_req.req_pool_index(req) is None:
        return False
    tokens = (list(up_req.prompt_ids(req)) + list(up_req.output_ids(req)))[: up_req.owned_kv_len(req)]
    n = len(tokens) - len(tokens) % up_kv.page_size(allocator)
    if n <= 0:
        return False
    rid = up_req.rid(req)
    host.buffer.drop(rid)  # a stale entry of an earlier retraction
    if n * demand.kv_row_bytes(allocator) > host.buffer.room():
        host.buffer.stats["refused"] += 1
        return False
    idx = req_to_token_rows[up_req.req_pool_index(req), :n].to(torch.int64)
    return host.buffer.park(rid, tokens[:n], [rows_on_host(b, idx) for b in up_kv.kv_buffers(allocator)])


def rows_on_host(buffer: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``buffer``'s rows at ``idx`` as a host tensor of their own: on the host the indexing is the
    copy; from a GPU pool the rows are gathered on the device and copied once, straight into
    pinned memory (so restoring them is an asynchronous copy, with no pageable staging copy)."""
    rows = buffer[idx]
    if rows.device.type != "cuda":
        return rows
    out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    out.copy_(rows)
    return out


def _requeue_ahead(scheduler, req) -> None:
    """Put a parked prefill back into the waiting queue ahead of requests that never ran
    (behind other resumed ones): it arrived before them and holds its first token already."""
    up_sched.requeue_retracted(scheduler, req)
    queue = up_sched.waiting(scheduler)
    if not queue or queue[-1] is not req:
        return  # aborted by a queue limit, or not a plain FIFO list
    queue.pop()
    at = 0
    while at < len(queue) and up_req.output_len(queue[at]) > 0:
        at += 1
    queue.insert(at, req)


def park_offloaded_prefills(host: HostBufferState, scheduler) -> int:
    """Take offloaded prefills out of the last prefill batch (so they are not merged into the
    running batch) and, once their first token is processed, park their KV and requeue them.
    Returns how many were parked this call."""
    last = up_sched.unmerged_prefill_batch(scheduler)
    if last is not None:
        chunked = up_sched.chunked_req(scheduler)
        done = [r for r in up_sched.batch_reqs(last) if is_offloaded(r) and r is not chunked]
        if done:
            up_sched.exclude_from_batch(last, done)
            host.limbo.extend(done)
    if not host.limbo:
        return 0
    allocator = up_sched.allocator(scheduler)
    parked = 0
    for req in list(host.limbo):
        if not up_req.is_finished(req) and up_req.output_len(req) == 0:
            continue  # overlap loop: its prefill's result is processed after this tick
        state = up_req.memx_state(req)
        host.limbo.remove(req)
        host.pending_bytes -= state.offload_bytes
        state.offload_bytes = 0
        if up_req.is_finished(req):
            continue  # finished on its first token; upstream released its KV
        try:
            kept = park_kv(host, req, up_sched.req_to_token_rows(scheduler), allocator)
        except Exception:  # it is recomputed when it resumes, as a retracted request would be
            logger.exception("memx: could not park the KV of offloaded prefill %s", up_req.rid(req))
            kept = False
        up_sched.release_req_kv(scheduler, req)
        _requeue_ahead(scheduler, req)
        if kept:
            parked += 1
            host.offload["offload_parked"] += 1
        if state.pending_abort is not None:  # aborted while in limbo: upstream aborts it from the queue now
            abort, state.pending_abort = state.pending_abort, None
            up_sched.abort(scheduler, abort)
    return parked


def remember_abort(host: HostBufferState, abort_req) -> None:
    """An abort for an offloaded prefill in limbo (in no batch and not in the queue, for one
    tick) would be missed; remember it, to be replayed once the request is back in the queue."""
    for req in host.limbo:
        if up_req.abort_matches(abort_req, req):
            up_req.memx_state(req).pending_abort = abort_req


def _unpin(host, tree, rid) -> None:
    lock = host.pins.pop(rid, None)
    if lock is not None:
        up_radix.unlock(tree, lock)


def note_admitted(host: HostBufferState, req, tree) -> None:
    """``req`` was just admitted (upstream locked its prefix): its entry is consumed (taken if its
    prefix came back from the device, dropped if part of it has to be recomputed) and our pin goes."""
    rid = up_req.rid(req)
    entry = host.buffer.peek(rid)
    if entry is None:
        return
    fetched = rid in host.pins
    _unpin(host, tree, rid)
    if up_req.cached_prefix_len(req) >= len(entry):
        host.buffer.take(rid)
    else:
        host.recomputed["partial_prefix" if fetched else "not_fetched"] += 1
        logger.debug("memx: parked request %s admitted with %d of its %d parked tokens on the device (%s); "
                    "the rest is recomputed", rid, up_req.cached_prefix_len(req), len(entry),
                    "fetched" if fetched else "not fetched")  # fmt: skip
        host.buffer.drop(rid)


@dataclass
class _BatchRoom:
    """What upstream's next prefill batch has left for requests after the ones kept so far in one
    fetch pass (``PrefillAdder``'s limits, KV memory aside): request slots (``--max-running-requests``,
    request rows), input tokens (``--max-prefill-tokens``) and the chunk (``--chunked-prefill-size``,
    None when off), after a chunked prefill under way took its next chunk."""

    slots: int
    input_left: int
    chunk_left: int | None
    page: int

    @classmethod
    def of(cls, scheduler, page: int) -> _BatchRoom:
        chunk = up_sched.chunked_prefill_size(scheduler)
        room = cls(up_sched.request_slots_left(scheduler), up_sched.prefill_token_budget(scheduler),
                   chunk if chunk and chunk > 0 else None, page)  # fmt: skip
        if up_sched.chunked_req(scheduler) is not None:  # admitted first, into the same batch
            room.take(demand.head_prefill_tokens(scheduler, None))
            room.slots -= 1
        return room

    def admits_another(self, kept: int, extend: int) -> bool:
        """Whether the batch would still take one more request of ``extend`` new input tokens after
        ``kept`` (>= 1) requests: upstream stops at a spent budget, at its request limits and, with
        chunking off, at a request whose input does not fit what is left (it admits the first whole)."""
        if kept >= self.slots or self.input_left <= 0:
            return False
        if self.chunk_left is None:
            return self._paged(extend) < self.input_left
        return self.chunk_left > 0

    def take(self, extend: int) -> None:
        tokens = self._paged(extend)
        self.input_left -= tokens
        if self.chunk_left is not None:
            self.chunk_left -= tokens

    def _paged(self, tokens: int) -> int:
        return -(-max(tokens, 1) // self.page) * self.page


def _drop_gone(host: HostBufferState, waiting: list, tree) -> None:
    """Drop the entries (and pins) of requests neither waiting nor in limbo."""
    live = {up_req.rid(r) for r in waiting} | {up_req.rid(r) for r in host.limbo}
    for key in host.buffer.keys():
        if key not in live:  # finished, aborted or admitted by a path that bypassed the hook
            _unpin(host, tree, key)
            host.buffer.drop(key)


def fetch_parked(kv: ElasticKV, host: HostBufferState, activation: ActivationSide, scheduler,
                 decode_reserve_tokens: int = 0,
                 may_join: Callable[[list, object], bool] | None = None) -> int:  # fmt: skip
    """Make sure the waiting requests with parked KV that the next prefill batch could admit find
    it on the device: walking the queue in order, copy each one's KV back (evicting other cached
    prefixes if needed) unless the cache still holds it, and pin it in the radix cache until the
    request is admitted, so decode allocations cannot evict it meanwhile.

    Memory: ``decode_reserve_tokens`` is what upstream's admission reserves for the running
    requests' remaining decode; a request is fetched only if its prompt's KV (unless back already)
    and its own reservation (remaining ``max_new_tokens`` + 2 pages) fit beside it, as upstream's
    admission would ask of it recomputed, and each kept request adds its reservation to what the
    next one must leave room for. The copy keeps the next prefill's activation out of its room
    (``_bring_back``). The pass stops at the first parked request that does not fit (first come,
    first served: none behind it is fetched), whose copy fails, or that the batch's request and
    prefill-token limits would not take (``_BatchRoom``; the first parked request is checked
    against memory only, as upstream admits a batch's first request above its input budget), or
    that ``may_join(running + kept, req)`` (the governor's batch decision, asked without counting)
    says may not join the running batch now: its admission would be refused, so its copy would
    only cost the running requests time, or whose pin would leave the head's next prefill no room
    for its activation in whole groups (``_head_activation_fits``). Pins of requests not kept are
    released.
    Returns how many parked requests have their KV on the device for the next batch."""
    if not len(host.buffer):
        return 0
    waiting = up_sched.waiting(scheduler)
    allocator, tree = up_sched.allocator(scheduler), up_sched.tree_cache(scheduler)
    _drop_gone(host, waiting, tree)
    page = up_kv.page_size(allocator)
    batch = _BatchRoom.of(scheduler, page)
    kept: set = set()
    reserve = decode_reserve_tokens
    # pinned prefixes are not evictable, but those of requests not kept yet are theirs (this one's
    # included); a request's pin changes only when it is visited, so the sum is kept as it goes
    own = sum(host.pinned_tokens(key) for key in host.pins)
    prefill_act = demand.activation_tokens(kv, activation.head_prefill_chunks(scheduler))
    joining = list(up_sched.running_reqs(scheduler)) if may_join is not None else []
    for req in waiting:
        rid = up_req.rid(req)
        entry = host.buffer.peek(rid)
        if entry is None:
            continue
        extend = up_req.prompt_len(req) + up_req.output_len(req) - len(entry)
        if kept and not batch.admits_another(len(kept), extend):
            host.fetch_stopped["batch_limits"] += 1
            break
        if may_join is not None and not may_join(joining, req):
            host.fetch_stopped["governor"] += 1
            break
        need = up_req.remaining_new_tokens(req) + 2 * page
        held = host.pinned_tokens(rid)  # in ``own`` until it is kept
        room = up_kv.available_tokens(allocator) + up_radix.evictable_tokens(tree) + own - reserve
        if room < need + len(entry) - held:  # what upstream's admission would ask of it recomputed
            host.fetch_stopped["kv_room"] += 1
            break
        if not _bring_back(kv, host, allocator, tree, req, entry, prefill_act):
            host.fetch_stopped["copy_room"] += 1
            break
        if not _head_activation_fits(kv, activation, allocator, tree, scheduler):
            _unpin(host, tree, rid)  # its KV stays cached (evictable); the host keeps its copy
            host.fetch_stopped["activation_room"] += 1
            break
        kept.add(rid)
        joining.append(req)
        own -= held  # its pin is now a kept request's: no longer room for the ones behind it
        reserve += need
        batch.take(extend)
    for key in [k for k in host.pins if k not in kept]:  # not admitted next: let decode steps evict them
        _unpin(host, tree, key)
    return len(kept)


def _head_activation_fits(kv: ElasticKV, activation: ActivationSide, allocator, tree, scheduler) -> bool:
    """Whether the head's next prefill activation can still be held beside the pinned prefixes: from
    the chunks held, FREE, and the KV groups that evicting the unpinned cached prefixes would empty.
    The copy's room is counted in tokens (``_bring_back``), but an activation takes whole groups: pins
    spread over every mapped group leave none to empty however many pages are free, and a head that
    cannot get its activation is never admitted, nor are the pinned requests behind it (seen at
    ``--tp 2``: 3 pinned requests, 1,148 free tokens, no group emptiable, nothing running, for minutes)."""
    short = activation.head_prefill_chunks(scheduler) - activation.held_chunks()
    if short <= 0:
        return True
    return kv.buffers.pool.available() + idle_kv_chunks(kv, allocator, tree) >= short


def _bring_back(kv: ElasticKV, host: HostBufferState, allocator, tree, req, entry, prefill_act: int) -> bool:
    """Put ``req``'s parked KV (``entry``) on the device and pin it, unless the radix cache still
    holds it (then only pin it), leaving the next prefill's activation (``prefill_act``, in KV
    tokens) room. Returns whether its KV is on the device now; False leaves nothing of it pinned.

    The decode step's activation is not kept out of that room: prefill and decode forwards
    alternate, and upstream's admission, which would otherwise take the request and recompute its
    prompt into the same room, does not keep it either (the decode step covers its activation
    itself: ``capacity.decode_step_fits``). Until 2026-12-03 every held chunk was kept out, the
    decode step's too: on ``bench_serving`` (100 requests at 4/s) 17 of 55 parked requests were then
    admitted without their KV and recomputed, 12 of them right after such a refusal."""
    rid = up_req.rid(req)
    n, page = len(entry), up_kv.page_size(allocator)
    pinned = host.pins.get(rid) is not None
    key = up_req.radix_key(req, entry.tokens)
    matched, node = up_radix.match(tree, key)
    if matched >= n:
        if not pinned:
            host.pins[rid] = up_radix.lock(tree, node)
        return True
    _unpin(host, tree, rid)
    short = n + page + prefill_act - up_kv.available_tokens(allocator)
    if short > 0:
        up_radix.evict(tree, short)
    if up_kv.available_tokens(allocator) - prefill_act < n + page:
        return False
    idx = up_kv.alloc_tokens(allocator, n)
    if idx is None:
        return False
    for buf, rows in zip(up_kv.kv_buffers(allocator), entry.rows):
        buf[idx] = rows.to(buf.device, non_blocking=True)
    try:
        up_radix.insert(tree, key, idx.to(torch.int64, copy=True))
    except Exception:  # never lose the request: it is recomputed as in stock SGLang
        logger.exception("memx: could not restore the parked KV of %s; it is recomputed", rid)
        up_kv.free_tokens(allocator, idx)
        host.buffer.drop(rid)
        return False
    host.buffer.record_fetch(rid)
    matched, node = up_radix.match(tree, key)
    if matched >= n:
        host.pins[rid] = up_radix.lock(tree, node)
    return True
