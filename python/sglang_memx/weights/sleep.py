"""Sleep and wake (FineServe D4) for a server with remappable weights in a shared pool.

``--memx-sleep-after-s S``: a server with no request for ``S`` seconds falls asleep on its
scheduler's tick. Every decoder layer is released to stream through one staging slot (the
most the store can lend), its KV cache empties (cached prefixes evicted, groups unmapped) and
every spare chunk goes back to the arbiter, so the other servers of the pool can use the
memory at once. The first request wakes it: the chunks for every layer are borrowed from
the arbiter (which may reclaim them from peers), the layers are restored and their copies
awaited, and the wake time is recorded. A wake the arbiter cannot back at once is partial:
the server answers with streamed layers, and the remap controller restores the rest as
memory comes back.

Tensor parallel ranks (``rank0s``): whether to sleep or wake reads each rank's own clock and the
router's message as each rank stamped it, so every rank applies rank 0's answer (one broadcast a
tick); falling asleep then frees the same memory on every rank. On their shared pool
(a ``LockstepLentPool``) a wake borrows nothing where it is decided: it is partial, and the Oneiros
step restores the layers with borrows in the ranks' tick (``remap.take_restore_ask``).

Invariant: a sleeping server holds only its staging slot, the memory its running requests
need (none: it sleeps only when idle), and what its activation keeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from memory_ext.pool import PoolError
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx import router_activity
from sglang_memx.elastic import shared_pool
from sglang_memx.elastic.eviction import free_groups
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.weights import remap

logger = logging.getLogger("sglang_memx")

WAKE_BORROW_WAIT_S = 5.0  # longest a wake waits for the arbiter to gather the layers' memory


def step(w, kv: ElasticKV, lent: LentPool, allocator, tree, scheduler, activation: shared_pool.ActivationSide,
         rank0s: Callable[[list[int]], list[int]] | None = None) -> None:  # fmt: skip
    """Once per iteration, before the remap controller: fall asleep or wake up (``w``: the weights
    in ``kv``'s pool; the coordinator runs this step on a shared pool only). ``rank0s`` (tensor
    parallel size > 1: ``RankAgreement.rank0s``): every rank applies rank 0's answer."""
    if w.sleep_after_s is None:
        return
    busy = bool(up_sched.waiting(scheduler)) or bool(up_sched.admitted_reqs(scheduler))
    wake_now = w.sleeping and (busy or router_activity.wake_ahead())  # the router holds requests: wake ahead
    sleep_now = (not w.sleeping and not busy and time.monotonic() - w.last_busy >= w.sleep_after_s
                 and router_activity.may_sleep(w.sleep_after_s))  # fmt: skip
    if rank0s is not None:
        wake_now, sleep_now = (bool(x) for x in rank0s([int(wake_now), int(sleep_now)]))
    if wake_now:
        w.last_busy = time.monotonic()
        wake(w, kv, lent)
    elif sleep_now:
        fall_asleep(w, kv, lent, allocator, tree, scheduler, activation)


def fall_asleep(
    w, kv: ElasticKV, lent: LentPool, allocator, tree, scheduler, activation: shared_pool.ActivationSide
) -> None:
    if w.pipeline.pending() is not None:
        return  # a release or restore is still to apply: sleep on a later tick
    w.pipeline.request(list(w.layer_keys), 1)
    w.pipeline.apply_if_idle()
    free_groups(kv, allocator, tree, kv.num_groups)
    activation.release_idle(keep=0)
    given = lent.give_back(shared_pool.spare_free_chunks(kv, allocator, scheduler, activation))
    w.sleeping, w.slept_at = True, time.monotonic()
    w.sleeps += 1
    logger.info("memx: asleep after %.0f s idle: %d of %d layers released, %d chunk(s) back to the pool",
                w.sleep_after_s, len(w.store.streamed()), w.n_layers, given)  # fmt: skip


def wake(w, kv: ElasticKV, lent: LentPool) -> None:
    t0 = time.perf_counter()
    pool = kv.buffers.pool
    need = remap.chunks_needed(w, [], 0)
    short = need - pool.available()
    if short > 0 and not isinstance(lent, LockstepLentPool):  # the ranks borrow in their tick only
        lent.borrow(short, wait=WAKE_BORROW_WAIT_S)
    full = pool.available() >= need
    if full and need > 0:
        try:
            w.store.reserve(need)
        except PoolError:
            full = False
    if full:
        w.pipeline.request([], 0)
        w.pipeline.apply_if_idle()
        for key in w.layer_keys:  # the wake ends when every layer's bytes are in place
            w.store.ensure(key)
    w.sleeping = False
    w.wakes += 1
    w.last_wake_s = time.perf_counter() - t0
    w.last_wake_full = full
    logger.info("memx: awake in %.3f s (%s)", w.last_wake_s,
                "every layer resident" if full else "partial: layers come back as memory frees")  # fmt: skip
