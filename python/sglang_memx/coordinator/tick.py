"""Once per scheduler iteration, before upstream picks the next batch: memx's housekeeping, in
the order ``STEPS`` lists (each step runs when the part it needs is on):

1. cap request lengths to the physical budget (once);
2. host buffer: offloaded prefills leave the last prefill batch and are parked once their
   first token is in (before anything reads that batch);
3. the previous forward is done: its activation chunks become idle;
4. shared pool: wake-ups consumed (an idle server sleeping with ``--sleep-on-idle`` is woken
   by the arbiter's requests), the arbiter's reclaims answered (layers of remappable weights
   too: ``weights.lending.release_for_reclaim``);
5. deflation: unmap groups whose pages are all free, keeping ``spare_groups`` while the
   server has work (none when idle, so an idle server holds only its cached prefixes);
6. host buffer: one Alg. 2 step from this iteration's TTFT / TPOT samples;
7. shared pool: give idle chunks back, borrow the queue's shortfall, report to the arbiter
   (with the chunks lending layers could free: ``weights.lending.lendable_chunks``);
8. host buffer: fetch the first parked request's KV when it can be admitted; reopen
   admission while the buffer has room for new prefills;
9. weights: sleep or wake, then one Oneiros step (release a layer under KV pressure, restore
   one when its lent memory is empty); applied by the layer pipeline at the next forward boundary;
10. hold the head request's prefill activation (evicting cached prefixes is safe here);
11. premap: map groups from FREE chunks (and idle activation when no prefill waits) so the
    next decode step finds its pages mapped (the request path then makes no map call),
    never from the chunks that step's activation reserve needs
    (``demand.decode_activation_chunks``): the step's path then makes no map and no unmap.

Then the peer tier's own step (``per_iteration``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sglang_memx import compute_share
from sglang_memx.elastic import demand, host_buffer, iteration, shared_pool, slo
from sglang_memx.elastic.ballooning import hold_head_activation
from sglang_memx.peer import server as peer_server
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.weights import lending, remap, sleep


@dataclass
class Iteration:
    """One tick's values: ``tree`` read at its start, ``busy`` set by its "work?" step (after the
    reclaims) and read by deflation and the premap."""

    scheduler: object
    allocator: object
    kv: object
    tree: object
    busy: bool = False


@dataclass(frozen=True)
class Step:
    name: str
    needs: str | None  # the ElasticKV part it runs with ("host", "activation", "lent", "weights"); None: always
    run: Callable[[Iteration], None]


def _answer_reclaim(it: Iteration) -> None:
    shared_pool.answer_reclaim(it.kv, it.allocator, it.tree, it.scheduler, release_layers=lending.release_for_reclaim)


def _note_work(it: Iteration) -> None:
    it.busy = iteration.has_work(it.scheduler)


def _balance(it: Iteration) -> None:
    shared_pool.balance(it.kv, it.allocator, it.tree, it.scheduler, demand.head_activation_chunks(it.kv, it.scheduler))


def _report(it: Iteration) -> None:
    shared_pool.report(it.kv, it.allocator, it.tree, it.scheduler, lendable=lending.lendable_chunks)


def _fetch_parked(it: Iteration) -> None:  # first: the head's prefill size depends on its parked KV being back
    host_buffer.fetch_parked(it.kv, it.scheduler, int(demand.decode_reserve_tokens(it.scheduler)))


def _reopen_admission(it: Iteration) -> None:
    iteration.reopen_admission_for_offload(it.kv, it.scheduler)


def _hold_head_activation(it: Iteration) -> None:
    hold_head_activation(it.kv, it.allocator, it.tree, it.scheduler)


def _premap(it: Iteration) -> None:
    if it.busy:
        iteration.premap(it.kv, it.allocator, it.scheduler)


STEPS = (
    Step("cap request lengths", None, lambda it: iteration.cap_request_lengths(it.scheduler, it.kv)),
    Step("park offloaded prefills", "host", lambda it: host_buffer.park_offloaded_prefills(it.kv, it.scheduler)),
    Step("end the activation's iteration", "activation", lambda it: it.kv.activation.end_iteration()),
    Step("consume wake-ups", "lent", lambda it: shared_pool.attend(it.kv, it.scheduler)),
    Step("answer reclaims", "lent", _answer_reclaim),
    Step("work?", None, _note_work),
    Step("deflate", None, lambda it: iteration.deflate(it.kv, it.allocator, it.busy)),
    Step("host buffer size (Alg. 2)", "host", lambda it: slo.observe(it.kv, it.scheduler)),
    Step("give back, borrow", "lent", _balance),
    Step("report to the arbiter", "lent", _report),
    Step("fetch parked KV", "host", _fetch_parked),
    Step("reopen admission for offload", "host", _reopen_admission),
    # after the reclaims and borrows: the demand the weights steps see is this iteration's
    Step("sleep or wake", "weights", lambda it: sleep.step(it.kv, it.allocator, it.tree, it.scheduler)),
    Step("Oneiros step", "weights", lambda it: remap.step(it.kv, it.allocator, it.scheduler)),
    Step("hold the head's activation", None, _hold_head_activation),
    Step("premap", None, _premap),
)  # fmt: skip


def tick(scheduler) -> None:
    """The elastic-KV steps of one iteration (``STEPS``); nothing without elastic KV."""
    allocator = up_sched.allocator(scheduler)
    kv = up_kv.elastic_of(allocator)
    if kv is None:
        return
    t0 = time.perf_counter()
    kv.phase = "tick"  # its unmaps are background work, not a request's path (ElasticKV.unmap_calls)
    try:
        it = Iteration(scheduler, allocator, kv, up_sched.tree_cache(scheduler))
        for step in STEPS:
            if step.needs is None or getattr(kv, step.needs) is not None:
                step.run(it)
    finally:
        kv.phase = "request"
    kv.stats["ticks"] += 1
    kv.stats["tick_seconds"] += time.perf_counter() - t0


def per_iteration(scheduler) -> None:
    """Everything memx does before upstream picks the next batch: the elastic-KV tick, the peer
    tier's step (it builds the tier on its first call), then the cores this engine computes on
    (``compute_share``: idle siblings' cores lent while it has work)."""
    tick(scheduler)
    peer_server.tick(scheduler)
    compute_share.tick(iteration.has_work(scheduler))
