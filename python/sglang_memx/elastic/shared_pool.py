"""A server's side of a shared pool (``--memx-pool NAME``): start or join the device's
arbiter, borrow what the queue needs, give back what is idle, answer reclaims, and
report to the arbiter's policy what could be given back.

One arbiter process per pool name (i.e. per device) listens on
``<pool dir>/NAME.sock``. The first server started with the name spawns it, in its
own session so it outlives that server, with the budget of
``--memx-pool-budget-gb``; a ``flock`` on ``NAME.lock`` makes concurrent first
starts spawn only one. Later servers join it; a budget or chunk size that differs
from the running arbiter's is refused, naming the flag. ``sglang-memx pool stop
NAME`` ends an arbiter. The pool directory is private (created 0700; an existing one
that another user owns or may write to is refused, naming ``--memx-pool-dir``), the
socket is 0600 and the arbiter refuses peers of another uid.

Where a shortfall is taken from is the arbiter's decision
(``memory_ext.policy.arbiter.plan_takes``, the simulator's too); this module feeds
it (``report``) and applies what it asks (``answer_reclaim``). What weights add to both (layers
lent to peers) the coordinator passes in: this package imports no other part of memx above it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from memory_ext.pool import Owner
from memory_ext.pool.arbiter_client import ArbiterError
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from memory_ext.proc import pid_alive
from memory_ext.vmm import private_dir
from sglang_memx import router_activity
from sglang_memx.config import MemxConfig, MemxConfigError, pool_owner_pid
from sglang_memx.elastic import demand
from sglang_memx.elastic.activation_side import ActivationSide
from sglang_memx.elastic.eviction import free_groups, idle_kv_chunks
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.elastic.paths import pool_dir, pool_socket
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import radix as up_radix
from sglang_memx.upstream import scheduler as up_sched

logger = logging.getLogger("sglang_memx")

GB = 1 << 30
BORROW_BACKOFF_S = 0.5
BORROW_BACKOFF_MAX_S = 1.0
QUEUE_WAIT_S = 0.02  # longest a scheduler iteration waits for a grant for its queue
URGENT_WAIT_S = 0.5  # ... for a decode step that would otherwise retract
CACHE_KEEP_RETRY_S = 1.0  # after the arbiter had nothing free for the cache, ask again no sooner
# spare chunks wait this long as the lent pool's warm chunks before they go back: the next request's
# borrow takes them without a round trip; a RECLAIM takes them at once (``memory_ext.pool.warm_chunks``)
WARM_HOLD_S = 1.0


# ------------------------------------------------------------------ the arbiter process
def _answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(1.0)
        s.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def ensure_arbiter(config: MemxConfig, chunk_bytes: int, timeout: float = 60.0) -> Path:
    """The pool's socket, starting its arbiter if none answers (needs the budget flag)."""
    directory = pool_dir(config)
    try:
        private_dir(directory)  # 0700 when memx creates it; refused if others own it or may write in it
    except PermissionError as exc:
        raise MemxConfigError("--memx-pool-dir", str(exc)) from None
    sock = pool_socket(config)
    with open(directory / f"{config.pool}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers(sock):
            return sock
        if config.pool_budget_gb is None:
            raise MemxConfigError(
                "--memx-pool-budget-gb", f"pool {config.pool!r} is not running ({sock}); give its budget to start it"
            )
        budget = int(config.pool_budget_gb * GB) // chunk_bytes
        if budget < 1:
            raise MemxConfigError("--memx-pool-budget-gb", f"{config.pool_budget_gb} GB is less than one chunk")
        if sock.exists():
            sock.unlink()  # stale socket of a dead arbiter
        cmd = [sys.executable, "-m", "memory_ext.pool.arbiter", "--socket", os.fspath(sock),
               "--budget-chunks", str(budget), "--granularity-kib", str(chunk_bytes >> 10),
               "--pid-file", os.fspath(directory / f"{config.pool}.pid")]  # fmt: skip
        owner = pool_owner_pid()
        if owner is not None:  # started under `sglang-memx serve`: the pool ends with it
            cmd += ["--owner-pid", str(owner)]
        with open(directory / f"{config.pool}.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
            )
        deadline = time.monotonic() + timeout
        while not _answers(sock):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the arbiter of pool {config.pool!r} exited with {proc.returncode}; "
                    f"see {directory / (config.pool + '.log')}"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the arbiter of pool {config.pool!r} did not answer within {timeout:g} s")
            time.sleep(0.05)
        logger.info(
            "memx: started the arbiter of pool %r (pid %d, budget %d chunk(s) of %d KiB) at %s",
            config.pool, proc.pid, budget, chunk_bytes >> 10, sock,
        )  # fmt: skip
        return sock


def restart_crashed_arbiter(config: MemxConfig, chunk_bytes: int) -> bool:
    """Start the pool's arbiter again if it *crashed* (SIGKILL, OOM kill): its pid file is still
    there and names a dead process. An arbiter stopped on purpose (SIGTERM, ``sglang-memx pool
    stop``, ``serve`` shutting down) removes its pid file, so nothing restarts it. Concurrent
    survivors start one arbiter: ``ensure_arbiter`` runs under the pool's lock. Returns whether
    an arbiter answers now because of this call."""
    pid_file = pool_dir(config) / f"{config.pool}.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    if pid_alive(pid):
        return False  # still alive (stuck, or exiting): not ours to replace
    ensure_arbiter(config, chunk_bytes)
    return True


def join_pool(config: MemxConfig, backend, *, ranks: int = 1) -> LentPool:
    """This process's link to the pool's arbiter (started if none answers); ``ranks`` > 1: one of that many
    tensor parallel ranks (``LockstepLentPool``: FREE changes only in the engine's calls, where the ranks
    agree)."""
    sock = ensure_arbiter(config, backend.granularity)
    restart = partial(restart_crashed_arbiter, config, backend.granularity)
    try:
        if ranks > 1:
            lent = LockstepLentPool(sock, f"sglang-{os.getpid()}", backend, warm_hold_s=WARM_HOLD_S,
                                    restart_arbiter=restart, ranks=ranks)  # fmt: skip
        else:
            lent = LentPool(sock, f"sglang-{os.getpid()}", backend, warm_hold_s=WARM_HOLD_S, restart_arbiter=restart)
    except ArbiterError as exc:
        if exc.field == "granularity":
            raise MemxConfigError(
                "--memx-chunk-kb", f"differs from the chunk size of pool {config.pool!r}: {exc}"
            ) from exc
        raise
    if config.pool_budget_gb is not None:
        mine = int(config.pool_budget_gb * GB) // backend.granularity
        if mine != lent.budget_chunks:
            lent.close()
            raise MemxConfigError(
                "--memx-pool-budget-gb",
                f"pool {config.pool!r} already runs with {lent.budget_chunks * backend.granularity / GB:g} GB; "
                f"give the same budget or leave the flag out to join it",
            )
    return lent


def register_server(config: MemxConfig, url: str | None) -> Path | None:
    """Leave ``<pool dir>/<pool>.server.<pid>.json`` so ``sglang-memx top`` can find this server."""
    if not config.pool or not url:
        return None
    path = pool_dir(config) / f"{config.pool}.server.{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "url": url, "pool": config.pool}))
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ waking up for the arbiter
def attend(kv: ElasticKV, lent: LentPool, scheduler) -> None:
    """Once per iteration: the first time, make an idle scheduler (``--sleep-on-idle``) wake up
    when the arbiter asks for memory, a late grant lands or the arbiter is lost (else a sleeping
    server would answer a reclaim only when its one-second sleep ends); then consume the
    wake-ups and return the warm chunks whose hold has passed. If the arbiter died, rejoin a new
    one once it answers (``LentPool.maybe_rejoin``: a no-op while connected; meanwhile the server
    runs on what it holds)."""
    if not kv.lent_wakeup_registered:
        up_sched.add_idle_wakeup(scheduler, lent.wake_fd)
        kv.lent_wakeup_registered = True
    lent.drain_wakeups()
    lent.expire_warm()
    lent.maybe_rejoin()


# ------------------------------------------------------------------ borrowing and giving back
def borrow_tokens(kv: ElasticKV, lent: LentPool, tokens: int, *, may_wait: bool = True, urgent: bool = False) -> int:
    """Borrow enough whole groups for ``tokens`` more tokens of KV (never more groups than KV
    could still map); return groups borrowed. Waiting, back-off: ``borrow_chunks``. Only on a
    shared pool (the coordinator's lender, or a caller it gates)."""
    if tokens <= 0:
        return 0
    unmapped = kv.num_groups - kv.buffers.num_mapped - kv.affordable_groups()
    groups = min(-(-tokens // kv.buffers.group_rows), max(0, unmapped))
    return borrow_chunks(kv, lent, groups, kv.buffers.chunks_per_group, may_wait=may_wait, urgent=urgent)


def borrow_chunks(
    kv: ElasticKV, lent: LentPool, units: int, unit_chunks: int = 1, *, may_wait: bool = True, urgent: bool = False
) -> int:
    """Borrow ``units`` units of ``unit_chunks`` chunks (KV: whole groups; an activation: single
    chunks, which KV's capacity does not bound); return units borrowed.

    ``may_wait=False`` takes only what the arbiter has free right now. ``may_wait=True`` may
    make the arbiter reclaim from other servers; the scheduler waits for the grant at most
    ``QUEUE_WAIT_S`` (``URGENT_WAIT_S`` when ``urgent``: a decode step that would otherwise
    retract), and a grant that comes later lands in the pool for the next iteration (see
    ``LentPool.borrow``): a scheduler never blocks on another server. After a refusal it backs
    off, doubling from ``BORROW_BACKOFF_S`` up to ``BORROW_BACKOFF_MAX_S`` (``urgent`` ignores
    the back-off); a grant resets it. A borrow whose grant is still on its way (the arbiter is
    reclaiming from peers) is no refusal: nothing more is asked until it lands, without back-off.

    Tensor parallel ranks (a ``LockstepLentPool``) neither back off nor note a refusal here: each rank's
    clock would end its back-off in another tick, one rank would borrow alone and be evened back for
    ever; the ranks' evening notes a refusal on every rank and pauses their borrows, on a clock they
    agree on (``coordinator.rank_pools``: ``borrows_paused``).
    """
    if units <= 0:
        return 0
    now = time.monotonic()
    if lent.borrows_paused:
        return 0
    if not urgent and lent.BACKS_OFF_ALONE and now < kv.borrow_backoff_until:
        return 0
    if not may_wait:
        units = min(units, lent.available_now() // unit_chunks)
    if units <= 0:
        return 0
    wait = URGENT_WAIT_S if urgent else QUEUE_WAIT_S
    got = units if lent.borrow(units * unit_chunks, wait=wait) else 0
    if not got and may_wait:  # take what can be had now; a tensor parallel rank its ranks' share of it
        # (denied one after the other, the second rank sees half left and takes a quarter: the evening
        # sheds the first back to it, so the ranks ramp up over a few refusals instead of one)
        share = lent.last_denied_available // lent.ranks
        fewer = min(units - 1, share // unit_chunks)
        got = fewer if fewer > 0 and lent.borrow(fewer * unit_chunks, wait=wait) else 0
    if may_wait and got < units and not lent.outstanding:
        lent.note_fell_short()
    if got:
        kv.borrow_backoff_s = BORROW_BACKOFF_S
    elif may_wait and not lent.outstanding and lent.BACKS_OFF_ALONE:
        note_refused(kv, now)
    return got


def note_refused(kv: ElasticKV, now: float | None = None) -> None:
    """The arbiter could not fund a borrow: back off (``borrow_chunks``), which also lets an active
    server remap its own layers (``weights.remap.shared_pool_holds``). Tensor parallel ranks call it
    on every rank when one rank came out short (``coordinator.rank_pools``)."""
    now = time.monotonic() if now is None else now
    delay = kv.borrow_backoff_s or BORROW_BACKOFF_S
    kv.borrow_backoff_until = now + delay
    kv.borrow_backoff_s = min(BORROW_BACKOFF_MAX_S, delay * 2)


def spare_free_chunks(kv: ElasticKV, allocator, scheduler, activation: ActivationSide) -> int:
    """FREE chunks not needed for the running requests' remaining decode, nor for the activation
    of their next step (a decode step, or a chunked prefill's next chunk): those may go back.

    A running request was admitted against memory counted as available; giving that memory
    away would make its later decode steps fail (upstream then retracts or aborts it).
    """
    return spare_chunks(kv, demand.running_demand_tokens(scheduler), up_kv.free_page_count(allocator),
                        activation.next_step_chunks(scheduler), activation.held_chunks())  # fmt: skip


def spare_chunks(kv: ElasticKV, running_tokens: int, free_pages: int, next_step: int, held: int) -> int:
    """``spare_free_chunks`` from its inputs, read once by a caller that needs them again:
    the running requests' remaining tokens, the free pages mapped, the activation chunks their
    next step needs and the chunks the activation holds."""
    free = kv.buffers.pool.held_by(Owner.FREE)
    if free <= 0:
        return 0
    need = running_tokens - free_pages * kv.page_size
    keep = -(-max(0, need) // kv.buffers.group_rows) * kv.buffers.chunks_per_group
    keep += max(0, next_step - held)  # their next step's activation
    return max(0, free - keep)


def answer_reclaim(kv: ElasticKV, lent: LentPool, allocator, tree, scheduler, activation: ActivationSide,
                   release_layers: Callable[[int], int] | None = None, *,
                   agreed: int | None = None) -> int:  # fmt: skip
    """Free and return the chunks the arbiter asked for (idle activation, free groups, then
    cached prefixes, then, with remappable weights, layers: ``release_layers(chunks)``, which
    the coordinator passes when the weights are in the pool); return how many chunks went back.

    ``agreed`` (tensor parallel ranks, ``coordinator.rank_pools``): the chunks every rank frees, the
    largest ask of any rank, so that every rank evicts the same prefixes; each gives back its own ask
    (at most ``agreed``; the rest of its ask waits for the next agreement)."""
    pending = lent.take_pending_reclaim(at_most=agreed)
    freeing = pending if agreed is None else agreed
    if freeing <= 0:
        return 0
    activation.release_idle(keep=activation.next_step_chunks(scheduler))  # idle activation is the cheapest
    free_groups(kv, allocator, tree, -(-freeing // kv.buffers.chunks_per_group))
    if release_layers is not None:  # an inactive server's layers go next (Oneiros: inactive first)
        release_layers(freeing - spare_free_chunks(kv, allocator, scheduler, activation))
    return lent.give_back(min(pending, spare_free_chunks(kv, allocator, scheduler, activation)))


def report(kv: ElasticKV, lent: LentPool, allocator, tree, scheduler, activation: ActivationSide,
           lendable: Callable[[], int] | None = None) -> None:  # fmt: skip
    """The arbiter policy's numbers for this server: chunks it could give back now (spare FREE,
    empty groups, evictable cache, idle activation beyond the decode steps' need, and what
    ``lendable()`` says releasing weights' layers would free: the coordinator passes it), how
    many of those its waiting queue wants to keep, and whether it has work; requests the router
    holds for this model (``router_activity``) count as work and their demand as headroom.
    Computed only when a report could go out (``LentPool.report_due``)."""
    busy = bool(up_sched.waiting(scheduler)) or bool(up_sched.admitted_reqs(scheduler))
    if not lent.report_due(busy or router_activity.holds_requests()):
        return
    idle = spare_free_chunks(kv, allocator, scheduler, activation) + idle_kv_chunks(kv, allocator, tree)
    idle += len(lent.warm)  # given up already, returned the moment the arbiter asks
    if lendable is not None:
        idle += lendable()  # 0 unless remappable weights of an inactive model
    idle += max(0, activation.idle_chunks() - activation.next_step_chunks(scheduler))
    wanted = demand.prefill_batch_demand_tokens(scheduler)  # the queue's demand beyond the running requests'
    headroom = min(idle, -(-max(0, wanted) // kv.buffers.group_rows) * kv.buffers.chunks_per_group)
    headroom, busy = router_activity.report_numbers(kv, idle, headroom, busy)  # requests queued at the router
    lent.report(idle, headroom, busy)


def balance(kv: ElasticKV, lent: LentPool, allocator, tree, scheduler, activation_chunks: int,
            activation: ActivationSide, restore_chunks: int = 0) -> None:  # fmt: skip
    """Give unused chunks back when nothing waits, borrow the queue's shortfall (the coordinator
    reports right after: ``report``).

    The shortfall is counted in chunks: the KV groups the queue's demand needs beyond the mapped
    free pages and the evictable cache (at most the groups KV can still map), plus the head's
    prefill activation (``activation_chunks``), against what the local pool has outside KV (FREE
    and the activation's chunks). Counted in KV tokens instead, idle activation chunks would
    count twice (as growable KV in ``available_size`` and as the activation), and a request
    whose KV and activation need more than the pool holds would wait without anything asked.

    Cached prefixes are kept while the arbiter has memory nobody holds: when the queue's demand
    would be met by evicting them, the groups that eviction would free are borrowed instead,
    only from what the arbiter can grant at once (never reclaimed from another server). Another
    server that needs memory later gets it back through a RECLAIM, which evicts them
    (``answer_reclaim``); the report counts them as idle. When the arbiter had nothing free,
    the next such borrow waits ``CACHE_KEEP_RETRY_S`` (each costs the arbiter a STATUS).

    ``restore_chunks``: what a restore of remappable weights waits for (tensor parallel ranks on a
    shared pool borrow for it here: ``remap.take_restore_ask``); kept out of the give-back, asked
    with the rest.
    """
    free_pages = up_kv.free_page_count(allocator)  # giving back FREE chunks does not change it
    if up_sched.waiting(scheduler):
        queue_tokens = demand.queue_demand_tokens(scheduler)
    else:  # nothing waits: unused chunks go back; the queue's demand is the running requests'
        queue_tokens = demand.running_demand_tokens(scheduler)
        next_step = activation.next_step_chunks(scheduler)
        if activation.held_chunks() > next_step:
            activation.release_idle(keep=next_step)  # keep their next step's
        spare = spare_chunks(kv, queue_tokens, free_pages, next_step, activation.held_chunks()) - restore_chunks
        if spare > 0:
            lent.give_back(spare, wait=False, warm=True)  # no round trip; warm for the next borrow
    beyond_free = queue_tokens - free_pages * kv.page_size
    if beyond_free <= 0 and activation_chunks <= 0 and restore_chunks <= 0:
        return  # the mapped free pages cover it and no prefill or restore waits: nothing to borrow
    kv_short = beyond_free - up_radix.evictable_tokens(tree)
    unmapped = kv.num_groups - kv.buffers.num_mapped
    groups = min(-(-max(0, kv_short) // kv.buffers.group_rows), unmapped)
    held = activation.held_chunks()
    short = groups * kv.buffers.chunks_per_group + activation_chunks + restore_chunks - kv.buffers.pool.available()
    short -= held
    if short > 0:
        borrow_chunks(kv, lent, short)
    elif beyond_free > 0 and groups < unmapped and time.monotonic() >= kv.cache_keep_until:
        # the rest would come from evicting cached prefixes
        cache_groups = min(-(-beyond_free // kv.buffers.group_rows), unmapped) - groups
        keep = cache_groups * kv.buffers.chunks_per_group + short  # short <= 0: what the pool has spare
        if keep > 0 and not borrow_chunks(kv, lent, keep, may_wait=False):  # one STATUS a second at most
            kv.cache_keep_until = time.monotonic() + CACHE_KEEP_RETRY_S
