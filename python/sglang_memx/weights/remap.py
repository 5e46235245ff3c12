"""Once per scheduler iteration: the Oneiros controller's step for this server's weights.

Signal (Oneiros Alg. 1 line 3, "running out of KV cache blocks"): upstream refused to admit
the waiting head, or KV is parked in the host buffer, or what the head of the waiting queue
and the running requests' remaining decode need (``elastic.demand``) exceeds what KV could
hold now (free + mappable + evictable cache), in KV groups. The decision is
``OneirosController``'s; applying it is a request to the layer pipeline (released / restored
at the next forward boundary, or at once between forwards). A restore first makes room in
the pool (empty groups unmapped, cached prefixes evicted) and reserves its chunks.

On a shared pool a restore borrows its shortfall from the arbiter first. Tensor parallel ranks
(a ``LockstepLentPool``) borrow only in the tick's "give back, borrow" step, so there the
shortfall is that step's ask at the next tick (``take_restore_ask``), the ranks even their pools
right after, and the restore, decided again on the same FREE on every rank, proceeds or falls
back to evicting KV as on one rank. (``families`` still refuses ``--memx-weights`` on a shared pool at
``--tp`` > 1: docs/weights.md, "Tensor parallel".)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from memory_ext.policy import remap_signal
from memory_ext.policy.interval_manager import IntervalManager, demand_from_profile, demand_from_timings, stream_budget
from memory_ext.policy.oneiros import Action, BufferMode, ModelState, OneirosController, RemapDecision
from memory_ext.policy.remap_signal import ArbiterSupply, KvSignal
from memory_ext.policy.select_n import offloaded_layers
from memory_ext.pool import PoolError
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.elastic import demand
from sglang_memx.elastic.eviction import free_groups
from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import radix as up_radix
from sglang_memx.upstream import scheduler as up_sched

MODEL = "self"
LOW_WATERMARK_GROUPS = 1  # remap when less than one KV group would be left after the demand


def buffer_mode(depth: int | None) -> BufferMode:
    return BufferMode.AUTO if depth is None else (BufferMode.SINGLE if depth == 1 else BufferMode.DOUBLE)


def admission_denied(scheduler) -> bool:
    """Upstream refused to admit the waiting head for want of KV (it closes admission until a
    request leaves); a refusal at the request limits is not pressure."""
    return bool(up_sched.waiting(scheduler)) and up_sched.admission_closed_for_memory(scheduler)


def free_kv_groups(
    w, kv: ElasticKV, allocator, tree, scheduler, lent: LentPool | None, host: HostBufferState | None
) -> int:
    """The controller's KV signal (``memory_ext.policy.remap_signal``: its invariants) from what this
    scheduler holds now. ``lent``: the shared pool's link, ``host``: the host buffer (each None when off)."""
    waiting = bool(up_sched.waiting(scheduler))
    signal = KvSignal(
        available_tokens=up_kv.available_tokens(allocator),
        evictable_tokens=up_radix.evictable_tokens(tree) if tree is not None else 0,
        demand_tokens=demand.queue_demand_tokens(scheduler),
        group_tokens=kv.buffers.group_rows,
        parked_on_host=host is not None and len(host.buffer) > 0,
        admission_refused=admission_denied(scheduler),
        waiting=waiting,
        running=bool(up_sched.admitted_reqs(scheduler)),
        layers_lent=w.alpha > 0,
    )
    arbiter = None
    if lent is not None and w.alpha > 0:  # polled at most every ARBITER_POLL_S
        arbiter = ArbiterSupply(arbiter_free_chunks(w, lent), lent.ranks, kv.buffers.chunks_per_group)
    return remap_signal.free_kv_groups(signal, arbiter)


RESTORE_BORROW_WAIT_S = 0.02  # longest an iteration waits for the arbiter to lend a layer back
ARBITER_POLL_S = 0.5  # a lender with lent layers asks the arbiter what is free at most this often


def arbiter_free_chunks(w, lent: LentPool) -> int:
    """What the arbiter could lend at once, asked at most every ``ARBITER_POLL_S``."""
    now = time.monotonic()
    if now - w.arbiter_polled_at >= ARBITER_POLL_S:
        w.arbiter_free, w.arbiter_polled_at = lent.available_now(), now
    return w.arbiter_free


def starved(scheduler) -> bool:
    """Requests wait and nothing runs: no decode step runs at all, so no step SLO can bind, and a
    head that fits only with layers lent would otherwise wait for ever. (Whether it needs them is
    the controller's KV signal, ``free_kv_groups``: a head that fits lends nothing.)"""
    return bool(up_sched.waiting(scheduler)) and not up_sched.admitted_reqs(scheduler)


def model_state(w, kv: ElasticKV, lent: LentPool | None, busy: bool, starving: bool = False) -> ModelState:
    now = time.monotonic()
    if busy:
        w.last_busy = now
    active = now - w.last_busy < w.idle_after_s
    compute = w.decode_step_s if active else (w.prefill_step_s or w.decode_step_s)
    blocks = max(1, w.store.slot_chunks // kv.buffers.chunks_per_group)
    # the step SLO binds decode steps: not an idle model's, nor a starved queue head's (nothing runs)
    cap = tbt_cap(w) if active and not starving else w.n_layers - 1
    shared = link_cap(w, lent, active)
    if shared is not None:
        cap = min(cap, shared)
    return ModelState(MODEL, w.n_layers, max(w.layer_transfer_s, 1e-9), compute, active, cap,
                      remapped=min(w.alpha, w.n_layers - 1), blocks_per_layer=blocks, starved=starving)  # fmt: skip


def _fixed_s(w) -> float:
    """The part of a decode step outside the decoder layers, as measured (0 until measured)."""
    if w.decode_step_s is None or w.decode_layer_s is None:
        return 0.0
    return max(0.0, w.decode_step_s - w.n_layers * w.decode_layer_s)


def tbt_cap(w) -> int:
    """Most layers the model may lend under ``--memx-tbt-slo-ms`` (the paper's rule through the
    same ``IntervalManager`` code the simulator uses): the layers that may stream within the
    SLO, minus the staging slots they rotate through. With ``--memx-weights-profile`` the
    record's per-layer times and bandwidth; without, the times measured on this server (t_c
    of the last decode batch, the time outside the layers as the fixed part, T_T of the
    store's own copies). Nothing measured yet: nothing may be lent."""
    if w.tbt_slo_s is None:
        return w.n_layers - 1
    slots = w.depth or 2
    if w.profile is not None:
        manager = IntervalManager(w.profile, w.tbt_slo_s, slots, _fixed_s(w), w.copies_share_compute)
        budget = manager.decide(w.last_decode_batch)
    elif w.decode_layer_s is None or w.decode_step_s is None:
        return 0
    else:
        budget = stream_budget(w.n_layers, max(w.decode_layer_s, 1e-9), max(w.layer_transfer_s, 1e-9),
                               w.tbt_slo_s, slots, _fixed_s(w), w.copies_share_compute)  # fmt: skip
    return max(0, min(w.n_layers - 1, budget.layers - slots))


LINK_POLL_S = 0.5  # an active server re-asks the arbiter for its link share at most this often


def link_demand(w):
    """This server's Select-N demand on the shared host link (``GpuDemand``), from the same
    numbers as ``tbt_cap``; None while nothing is measured or no TBT SLO is set."""
    if w.tbt_slo_s is None:
        return None
    slots = w.depth or 2
    if w.profile is not None:
        manager = IntervalManager(w.profile, w.tbt_slo_s, slots, _fixed_s(w), w.copies_share_compute)
        return demand_from_profile(MODEL, manager, w.last_decode_batch)
    if w.decode_layer_s is None or w.decode_step_s is None:
        return None
    return demand_from_timings(MODEL, w.n_layers, w.layer_bytes, max(w.decode_layer_s, 1e-9),
                               max(w.layer_transfer_s, 1e-9), w.tbt_slo_s, slots, _fixed_s(w),
                               copies_share_compute=w.copies_share_compute)  # fmt: skip


def link_cap(w, lent: LentPool | None, active: bool) -> int | None:
    """Most layers the host link the pool's servers share leaves this one (Select-N §4.5: the
    arbiter runs ``LinkCoordinator`` over every active server's demand). None: no shared
    link to ask (private pool, no TBT SLO, nothing measured, or the arbiter did not answer).
    An inactive server withdraws its demand once."""
    if lent is None:
        return None
    if not active:
        if w.link_demand is not None:
            lent.link(w.link_demand, w.layer_bytes / w.layer_transfer_s, active=False)
            w.link_demand, w.link, w.link_layers = None, None, None
        return None
    demand = link_demand(w)
    if demand is None:
        return None
    now = time.monotonic()
    changed = w.link_demand is None or demand.min_interval != w.link_demand.min_interval
    if changed or now - w.link_asked_at >= LINK_POLL_S:
        reply = lent.link(demand, w.layer_bytes / w.layer_transfer_s)
        w.link_asked_at, w.link_demand, w.link = now, demand, reply
        w.link_layers = None if reply is None else offloaded_layers(w.n_layers, reply["interval"] or w.n_layers + 1)
    if w.link_layers is None:
        return None
    return max(0, min(w.n_layers - 1, w.link_layers - (w.depth or 2)))


def shared_pool_holds(kv: ElasticKV, lent: LentPool | None, action: Action, active: bool) -> str:
    """Across processes Oneiros's model order is the arbiter's: an active server remaps its own
    layers only after the arbiter refused (inactive peers' layers and idle KV go first), and
    an inactive server's layers lent to peers come back when it has traffic again."""
    if lent is None:
        return ""
    if action is Action.REMAP and time.monotonic() >= kv.borrow_backoff_until:
        return "the arbiter has not refused a borrow (peers' idle memory goes first)"
    if action is Action.RESTORE and not active:
        return "inactive: layers lent to peers come back with traffic"
    return ""


def step(w, kv: ElasticKV, allocator, scheduler, lent: LentPool | None, host: HostBufferState | None,
         rank0s: Callable[[list[int]], list[int]] | None = None) -> None:  # fmt: skip
    """One Oneiros step for the weights ``w`` in ``kv``'s pool: release a layer under KV
    pressure, restore one when its lent memory is empty (applied at the next forward boundary).

    ``rank0s`` (tensor parallel size > 1: ``RankAgreement.rank0s``): every rank applies rank 0's
    decision (the controller reads timings each rank measures alone); every rank reaches it in the
    same iterations, since what the early returns read is the same on every rank."""
    if w.mode != "remap" or w.pipeline.pending() is not None:
        return
    if w.sleeping:  # a sleeping server's layers stay released until a request wakes it (weights/sleep.py)
        return
    busy = bool(up_sched.waiting(scheduler)) or bool(up_sched.admitted_reqs(scheduler))
    if not busy and w.alpha == 0 and not w.store.streamed():
        return  # idle with every layer resident: nothing to decide
    tree = up_sched.tree_cache(scheduler)
    action, streamed, slots = decide(w, kv, allocator, tree, scheduler, lent, host, busy)
    if rank0s is not None:
        action, streamed, slots = rank0_decision(w, rank0s, action, streamed, slots)
    if action is not Action.RESTORE:
        w.restore_ask_chunks, w.restore_ask_tried = 0, False
    if action is Action.HOLD:
        w.decisions["hold"] += 1
        return
    apply(w, kv, allocator, tree, scheduler, lent, action, streamed, slots)


def take_restore_ask(w) -> int:
    """Chunks a restore waits for from this tick's borrow (a lockstep pool's ranks; 0: none). Taking
    it marks it tried: the next restore decision takes what the borrow brought, then evicts KV."""
    if w.restore_ask_chunks > 0:
        w.restore_ask_tried = True
    return w.restore_ask_chunks


def _restore_waits_for_the_tick(w, lent: LentPool, short: int) -> bool:
    """Borrow a restore's shortfall (``short`` > 0 chunks). True: the restore waits for the next tick's
    borrow (a lockstep pool, not tried yet); False: go on with what the pool holds."""
    if not isinstance(lent, LockstepLentPool):
        lent.borrow(short, wait=RESTORE_BORROW_WAIT_S)
        return False
    if w.restore_ask_tried:  # the tick borrowed what it could: the rest comes from KV, as on one rank
        w.restore_ask_chunks, w.restore_ask_tried = 0, False
        return False
    w.restore_ask_chunks = short
    w.restore_asks += 1
    return True


def rank0_decision(w, rank0s, action: Action, streamed: list, slots: int) -> tuple[Action, list, int]:
    """Rank 0's (action, streamed layers, slots), through one broadcast of a fixed-length row."""
    actions = list(Action)
    index = {k: j for j, k in enumerate(w.layer_keys)}
    row = [actions.index(action), slots, len(streamed)] + [index[k] for k in streamed]
    row += [-1] * (3 + w.n_layers - len(row))
    got = rank0s(row)
    if got != row:
        w.last_reason = f"rank 0's decision (this rank's: {action.value}, {len(streamed)} streamed)"
    return actions[got[0]], [w.layer_keys[j] for j in got[3 : 3 + got[2]]], got[1]


def decide(w, kv: ElasticKV, allocator, tree, scheduler, lent: LentPool | None, host: HostBufferState | None,
           busy: bool) -> tuple[Action, list, int]:  # fmt: skip
    """This rank's decision: (action, the layers streamed after it, staging slots)."""
    if w.controller is None:  # stateless between observations; one per server
        w.controller = OneirosController(LOW_WATERMARK_GROUPS, LOW_WATERMARK_GROUPS, buffer_mode(w.depth))
    controller = w.controller
    state = model_state(w, kv, lent, busy, starved(scheduler))
    controller.observe(free_kv_groups(w, kv, allocator, tree, scheduler, lent, host), [state])
    decision = controller.decide()
    w.last_reason = decision.reason
    held_back = shared_pool_holds(kv, lent, decision.action, state.active)
    if held_back:
        decision = RemapDecision(Action.HOLD, None, 0, None, f"{decision.reason}; held: {held_back}")
        w.last_reason = decision.reason
    if decision.action is Action.HOLD:
        return Action.HOLD, [], 0
    plan = decision.plan  # the controller's (DOUBLE mode when --memx-prefetch-depth > 2: buffer_mode)
    streamed = [w.layer_keys[j] for j in plan.shared_layers]
    return decision.action, streamed, w.depth if (w.depth and streamed) else plan.beta


def apply(w, kv: ElasticKV, allocator, tree, scheduler, lent: LentPool | None, action: Action, streamed: list,
          slots: int) -> None:  # fmt: skip
    """Request a release or a restore from the layer pipeline; a restore first makes room and
    reserves its chunks (or waits, its reason noted)."""
    if action is Action.RESTORE:
        need = chunks_needed(w, streamed, slots)
        short = need - kv.buffers.pool.available()
        if short > 0 and lent is not None:  # the lent memory may be the arbiter's again
            if _restore_waits_for_the_tick(w, lent, short):
                w.last_reason += "; restore waits: the ranks borrow its memory in the next tick"
                return
            short = need - kv.buffers.pool.available()
        if short > 0:
            groups = -(-short // kv.buffers.chunks_per_group)
            if free_groups(kv, allocator, tree, groups) < groups:
                w.last_reason += "; restore waits: KV still holds the lent memory"
                return
        try:  # taken now, on the scheduler's thread: admission never counts them as free
            w.store.reserve(need)
        except PoolError:
            w.last_reason += "; restore waits: the pool cannot back it yet"
            return
        w.restore_ask_chunks, w.restore_ask_tried = 0, False
    w.decisions[action.value] += 1
    w.pipeline.request(streamed, slots)
    w.pipeline.apply_if_idle()  # a waiting request may need this memory before any forward runs
    if action is Action.REMAP and up_sched.admission_closed_for_memory(scheduler):
        # upstream tries the head again with the memory released
        up_sched.reopen_admission(up_sched.running_batch(scheduler))


def chunks_needed(w, streamed, slots) -> int:
    """Extra chunks the store needs to go from its current state to ``streamed`` / ``slots``."""
    store = w.store
    keep = set(streamed)
    after = (
        sum(store.layer_chunks(k) for k in w.layer_keys if k not in keep) + min(slots, len(keep)) * store.slot_chunks
    )
    return max(0, after - store.held_chunks())
