"""CPU elastic buffer (eLLM E3/E4, ``--memx-host-buffer-gb``): KV that waits on the host.

Two kinds of request keep their KV in a ``HostKVBuffer`` while they wait:

* **Prefills offloaded at admission** (Alg. 1's CPU-buffer branch). When
  upstream's admission refuses a new request because the running requests'
  reserved decode tokens leave no room (``NO_TOKEN``), but its prompt fits the
  device *now* and its KV fits the buffer's logical room, the admission hook
  admits it against the physical budget only. After its prefill (first token
  streamed), ``park_offloaded_prefills`` keeps it out of the running batch,
  copies its KV to the host and puts it back at the front of the waiting
  queue, like a retraction that recomputes nothing. Under the overlap loop a
  prefill's result is processed one iteration after the next batch is
  scheduled, so the request waits one tick in ``limbo`` (excluded from the
  running batch, KV still held) until its first token is in.
* **Retracted requests** (``park_kv``, called as upstream releases a
  request it retracts): their committed KV is copied before upstream frees it.

``fetch_parked`` (once per iteration, before batch selection) puts parked KV
back on the device for waiting requests, head first, when the device has room
and the request's decode reservation fits: it allocates slots, copies the rows
back and inserts them into the radix cache under the request's tokens
(skipped when the cache still holds them). Upstream's admission then finds
them as a cached prefix and computes only the last token. The entry stays
until the request is admitted (``note_admitted``: taken if its prefix came
from the device, dropped if it had to be recomputed), since cached pages may
be evicted before that. Entries of requests that left the queue are dropped.

``observe_slos``: with ``--memx-ttft-slo-ms``/``--memx-tpot-slo-ms`` the
logical size follows eLLM Alg. 2 (``LogicalBufferScaler``, unit = one KV
group's bytes, windows over the last 5 *samples*): TPOT violations shrink it
first, TTFT violations grow it. A TTFT sample is one request's time from the
first iteration that saw it waiting to the first that sees its first token; a
TPOT sample is, per iteration, the mean over the requests that produced tokens
of (time since their previous token) / (tokens produced), so the wait of an
offloaded request between its first and second token counts. Without SLOs the
logical size is the whole buffer.

Needs the radix cache (the fetch goes through it).
"""

from __future__ import annotations

import logging
import time
from array import array

import torch

from memory_ext.policy.ellm import LogicalBufferScaler
from memory_ext.pool.host_kv_buffer import HostKVBuffer

logger = logging.getLogger("sglang_memx")


class HostBufferState:
    """The host buffer of one scheduler plus the prefills offloaded into it.

    ``pending_bytes``: host bytes promised to offloaded prefills not parked yet
    (admitted, or in ``limbo``); offload admission keeps ``used + pending``
    within the logical size.
    """

    def __init__(self, buffer: HostKVBuffer, unit_bytes: int, scaler: LogicalBufferScaler | None = None):
        self.buffer = buffer
        self.unit_bytes = unit_bytes
        self.scaler = scaler
        self.limbo: list = []  # offloaded prefills out of every batch, their first token not processed yet
        self.pins: dict = {}  # rid -> radix-cache lock on a fetched prefix, held until the request is admitted
        self.pending_bytes = 0
        self.offload = {"prefill_offloads": 0, "offload_parked": 0, "offload_no_room": 0}
        self.events = {"ttft": 0, "tpot": 0}
        if scaler is not None:
            buffer.set_logical_bytes(scaler.logical_chunks * unit_bytes)

    def offload_room(self) -> int:
        return max(0, self.buffer.room() - self.pending_bytes)

    def status(self) -> dict:
        out = self.buffer.status()
        out.update(
            self.offload,
            offload_pending=len(self.limbo),
            offload_pending_bytes=self.pending_bytes,
            pinned=len(self.pins),
        )
        out["slo_scaling"] = (
            None
            if self.scaler is None
            else {
                "logical_units": self.scaler.logical_chunks,
                "unit_bytes": self.unit_bytes,
                "ttft_slo_s": self.scaler.ttft_slo,
                "tpot_slo_s": self.scaler.tpot_slo,
                "ttft_events": self.events["ttft"],
                "tpot_events": self.events["tpot"],
            }
        )
        return out


def build_host_buffer(config, group_bytes: int) -> HostBufferState:
    capacity = int(config.host_buffer_gb * (1 << 30))
    scaler = None
    if config.ttft_slo_ms is not None:
        scaler = LogicalBufferScaler(
            max_chunks=max(1, capacity // group_bytes),
            ttft_slo=config.ttft_slo_ms / 1e3,
            tpot_slo=config.tpot_slo_ms / 1e3,
            per_sample=True,
        )
    return HostBufferState(HostKVBuffer(capacity), group_bytes, scaler)


def _kv_buffers(allocator):
    pool = allocator.get_kvcache()
    return list(pool.k_buffer) + list(pool.v_buffer)


def kv_row_bytes(allocator) -> int:
    """Bytes of one token's KV over every layer (what parking one token costs the host)."""
    return sum(b[0].numel() * b.element_size() for b in _kv_buffers(allocator))


def offload_eligible(req) -> bool:
    """A new plain text request: no output yet, nothing parked, no logprobs, grammar, embeddings,
    images, session, beam group or LoRA (their resume paths are not exercised here)."""
    return (
        len(req.output_ids) == 0
        and not getattr(req, "is_retracted", False)
        and not getattr(req, "return_logprob", False)
        and getattr(req, "grammar", None) is None
        and getattr(req, "input_embeds", None) is None
        and getattr(req, "multimodal_inputs", None) is None
        and getattr(req, "session", None) is None
        and getattr(req, "beam_group", None) is None
        and getattr(req, "lora_id", None) is None
        and not req.finished()
    )


def offload_bytes(req, allocator) -> int:
    return len(req.full_untruncated_fill_ids) * kv_row_bytes(allocator)


def mark_offloaded(kv, req, nbytes: int) -> None:
    """``req`` was admitted as an offloaded prefill: its KV goes to the host after the prefill."""
    req._memx_offload_bytes = nbytes
    kv.host.pending_bytes += nbytes
    kv.host.offload["prefill_offloads"] += 1


def park_kv(kv, req, req_to_token_pool, allocator) -> bool:
    """Copy a request's committed KV to the host buffer (before it is freed); False: not kept."""
    host = kv.host
    if host is None or req.finished() or getattr(req, "input_embeds", None) is not None:
        return False
    if not req.kv.holds_kv or req.kv.req_pool_idx is None:
        return False
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[: req.owned_kv_len()]
    n = len(tokens) - len(tokens) % allocator.page_size
    if n <= 0:
        return False
    host.buffer.drop(req.rid)  # a stale entry of an earlier retraction
    buffers = _kv_buffers(allocator)
    if n * kv_row_bytes(allocator) > host.buffer.room():
        host.buffer.stats["refused"] += 1
        return False
    idx = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    pin = idx.device.type == "cuda"
    rows = [b[idx].to("cpu", copy=True) for b in buffers]
    if pin:
        rows = [r.pin_memory() for r in rows]
    return host.buffer.park(req.rid, tokens[:n], rows)


def _requeue_ahead(scheduler, req) -> None:
    """Put a parked prefill back into the waiting queue ahead of requests that never ran
    (behind other resumed ones): it arrived before them and holds its first token already."""
    scheduler._add_request_to_queue(req, is_retracted=True)
    queue = scheduler.waiting_queue
    if not queue or queue[-1] is not req:
        return  # aborted by a queue limit, or not a plain FIFO list
    queue.pop()
    at = 0
    while at < len(queue) and len(queue[at].output_ids) > 0:
        at += 1
    queue.insert(at, req)


def park_offloaded_prefills(kv, scheduler) -> int:
    """Take offloaded prefills out of the last prefill batch (so they are not merged into the
    running batch) and, once their first token is processed, park their KV and requeue them.
    Returns how many were parked this call."""
    host = kv.host
    if host is None:
        return 0
    last = getattr(scheduler, "last_batch", None)
    if last is not None and last is not getattr(scheduler, "running_batch", None) and last.forward_mode.is_extend():
        chunked = getattr(scheduler, "chunked_req", None)
        done = [r for r in last.reqs if getattr(r, "_memx_offload_bytes", 0) and r is not chunked]
        if done:
            last.filter_batch(reqs_to_exclude=done)
            host.limbo.extend(done)
    if not host.limbo:
        return 0
    from sglang.srt.managers.schedule_batch import release_req

    allocator = scheduler.token_to_kv_pool_allocator
    parked = 0
    for req in list(host.limbo):
        if not req.finished() and len(req.output_ids) == 0:
            continue  # overlap loop: its prefill's result is processed after this tick
        host.limbo.remove(req)
        host.pending_bytes -= req._memx_offload_bytes
        req._memx_offload_bytes = 0
        if req.finished():
            continue  # finished on its first token; upstream released its KV
        try:
            kept = park_kv(kv, req, scheduler.req_to_token_pool, allocator)
        except Exception:  # it is recomputed when it resumes, as a retracted request would be
            logger.exception("memx: could not park the KV of offloaded prefill %s", req.rid)
            kept = False
        release_req(
            req=req,
            remaing_req_count=0,
            req_to_token_pool=scheduler.req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=scheduler.tree_cache,
            hisparse_coordinator=getattr(scheduler, "hisparse_coordinator", None),
            offload_kv=False,
        )
        _requeue_ahead(scheduler, req)
        if kept:
            parked += 1
            host.offload["offload_parked"] += 1
        abort = getattr(req, "_memx_pending_abort", None)
        if abort is not None:  # aborted while in limbo: upstream aborts it from the queue now
            req._memx_pending_abort = None
            scheduler.abort_request(abort)
    return parked


def _unpin(host, tree, rid) -> None:
    lock = host.pins.pop(rid, None)
    if lock is not None:
        tree.unlock(lock)


def note_admitted(kv, req, tree=None) -> None:
    """``req`` was just admitted (upstream locked its prefix): its entry is consumed (taken if its
    prefix came back from the device, dropped if part of it has to be recomputed) and our pin goes."""
    host = kv.host
    entry = host.buffer.peek(req.rid) if host is not None else None
    if entry is None:
        return
    if tree is not None:
        _unpin(host, tree, req.rid)
    if int(getattr(req, "prefix_len", 0) or 0) >= len(entry):
        host.buffer.take(req.rid)
    else:
        host.buffer.drop(req.rid)


def _radix_key(req, tokens):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens), req.extra_key, cache_salt=req.cache_salt)


def _match(tree, req, tokens):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return tree.match_prefix(MatchPrefixParams(key=_radix_key(req, tokens)))


def fetch_parked(kv, scheduler, decode_reserve_tokens: int = 0) -> bool:
    """Make sure the first waiting request with parked KV finds it on the device when it can be
    admitted: copy it back (evicting other cached prefixes if needed) unless the cache still holds
    it, and pin it in the radix cache until the request is admitted, so decode allocations cannot
    evict it meanwhile. ``decode_reserve_tokens``: what upstream's admission reserves for the
    running requests' remaining decode; while the request's own reservation does not fit, nothing
    is fetched and its pin is released. Returns whether its KV is on the device now."""
    host = kv.host
    if host is None or not len(host.buffer):
        return False
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    from sglang_memx.elastic.driver import _evict, remaining_new_tokens

    waiting = list(getattr(scheduler, "waiting_queue", []))
    allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    live = {r.rid for r in waiting} | {r.rid for r in host.limbo}
    for key in host.buffer.keys():
        if key not in live:  # finished, aborted or admitted by a path that bypassed the hook
            _unpin(host, tree, key)
            host.buffer.drop(key)
    req = next((r for r in waiting if r.rid in host.buffer), None)
    if req is None:
        return False
    entry = host.buffer.peek(req.rid)
    n, page = len(entry), allocator.page_size
    max_new = remaining_new_tokens(req)
    pinned = host.pins.get(req.rid) is not None
    own = n if pinned else 0  # a pinned prefix is not evictable, but it is this request's own
    if allocator.available_size() + int(tree.evictable_size()) + own - decode_reserve_tokens < max_new + 2 * page:
        _unpin(host, tree, req.rid)  # it cannot be admitted now: let decode steps evict it if they must
        return False
    match = _match(tree, req, entry.tokens)
    if match.device_prefix_len >= n:
        if not pinned:
            host.pins[req.rid] = tree.lock(match.last_device_node)
        return True
    _unpin(host, tree, req.rid)
    # the held activation chunks (idle now) are not room for KV
    act = kv.activation.held // kv.buffers.chunks_per_group * kv.buffers.group_rows if kv.activation else 0
    short = n + page + act - allocator.available_size()
    if short > 0:
        _evict(tree, short)
    if allocator.available_size() - act < n + page:
        return False
    idx = allocator.alloc(n)
    if idx is None:
        return False
    for buf, rows in zip(_kv_buffers(allocator), entry.rows):
        buf[idx] = rows.to(buf.device, non_blocking=True)
    try:
        tree.insert(InsertParams(key=_radix_key(req, entry.tokens), value=idx.to(torch.int64, copy=True)))
    except Exception:  # never lose the request: it is recomputed as in stock SGLang
        logger.exception("memx: could not restore the parked KV of %s; it is recomputed", req.rid)
        allocator.free(idx)
        host.buffer.drop(req.rid)
        return False
    host.buffer.record_fetch(req.rid)
    match = _match(tree, req, entry.tokens)
    if match.device_prefix_len >= n:
        host.pins[req.rid] = tree.lock(match.last_device_node)
    return True


def _tpot_sample(scheduler, now: float) -> float | None:
    """Mean over running requests that produced tokens since the last tick of their time per token."""
    samples = []
    batch = getattr(scheduler, "running_batch", None)
    for req in list(getattr(batch, "reqs", None) or []):
        count = len(req.output_ids)
        prev = getattr(req, "_memx_last_out", None)
        req._memx_last_out = (count, now) if prev is None or count != prev[0] else prev
        if prev is not None and count > prev[0] >= 1:
            samples.append((now - prev[1]) / (count - prev[0]))
    return sum(samples) / len(samples) if samples else None


def observe_slos(kv, scheduler, now: float | None = None) -> None:
    """Alg. 2 steps from this iteration's TTFT samples (one per first token) and TPOT sample."""
    host = kv.host
    if host is None or host.scaler is None:
        return
    now = time.monotonic() if now is None else now
    for req in list(getattr(scheduler, "waiting_queue", [])):
        if getattr(req, "_memx_seen_at", None) is None:
            req._memx_seen_at = now
    ttfts, seen_ids = [], set()
    candidates = [
        r
        for b in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None))
        for r in list(getattr(b, "reqs", None) or [])
    ]
    # offloaded prefills get their first token out of every batch (limbo, then back in the queue)
    candidates += list(host.limbo) + list(getattr(scheduler, "waiting_queue", []))
    for req in candidates:
        seen = getattr(req, "_memx_seen_at", None)
        if id(req) in seen_ids or seen is None or getattr(req, "_memx_ttft_done", False):
            continue
        seen_ids.add(id(req))
        if len(req.output_ids) >= 1:
            req._memx_ttft_done = True
            ttfts.append(now - seen)
    decisions = [host.scaler.observe(ttft=t) for t in ttfts]
    tpot = _tpot_sample(scheduler, now)
    if tpot is not None:
        decisions.append(host.scaler.observe(tpot=tpot))
    for decision in decisions:
        if decision.event:
            host.events[decision.event] += 1
    host.buffer.set_logical_bytes(host.scaler.logical_chunks * host.unit_bytes)
