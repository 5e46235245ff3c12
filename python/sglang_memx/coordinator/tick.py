"""Once per scheduler iteration, before upstream picks the next batch: the coordinator's steps,
in its iteration order (``Coordinator.iteration_order``, built from each present component's
steps and their ranks, ``parts.ITERATION_RANKS``):

0. with a TPOT SLO, the governor times the previous decode step (``coordinator.governor``);
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
8. host buffer: fetch the parked requests' KV the next prefill batch can admit; reopen
   admission while the buffer has room for new prefills;
9. weights: sleep or wake, then one Oneiros step (release a layer under KV pressure, restore
   one when its lent memory is empty); applied by the layer pipeline at the next forward boundary;
10. hold the head request's prefill activation (evicting cached prefixes is safe here);
11. premap: map groups from FREE chunks (and idle activation when no prefill waits) so the
    next decode step finds its pages mapped (the request path then makes no map call),
    never from the chunks that step's activation reserve needs
    (``demand.decode_activation_chunks``): the step's path then makes no map and no unmap.

Then, after the tick's window, the peer tier's step (``components.PeerTier``). Without elastic
KV there is no coordinator and only the peer tier's step runs (it refuses to start without
elastic KV on a shared pool).
"""

from __future__ import annotations

from sglang_memx import compute_share, heap_trim
from sglang_memx.coordinator import device
from sglang_memx.peer import server as peer_server
from sglang_memx.upstream import scheduler as up_sched


def tick(scheduler) -> None:
    """The in-tick and after-tick steps of one iteration; nothing without elastic KV."""
    coordinator = device.of(up_sched.allocator(scheduler))
    if coordinator is not None:
        coordinator.tick(scheduler)


def per_iteration(scheduler) -> None:
    """Everything memx does before upstream picks the next batch; then, at the first idle
    iteration after work, the allocator's kept heap goes back to the system (``heap_trim``); last,
    the cores this engine computes on (``compute_share``: its idle co-located siblings' cores while it has work)."""
    coordinator = device.of(up_sched.allocator(scheduler))
    if coordinator is None:
        peer_server.tick(scheduler, None, None, None)
    else:
        coordinator.tick(scheduler)
    busy = bool(up_sched.admitted_reqs(scheduler)) or bool(up_sched.waiting(scheduler))
    heap_trim.tick(busy)
    if compute_share.in_use():  # an engine without a compute board counts nothing here
        decoded = up_sched.last_decode_batch(scheduler)
        compute_share.tick(busy, 0 if decoded is None else len(up_sched.batch_reqs(decoded)))
