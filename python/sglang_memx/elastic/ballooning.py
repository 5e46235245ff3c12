"""Activations and KV in one pool inside the server (eLLM E1/E2): the glue between the
scheduler and ``memory_ext.pool.activation_balloon.ActivationBalloon``.

``reserve_activation`` makes a batch's activation chunks held before the batch runs
(from FREE, then idle KV: lazy deflation, ``plan_activation``); with a shared pool a
shortfall is borrowed. ``hold_head_activation`` does it for the waiting head before
batch selection, when evicting cached prefixes is safe.
"""

from __future__ import annotations

from memory_ext.pool.activation_balloon import ActivationBalloon
from memory_ext.pool.lent_pool import LentPool
from sglang_memx.elastic import demand
from sglang_memx.elastic.eviction import free_groups, idle_kv_chunks
from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.elastic.shared_pool import borrow_chunks


def reserve_activation(kv: ElasticKV, balloon: ActivationBalloon, allocator, tree, tokens: int, seqs: int, *,
                       lent: LentPool | None, urgent: bool = False) -> bool:  # fmt: skip
    """eLLM Alg. 1's ballooning for one batch: its activation chunks in ``balloon`` (``kv``'s
    activation), from FREE, then idle KV.

    ``tree`` None: only empty groups may be deflated, nothing evicted (queued requests hold
    unlocked prefix matches during admission). With a shared pool (``lent``: its link, None for
    an own pool) what the arbiter has free now is borrowed before any KV is deflated (a deflated
    group is one upstream's admission counted as available: taking it would refuse the very
    request whose activation this is, and upstream would then close admission until a running
    request leaves), and a shortfall after that is borrowed when ``urgent`` (a decode step that
    would otherwise retract), letting the arbiter reclaim from peers. False: the batch does not
    fit with its activation; nothing was taken.
    """
    if tokens <= 0:
        return True
    cpg = kv.buffers.chunks_per_group

    def kv_idle() -> int:
        return idle_kv_chunks(kv, allocator, tree)

    def deflate(chunks: int) -> int:
        return free_groups(kv, allocator, tree, -(-chunks // cpg)) * cpg

    def short() -> int:  # chunks neither held nor FREE in the local pool
        return balloon.need_chunks(tokens, seqs) - balloon.held - kv.buffers.pool.available()

    if lent is not None and (early := short()) > 0:  # memory nobody on the device holds comes before
        borrow_chunks(kv, lent, early, may_wait=False)  # this server's KV, which admission just counted
    if balloon.reserve(tokens, seqs, kv_idle, deflate):
        return True
    if lent is None:
        return False
    # the activation's own chunks: KV's capacity (all groups mapped, say) does not bound them
    if not borrow_chunks(kv, lent, max(short(), 1), may_wait=urgent, urgent=urgent):
        return False
    return balloon.reserve(tokens, seqs, kv_idle, deflate)


def hold_head_activation(kv: ElasticKV, balloon: ActivationBalloon, allocator, tree, scheduler,
                         host: HostBufferState | None, lent: LentPool | None) -> None:  # fmt: skip
    """Before batch selection (no prefix match is pending yet, so evicting cached prefixes is
    safe): hold the head request's prefill activation in ``balloon`` (``kv``'s activation), so
    that a server whose memory is all cached prefixes still admits it. The chunks stay idle until
    the batch reserves them. ``host``: the host buffer, if any (its pinned prefixes count as cached)."""
    tokens = demand.head_prefill_tokens(scheduler, host)
    if tokens <= 0:
        return
    reserve_activation(kv, balloon, allocator, tree, tokens, 1, lent=lent)
    balloon.end_iteration()


def reserve_decode_step(
    kv: ElasticKV, balloon: ActivationBalloon, allocator, tree, requests: int, lent: LentPool | None
) -> bool:
    """A decode step of ``requests`` sequences reserves its activation before upstream checks
    KV capacity; False: it does not fit (upstream then retracts a request and asks again)."""
    return reserve_activation(kv, balloon, allocator, tree, requests, requests, lent=lent, urgent=True)


def grow_over_activation(kv: ElasticKV, balloon: ActivationBalloon, allocator, pages: int) -> None:
    """Last resort before upstream's fatal short allocation: map groups from the activation's
    live chunks too, when they only count torch's own allocations (no arena: CPU, or
    ``--memx-torch-activations``), so lending them moves no byte a forward uses. The forward
    then over-commits the pool by what was lent (``overcommitted_chunks``). With an arena the
    chunks back the forward's tensors and are never lent."""
    if balloon.arena is not None or balloon.live <= 0:
        return
    live, balloon.live = balloon.live, 0
    try:
        kv.grow(allocator, pages)
    finally:
        balloon.live = min(live, balloon.held)
        balloon.stats["overcommitted_chunks"] += live - balloon.live
