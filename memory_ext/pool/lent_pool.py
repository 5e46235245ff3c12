"""LentPool: a process's ``ChunkPool`` filled with chunks borrowed from the device arbiter.

The engine's tensors acquire and release chunks from ``pool`` exactly as from a local pool; this
class moves chunks between that pool's FREE set and the arbiter:

* ``borrow(n, wait)`` asks the arbiter for ``n`` chunks (all or nothing) and adopts them into FREE;
  a refusal returns 0 (the engine then waits or retracts). It waits at most ``wait`` seconds: a grant
  that needs other processes to give memory back may take longer, and an engine thread must never
  block on another engine (two borrowers would each wait for the other to answer a reclaim). A reply
  that comes later is adopted into FREE then (or counted as a refusal); while one is outstanding,
  ``borrow`` asks nothing more and returns 0.
* ``give_back(n)`` disowns up to ``n`` FREE chunks and returns them; with ``warm`` and a ``warm_hold_s``
  they wait in ``warm`` instead (``warm_chunks``; not those a RECLAIM is owed): the next borrow
  takes them back without a round trip, a RECLAIM first, ``expire_warm`` when the hold ends.
* ``report(idle, headroom, busy)`` tells the arbiter's policy what this process could give back; it
  is sent only when a number changed (at most every ``REPORT_MIN_INTERVAL_S`` unless ``busy`` flips).
* ``wake_fd``: readable whenever the arbiter asked for something (a RECLAIM) or a late grant landed,
  so an engine thread sleeping in ``poll`` can wake up and act at once; ``drain_wakeups`` empties it.
* The arbiter's ``RECLAIM(n)`` is answered from the warm chunks at once (they are outside the
  engine's pool); the rest only adds to ``pending_reclaim``; the
  engine answers on its own thread (``take_pending_reclaim``, free memory,
  ``give_back``). It is never answered from the client's reclaim thread: the
  engine counts FREE chunks as memory it can map, and a chunk taken away
  between its check and its allocation would break that promise.

Invariant: every chunk of ``pool`` was lent by the arbiter (or kept from one
that died, below) and is either in the pool's ledger or being handed back; the
pool never creates chunks, so ``pool.available()`` counts only chunks actually
held (never a promise the arbiter might break). If the process dies the arbiter
takes every chunk back.

When the arbiter dies
---------------------
The chunks this process holds stay valid memory (memfd mappings of its own), so
it falls back to a *private budget* of exactly those: from the first call that
sees the connection gone, ``borrow`` returns 0 (counted in ``denied_total``),
``give_back`` keeps the chunks in FREE (nobody else could use them any more, the
engine can), ``report``/``link`` do nothing, a pending reclaim is dropped, and one
warning names the pool and the chunks kept; ``status()["arbiter"]`` says
``connected: false`` with ``lost_reason``, ``lost_at`` and ``private_budget_chunks``.
Nothing raises into the engine for it.

``maybe_rejoin()`` (the engine's tick; one ``connect`` at most every
``REJOIN_INTERVAL_S`` while lost) reconnects once the socket answers again (a new
arbiter, started by the next server that joins the pool, or by ``restart_arbiter``: a
callable the engine passes that starts a new arbiter if the old one *crashed*, so
survivors do not wait for a server to join) and ``ADOPT``s the kept chunks, so the
new arbiter's budget counts them (``arbiter_protocol``). Until
every kept chunk is booked, ``borrow`` still returns 0 (more memory would
over-commit the device), adoption is retried every ``REJOIN_INTERVAL_S``, and
``give_back`` destroys unbooked kept chunks first (then adopted ones, with a
``RELEASE``), so the over-commit only shrinks. Kept chunks given back are
destroyed here: they were never the new arbiter's to lend.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ..vmm.base import PhysicalChunk, VmmBackend
from .arbiter_client import ArbiterClient, ArbiterDenied, ArbiterError
from .ownership import ChunkPool
from .warm_chunks import WarmChunks

log = logging.getLogger(__name__)


class LentPool:
    # How an engine's borrowing treats the pool (``sglang_memx.elastic.shared_pool.borrow_chunks``):
    # a single client backs off after a refusal on its own clock; ``LockstepLentPool``'s ranks do not
    BACKS_OFF_ALONE = True
    ranks = 1  # clients that share the arbiter in step with this one, itself included
    borrows_paused = False  # never set here: a lockstep pool's ranks pause together
    REPORT_MIN_INTERVAL_S = 0.05
    REJOIN_INTERVAL_S = 1.0  # while lost (or partly adopted): how often to try the socket again
    REJOIN_TIMEOUT_S = 2.0  # longest a rejoin's HELLO / ADOPT may take

    def __init__(self, socket_path, name: str, backend: VmmBackend, *, timeout: float = 30.0,
                 restart_arbiter=None, warm_hold_s: float = 0.0):  # fmt: skip
        self._lock = threading.Lock()
        self._socket_path, self._name, self._backend, self._timeout = socket_path, name, backend, timeout
        self._restart_arbiter = restart_arbiter  # () -> bool: started a new arbiter (the old one crashed)
        self._closed = False
        self._lost = False  # the arbiter is gone and no new one took this process back yet
        self.lost_reason: str | None = None  # why the last arbiter connection ended
        self.lost_at: float | None = None  # when (wall clock)
        self._private: dict[int, PhysicalChunk] = {}  # chunks kept from a dead arbiter, by handle id
        self._adopted = 0  # of those, how many the current arbiter booked (ADOPT)
        self._next_rejoin = 0.0
        self.rejoins = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False  # set by ``_wake`` (any thread), cleared by ``drain_wakeups``
        self._last_report: tuple | None = None
        self._last_report_t = 0.0
        self.reports_sent = 0
        self._pending_reclaim = 0
        self.warm = WarmChunks(warm_hold_s)  # given up, still booked: the next borrow's, or a reclaim's
        self.borrowed_total = 0
        self.returned_total = 0
        self.denied_total = 0
        self.reclaim_requests = 0
        self.last_denied_available = 0  # what the arbiter said it could lend at its last refusal
        self.late_grants = 0
        self._outstanding = 0  # borrows whose reply had not come when we stopped waiting
        self._early_late_replies = 0  # late replies that beat their borrower's own timeout bookkeeping
        self.client = self._connect(timeout)
        self.pool = ChunkPool(backend, self.client.budget, create_chunks=False)

    def _connect(self, timeout: float) -> ArbiterClient:
        client = ArbiterClient(self._socket_path, self._name, self._backend, on_reclaim=self._on_reclaim,
                               timeout=timeout, on_late_reply=self._on_late_reply, on_lost=self._wake)  # fmt: skip
        client.timeout = self._timeout
        return client

    @property
    def budget_chunks(self) -> int:
        return self.client.budget

    def _unbooked(self) -> int:
        """Kept chunks no arbiter counts (caller holds ``_lock``)."""
        return len(self._private) - self._adopted

    def _check_lost(self) -> bool:
        """Whether this process runs on its private budget; the first call after the connection
        ended switches to it (module docstring)."""
        if self._lost:
            return True
        if self._closed or self.client.lost_reason is None:
            return False
        with self._lock:
            if self._lost:
                return True
            kept = self.client.detach_held()
            for c in kept:
                self._private[c.handle_id] = c
            self._warm_when_lost(self.warm.take_all())  # kept too: back in FREE (``LockstepLentPool``: destroyed)
            self._adopted = 0  # the dead arbiter's books are gone
            dropped, self._pending_reclaim = self._pending_reclaim, 0
            self._outstanding = self._early_late_replies = 0  # those replies will never come
            self._lost, self.lost_reason, self.lost_at = True, self.client.lost_reason, time.time()
            private = len(self._private)
        log.warning(
            "lent pool %s: lost the arbiter at %s (%s); falling back to a private budget of the %d chunk(s) "
            "(%.1f MiB) it holds%s; no borrowing until an arbiter answers there again",
            self._name, self._socket_path, self.lost_reason, private, private * self._backend.granularity / 2**20,
            f", dropped a pending reclaim of {dropped}" if dropped else "",
        )  # fmt: skip
        return True

    def _try_restart(self) -> bool:
        """Ask the engine's ``restart_arbiter`` to start a new arbiter; True when it says it did."""
        try:
            started = bool(self._restart_arbiter())
        except Exception as exc:  # noqa: BLE001 - the engine keeps serving on its private budget
            log.warning("lent pool %s: could not restart the arbiter: %s", self._name, exc)
            return False
        if started:
            log.warning("lent pool %s: the arbiter had crashed; started a new one at %s", self._name,
                        self._socket_path)  # fmt: skip
        return started

    def maybe_rejoin(self) -> bool:
        """From the engine's tick (cheap: nothing unless the arbiter is lost or kept chunks are
        unbooked, then one attempt every ``REJOIN_INTERVAL_S``): reconnect once the pool's
        socket answers and ``ADOPT`` the kept chunks. Returns True when it reconnected now."""
        if self._closed or (not self._check_lost() and self._unbooked() <= 0):
            return False
        now = time.monotonic()
        if now < self._next_rejoin:
            return False
        self._next_rejoin = now + self.REJOIN_INTERVAL_S
        rejoined = False
        if self._lost:
            try:
                client = self._connect(self.REJOIN_TIMEOUT_S)
            except (OSError, ArbiterError) as exc:
                log.debug("lent pool %s: no arbiter at %s yet: %s", self._name, self._socket_path, exc)
                if self._restart_arbiter is None or not self._try_restart():
                    return False
                try:
                    client = self._connect(self.REJOIN_TIMEOUT_S)
                except (OSError, ArbiterError) as exc2:
                    log.warning("lent pool %s: the restarted arbiter does not answer: %s", self._name, exc2)
                    return False
            if client.budget != self.client.budget:
                log.warning("lent pool %s: the arbiter at %s has a budget of %d chunk(s), this pool %d; staying "
                            "private", self._name, self._socket_path, client.budget, self.client.budget)  # fmt: skip
                client.close(force=True)
                return False
            old, self.client = self.client, client
            old.close(force=True)  # holds nothing: its chunks were detached into _private
            with self._lock:
                self._lost = False
                self.rejoins += 1
                self._last_report = None  # the new arbiter's policy has no numbers of ours yet
            rejoined = True
        with self._lock:
            want = self._unbooked()
        got = 0
        if want > 0:
            try:
                got = self.client.adopt(want)
            except ArbiterError as exc:
                log.warning("lent pool %s: ADOPT of %d kept chunk(s) failed: %s", self._name, want, exc)
            with self._lock:
                self._adopted += got
        if rejoined or got:
            rest = "" if got == want else " (the rest stays private: retried, destroyed first when given back)"
            log.warning("lent pool %s: %s the arbiter at %s; it booked %d of %d kept chunk(s)%s", self._name,
                        "rejoined" if rejoined else "still on", self._socket_path, got, want, rest)  # fmt: skip
        return rejoined

    def note_fell_short(self) -> None:
        """A borrow that may wait got less than it asked and no grant is on its way: nothing to
        note for a single client (it backs off); ``LockstepLentPool`` marks it for its ranks."""

    def available_now(self) -> int:
        """Chunks a borrow could have at once: the arbiter's (free + never created, one STATUS) and
        this client's warm ones."""
        if self._check_lost():
            return 0
        try:
            st = self.client.status()
        except ArbiterError:
            return len(self.warm)
        return st["free"] + st["budget"] - st["created"] + len(self.warm)

    def borrow(self, n: int, wait: float | None = None) -> int:
        """Borrow ``n`` chunks into FREE; return ``n``, or 0 if refused, not granted within
        ``wait`` seconds (default: the client's timeout), or a borrow is still outstanding."""
        if n <= 0:
            return 0
        if self._check_lost():
            with self._lock:
                self.denied_total += 1
                self.last_denied_available = 0
            return 0
        with self._lock:
            if self._outstanding:
                return 0
            if self._unbooked() > 0:  # kept chunks the arbiter does not count: borrowing would over-commit
                self.denied_total += 1
                self.last_denied_available = 0
                return 0
        warm = self.warm.take_exactly(n)
        if warm:  # booked as ours already: no round trip
            self.pool.adopt(warm)
            return n
        try:
            chunks = self.client.borrow(n, timeout=wait)
        except ArbiterDenied as exc:
            with self._lock:
                self.denied_total += 1
                self.last_denied_available = int(exc.available)
            log.debug("arbiter denied %d chunk(s): %s", n, exc)
            return 0
        except ArbiterError as exc:
            if exc.field is not None:
                raise
            if self._check_lost():
                with self._lock:
                    self.denied_total += 1
                    self.last_denied_available = 0
                return 0
            with self._lock:  # no reply in time: it will come to _on_late_reply
                if self._early_late_replies:  # ... unless it came already, before this line ran
                    self._early_late_replies -= 1
                else:
                    self._outstanding += 1
            return 0
        try:
            self.pool.adopt(chunks)
        except BaseException:
            self.client.give_back(chunks)
            raise
        with self._lock:
            self.borrowed_total += n
        return n

    @property
    def outstanding(self) -> bool:
        """A borrow's reply has not come yet (it will land in FREE, or count as a refusal)."""
        with self._lock:
            return self._outstanding > 0

    def _on_late_reply(self, msg: dict, chunks: list[PhysicalChunk]) -> bool:
        with self._lock:
            if msg["type"] not in ("GRANT", "DENY"):
                return False
            if self._outstanding == 0:  # the borrower timed out but has not counted it yet:
                self._early_late_replies += 1  # returned (a grant) and not waited for any more
                return False
            self._outstanding -= 1
            if msg["type"] == "DENY":
                self.denied_total += 1
                self.last_denied_available = int(msg.get("available", 0))
                self._wake()
                return False
        try:
            self._land_late(chunks)  # only adds FREE chunks: never breaks what the engine counted on
        except Exception:
            log.exception("lent pool: could not adopt a late grant; returning it")
            return False
        with self._lock:
            self.borrowed_total += len(chunks)
            self.late_grants += 1
        self._wake()
        return True

    def _land_late(self, chunks: list[PhysicalChunk]) -> None:
        self.pool.adopt(chunks)  # (client thread) ``LockstepLentPool`` keeps them warm instead

    def _warm_when_lost(self, chunks: list[PhysicalChunk]) -> None:
        self.pool.adopt(chunks)  # (caller holds ``_lock``)

    def give_back(self, max_chunks: int | None = None, *, wait: bool = True, warm: bool = False) -> int:
        """Return up to ``max_chunks`` (default: all) FREE chunks to the arbiter; return how many.
        Kept chunks (module docstring) are destroyed here instead; while the arbiter is lost,
        nothing goes (0). ``wait=False``: the arbiter's ACK is not waited for
        (``ArbiterClient.give_back``). ``warm`` (with a hold, and no kept chunks): they leave the
        engine's pool for ``warm`` instead, and go back when the hold ends (``expire_warm``)."""
        if self._check_lost():
            return 0
        chunks = self.pool.disown(max_chunks)
        if not chunks:
            return 0
        if warm and self.warm.hold_s > 0 and not self._private:
            owed = self.warm.put(chunks, time.monotonic())  # what a RECLAIM still waits for goes now
            if owed:
                self.client.give_back(owed, wait=False)
                with self._lock:
                    self.returned_total += len(owed)
            return len(chunks)
        with self._lock:
            kept = [c for c in chunks if self._private.get(c.handle_id) is c]
            for c in kept:
                del self._private[c.handle_id]
            # unbooked kept chunks go first: they over-commit the device
            release = max(0, len(kept) - (len(self._private) + len(kept) - self._adopted))
            self._adopted -= release
        for c in kept:
            self._backend.destroy_chunk(c)
        if release:
            try:
                self.client.release(release)
            except ArbiterError as exc:  # the connection died: its books went with it
                log.debug("lent pool %s: RELEASE of %d not answered: %s", self._name, release, exc)
        kept_ids = {id(c) for c in kept}
        lent = [c for c in chunks if id(c) not in kept_ids]
        if lent:
            self.client.give_back(lent, wait=wait)
            self.warm.paid(len(lent))
        with self._lock:
            self.returned_total += len(chunks)
        return len(chunks)

    def expire_warm(self) -> int:
        """From the engine's tick: once the hold has passed, the warm chunks go back (no ACK waited for)."""
        chunks = self.warm.take_expired(time.monotonic())
        if chunks:
            self.client.give_back(chunks, wait=False)
            with self._lock:
                self.returned_total += len(chunks)
        return len(chunks)

    def link(self, demand, link_bytes_per_s: float, active: bool = True, timeout: float = 0.2) -> dict | None:
        """Send ``demand`` (a ``policy.select_n.GpuDemand`` with ``iter_times`` for every
        interval) and the link bandwidth this process measured, as its demand on the shared
        host link; returns the arbiter's LINKED answer, or None when it could not be asked
        (the caller keeps its own limit)."""
        n = demand.num_layers
        if self._check_lost():
            return None
        try:
            return self.client.link(active=active, num_layers=n, layer_bytes=demand.layer_bytes,
                                    link_bytes_per_s=link_bytes_per_s,
                                    min_interval=demand.min_interval,
                                    iter_times=[demand.iter_times[i] for i in range(1, n + 2)],
                                    timeout=timeout)  # fmt: skip
        except ArbiterError as exc:
            if not self._check_lost():
                log.warning("lent pool: LINK not answered: %s", exc)
            return None

    def report_due(self, busy: bool) -> bool:
        """Whether ``report`` could send now (the interval passed, ``busy`` flips, or a RECLAIM is owed:
        the arbiter replans a short answer on it): lets the caller skip computing the numbers."""
        last, soon = self._last_report, time.monotonic() - self._last_report_t < self.REPORT_MIN_INTERVAL_S
        return last is None or last[2] != busy or not soon or self.warm.owed > 0

    def report(self, idle: int, headroom: int, busy: bool) -> bool:
        """Send the policy's numbers if they changed; returns whether a REPORT went out."""
        now = time.monotonic()
        numbers = (int(idle), int(headroom), bool(busy))
        last = self._last_report
        if numbers == last:
            return False
        soon = now - self._last_report_t < self.REPORT_MIN_INTERVAL_S and not self.warm.owed
        if last is not None and last[2] == numbers[2] and soon:
            return False
        if self._check_lost():
            return False
        try:
            self.client.report(*numbers)
        except ArbiterError:
            return False
        self._last_report, self._last_report_t = numbers, now
        self.reports_sent += 1
        return True

    def _on_reclaim(self, n: int) -> list[PhysicalChunk]:
        warm = self.warm.take_for_reclaim(n)  # outside the engine's pool: the reclaim thread may return them
        with self._lock:
            self.reclaim_requests += 1
            self._pending_reclaim += n - len(warm)
            self.returned_total += len(warm)
        if len(warm) < n:
            self._wake()
        return warm  # the rest is answered by the engine's thread (see the module docstring)

    def take_pending_reclaim(self, at_most: int | None = None) -> int:
        """Chunks the arbiter asked for since the last call (at most ``at_most``: the rest stays asked)."""
        self._check_lost()  # drops a reclaim the lost arbiter asked for
        with self._lock:
            n = self._pending_reclaim if at_most is None else max(0, min(at_most, self._pending_reclaim))
            self._pending_reclaim -= n
            return n

    def status(self) -> dict:
        self._check_lost()
        in_flight = self.client.returns_in_flight  # given back without waiting, not yet acknowledged
        with self._lock:
            warm = self.warm
            arbiter = {"connected": not self._lost, "lost_reason": self.lost_reason, "lost_at": self.lost_at,
                       "private_budget_chunks": self._unbooked(), "adopted_chunks": self._adopted,
                       "rejoins": self.rejoins}  # fmt: skip
            return {
                "budget_chunks": self.client.budget, "borrowed_total": self.borrowed_total,
                "returned_total": self.returned_total, "returns_in_flight": in_flight,
                "denied_total": self.denied_total, "reclaim_requests": self.reclaim_requests,
                "pending_reclaim": self._pending_reclaim, "late_grants": self.late_grants,
                "warm_chunks": len(warm), "warm_hold_s": warm.hold_s, "warm_reused_total": warm.reused_total,
                "warm_reclaimed_total": warm.reclaimed_total,
                "reclaim_owed": warm.owed,  # asked by a RECLAIM, not returned yet: never kept warm
                "outstanding": self._outstanding, "reports_sent": self.reports_sent,
                "held_chunks": len(self.client.held()) + len(self._private), "client_id": self.client.client_id,
                "arbiter": arbiter,
            }  # fmt: skip

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # a full pipe is already readable
        self._wake_pending = True  # after the write: a drain that sees it finds the byte, or a later one does

    def drain_wakeups(self) -> int:
        """Empty the wake pipe; return how many wake-ups were pending. Reads the pipe only after a
        wake-up was written (once per scheduler iteration, most find none: no system call then)."""
        if not self._wake_pending:
            return 0
        self._wake_pending = False  # before the read: a wake-up written meanwhile sets it again
        n = 0
        while True:
            try:
                got = os.read(self._wake_r, 4096)
            except (BlockingIOError, OSError):
                return n
            if not got:
                return n
            n += len(got)

    def close(self) -> None:
        """Give every FREE chunk back and disconnect (mapped chunks return when the socket closes;
        kept chunks, module docstring, are destroyed here unless mapped)."""
        try:
            self.pool.adopt(self.warm.take_all())  # warm chunks leave with the rest
            if not self._check_lost() and self.client.connected:
                self.give_back()
            else:
                for c in self.pool.disown():
                    if self._private.pop(c.handle_id, None) is c:
                        self._backend.destroy_chunk(c)
        finally:
            self._closed = True
            self.client.close(force=True)
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
