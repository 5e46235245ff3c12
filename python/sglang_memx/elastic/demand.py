"""What a server's requests still need, in KV tokens, read from its scheduler.

Pure reads (through the upstream adapter); every number here feeds a policy
decision elsewhere (admission, borrowing, giving back, fetching parked KV).
"""

from __future__ import annotations

from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched


def running_demand_tokens(scheduler) -> int:
    """Tokens the admitted requests still need: the rest of a chunked prompt and their remaining
    max_new_tokens (prompt + max_new minus what is allocated, or minus prompt + output so far)."""
    demand = 0
    for req in up_sched.admitted_reqs(scheduler):
        prompt = up_req.prompt_len(req)
        done = prompt + up_req.output_len(req)
        allocated = up_req.kv_allocated_len(req)
        if allocated < prompt:  # chunked prefill under way
            done = allocated
        demand += max(0, prompt + up_req.max_new_tokens(req) - done)
    return demand


def decode_reserve_tokens(scheduler) -> float:
    """What upstream's admission reserves for the running requests' remaining decode: each one's
    remaining max_new_tokens (clipped) times the current new-token ratio (1 with ignore_eos)."""
    ratio = up_sched.new_token_ratio(scheduler)
    return sum(expected_new_tokens(req, ratio) for req in up_sched.running_reqs(scheduler))


def expected_new_tokens(req, ratio: float) -> float:
    """Upstream's estimate of what ``req`` will still generate: its remaining max_new_tokens
    (clipped) times ``ratio``, the new-token ratio, or all of it with ignore_eos (a fixed length)."""
    return up_req.remaining_new_tokens(req) * (1.0 if up_req.ignores_eos(req) else ratio)


def next_prefill_batch(scheduler) -> list:
    """The waiting requests upstream's next prefill batch could take, memory aside: in queue order
    (first come, first served), the head always, then each next one while the batch's input tokens
    stay within one prefill batch (``--chunked-prefill-size`` or ``--max-prefill-tokens``, the
    smaller) and upstream's request slots last. Inputs are counted whole (a cached prefix is not
    known before the match), so this never takes more than upstream's admission would."""
    waiting = up_sched.waiting(scheduler)
    if not waiting:
        return []
    limit = up_sched.prefill_token_budget(scheduler)
    chunk = up_sched.chunked_prefill_size(scheduler)
    if chunk and chunk > 0:
        limit = min(limit, chunk)
    batch, tokens = [], 0
    for req in waiting[: max(1, up_sched.request_slots_left(scheduler))]:
        need = up_req.prompt_len(req)
        if batch and tokens + need > limit:
            break
        batch.append(req)
        tokens += need
    return batch


def queue_demand_tokens(scheduler) -> int:
    """Tokens the next prefill batch's requests (``next_prefill_batch``) and the running requests'
    remaining decode would need.

    Upstream admits a request only if input + max_new (clipped) + one page is strictly below what
    is free and evictable; ask for exactly that much for each request the next prefill batch could
    take. Until 2026-12-02 only the head counted, so a burst was borrowed for one request a tick
    and admitted one request a prefill batch: upstream's ``bench_serving`` (4 requests/s, 256 in /
    64 out) against ``scripts/serve.sh`` ran 2-3 requests with 30+ waiting and the pool 5 % used,
    while stock ran 60.
    """
    return prefill_batch_demand_tokens(scheduler) + running_demand_tokens(scheduler)


def prefill_batch_demand_tokens(scheduler) -> int:
    """The next prefill batch's part of ``queue_demand_tokens``: what upstream's admission needs
    free to take each of its requests (``upstream_admission_tokens``); 0 when nothing waits."""
    page = up_sched.page_size(scheduler)
    return sum(upstream_admission_tokens(r, page) for r in next_prefill_batch(scheduler))


def upstream_admission_tokens(req, page: int) -> int:
    """The free + evictable tokens (less the running requests' decode reserve) upstream's admission
    needs to take ``req`` from the queue: its whole prompt (no cached prefix counted) + its
    remaining ``max_new_tokens`` (clipped) + a page, strictly below, i.e. that sum + 1."""
    return up_req.prompt_len(req) + up_req.remaining_new_tokens(req) + page + 1


def head_prefill_tokens(scheduler, host: HostBufferState | None) -> int:
    """Tokens of the next prefill chunk: of the request whose chunked prefill is under way, else
    of the waiting head request (0 if nothing waits); a parked prefix fetched back and pinned
    counts as cached (``host``: the host buffer, if any)."""
    chunked = up_sched.chunked_req(scheduler)
    if chunked is not None:
        tokens = max(1, up_req.prompt_len(chunked) - up_req.kv_allocated_len(chunked))
    else:
        head = up_sched.waiting(scheduler)[:1]
        if not head:
            return 0
        req = head[0]
        tokens = up_req.prompt_len(req) + up_req.output_len(req)
        if host is not None:
            tokens = max(1, tokens - host.pinned_tokens(up_req.rid(req)))
    chunk = up_sched.chunked_prefill_size(scheduler)
    return min(tokens, chunk) if chunk else tokens


def next_chunk_tokens(req, chunk_room: int | None) -> int:
    """Tokens ``req`` would prefill in this admission pass: the rest of its input, at most the chunk left."""
    tokens = up_req.fill_len(req) - up_req.cached_prefix_len(req)
    if chunk_room is not None:
        tokens = min(tokens, max(int(chunk_room), 1))
    return max(tokens, 1)


def kv_row_bytes(allocator) -> int:
    """Bytes of one token's KV over every layer (what parking one token costs the host)."""
    return sum(b[0].numel() * b.element_size() for b in up_kv.kv_buffers(allocator))


def decode_activation_chunks(balloon, scheduler) -> int:
    """Activation chunks one decode step of the admitted requests needs from ``balloon`` (the
    activation sharing the pool)."""
    n = len(up_sched.admitted_reqs(scheduler))
    return balloon.need_chunks(n, n)


def admitted_activation_chunks(balloon, scheduler, host: HostBufferState | None) -> int:
    """Activation chunks the admitted requests' next step needs: a decode step of all of them,
    or the next chunk of a chunked prefill under way, whichever is more. What a server must not
    give away between two chunks: the chunk's activation would otherwise take FREE chunks its
    KV was admitted against, and a short KV allocation ends upstream's scheduler."""
    need = decode_activation_chunks(balloon, scheduler)
    if up_sched.chunked_req(scheduler) is not None:
        need = max(need, balloon.need_chunks(head_prefill_tokens(scheduler, host), 1))
    return need


def activation_tokens(kv: ElasticKV, chunks: int) -> int:
    """``chunks`` of pool memory in KV-token equivalents (whole groups)."""
    return -(-chunks // kv.buffers.chunks_per_group) * kv.buffers.group_rows


def head_activation_chunks(balloon, scheduler, host: HostBufferState | None) -> int:
    """Chunks the head request's next prefill chunk needs for its activation, held or not."""
    tokens = head_prefill_tokens(scheduler, host)
    return balloon.need_chunks(tokens, 1) if tokens > 0 else 0
