"""An engine's side of its device's compute board: compute on the cores idle siblings leave.

``sglang-memx serve`` gives each engine of a CPU device its own share of the device's cores
(``serve/launcher.py``) and, when the device has several engines, a compute board
(``memory_ext.pool.compute_board``) and three variables:

* ``MEMX_COMPUTE_BOARD``: the board file; ``MEMX_COMPUTE_SLOT``: this engine's slot;
* ``MEMX_COMPUTE_SHARES``: every slot's own cores, ``"0;1"`` (``ComputeShares.parse``).

Once per scheduler iteration ``tick`` publishes whether this engine has work (requests
waiting or running; the coordinator's tick asks) and asks ``memory_ext.policy.compute_share.offer``
(one read of the board: flags and last-busy stamps) which cores it may compute on; when idle
siblings' cores are on offer, ``memory_ext.policy.lending_trial``
decides from measured iteration times whether taking them pays (own and lent cores in
alternating blocks, while a sibling has work: lent only when faster per decoding request in
every pair). While every sibling is idle the lent cores are the whole device, what one stock
server alone on it computes on: a second trial (``whole``) takes them unless the own cores were
measured 5 % cheaper on the mean and in every one of its 3 pairs, or 15 % cheaper on the mean
and in 2 of them, or over 2x cheaper in one pair at an unchanged batch (a model too small for a
second OpenMP thread, or whose helper processes find no free core). Only iterations that ran a
pure decode batch are measured: a prefill's cost would bias the blocks. When the answer changes,
the scheduler process's threads are moved to those cores and torch's intra-op thread count
follows (one OpenMP thread per core). Without the variables (one server alone, stock's command line) nothing here runs.

Invariants: the decisions are the policies'; an engine with no work returns to its own share
at its next iteration; beside a busy sibling, without a measurement that lending pays the engine
stays on its own share; beside idle siblings only, it leaves the whole device only for its own
share measured faster; a board that cannot be used is logged once and the engine
keeps its own share (it serves as with a static split, never worse).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memory_ext.policy.compute_share import ComputeShares, Offer, offer
from memory_ext.policy.lending_trial import LendingTrial
from memory_ext.pool.compute_board import ComputeBoard

__all__ = ["BOARD_ENV", "SLOT_ENV", "SHARES_ENV", "ComputeLender", "ComputeShares", "in_use", "tick", "status"]

logger = logging.getLogger("sglang_memx")

BOARD_ENV, SLOT_ENV, SHARES_ENV = "MEMX_COMPUTE_BOARD", "MEMX_COMPUTE_SLOT", "MEMX_COMPUTE_SHARES"


def _apply_cores(cores: tuple[int, ...]) -> None:
    """Every thread of this process onto ``cores``; torch computes with one thread per core."""
    import torch

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(len(cores))


@dataclass
class ComputeLender:
    """This engine's slot on its device's board, and the cores it computes on now."""

    board: ComputeBoard
    slot: int
    table: ComputeShares
    apply: Callable[[tuple[int, ...]], None] = _apply_cores  # tests pass a recorder
    trial: LendingTrial = field(default_factory=LendingTrial)  # while some sibling has work
    whole: LendingTrial = field(default_factory=lambda: LendingTrial(prefer_lent=True, pairs=3, gain=0.95, hold_s=30.0,
                                                                     max_hold_s=480.0))  # fmt: skip
    quiet_s: float = 2.0  # every sibling idle this long before the whole device is tried
    cores: tuple[int, ...] = ()
    changes: int = 0
    last_offer: Offer = Offer((), False, False)  # the policy's answer at the last step (status); none yet
    _last: tuple[float, bool, bool] | None = None  # previous iteration: (start, lent, whole) if a trial counts it

    def step(self, busy: bool, now: float, decoded: int = 0) -> tuple[int, ...]:
        """Publish ``busy``, then move to the policies' cores if they changed; returns them.
        ``decoded``: requests of the pure decode batch the iteration that just ended ran (0: it ran
        a prefill or mixed batch, or nothing; then it is not measured)."""
        if self._last is not None and busy and decoded > 0:  # a decode step on unchanged cores: count it
            start, lent, whole = self._last
            (self.whole if whole else self.trial).observe(lent, now - start, decoded, now)
        self.board.publish(self.slot, os.getpid(), busy, now)
        slots = self.board.states(own_slot=self.slot, now=now)  # our slot reads the ``busy`` just published
        own = self.table.shares[self.slot]
        on_offer = offer(self.slot, self.table, [s.busy for s in slots], [s.stamp for s in slots], now, self.quiet_s)
        offered, siblings_idle = on_offer.cores, on_offer.whole_device
        self.last_offer = on_offer
        lending = offered != own and (self.whole if siblings_idle else self.trial).want_lent(now)
        want = offered if lending else own
        changed = want != self.cores
        if changed:
            self.apply(want)
            self.cores = want
            self.changes += 1
        trial_counts = busy and offered != own and not changed
        self._last = (now, lending, siblings_idle) if trial_counts else None
        return want

    def status(self) -> dict[str, Any]:
        last = self.last_offer
        return {
            "slot": self.slot,
            "own_cores": list(self.table.shares[self.slot]),
            "cores": list(self.cores),
            "shares": self.table.render(),
            "busy_slots": [i for i, b in enumerate(self.board.busy_flags()) if b],
            "changes": self.changes,
            "whole_device_after_idle_s": self.quiet_s,
            "siblings_quiet": last.quiet,  # every sibling idle that long at the last step
            "lending": (self.whole if last.whole_device else self.trial).status(),  # in force
            "lending_beside_busy_siblings": self.trial.status(),
            "lending_whole_device": self.whole.status(),
        }


_lender: ComputeLender | None = None
_failed = False


def from_environment(environ=os.environ) -> ComputeLender | None:
    """The lender the launcher's variables describe; None without them. Raises ValueError naming
    the variable when they are malformed."""
    path = environ.get(BOARD_ENV)
    if not path:
        return None
    try:
        slot = int(environ.get(SLOT_ENV, ""))
    except ValueError:
        raise ValueError(f"{SLOT_ENV}: {environ.get(SLOT_ENV)!r} is not a slot number") from None
    table = ComputeShares.parse(environ.get(SHARES_ENV, ""))
    board = ComputeBoard.open(path)
    if board.slots != table.slots or not 0 <= slot < table.slots:
        raise ValueError(f"{SLOT_ENV}: slot {slot} of {table.slots} shares on a board of {board.slots} slots")
    return ComputeLender(board, slot, table)


def in_use() -> bool:
    """False once this engine is known to have no usable board: the caller then skips counting
    its requests for ``tick`` (nothing here would read them)."""
    return not _failed


def tick(busy: bool, decoded: int = 0) -> None:
    """One iteration's publish-and-decide, ``busy``: requests wait or run in this engine;
    ``decoded``: requests of the pure decode batch the iteration that just ended ran, 0 if it
    ran none (nothing without the launcher's variables)."""
    global _lender, _failed
    if _failed:
        return
    if _lender is None:
        try:
            _lender = from_environment()
        except (OSError, ValueError) as e:
            logger.error("memx: compute board not used, the engine keeps its own cores: %s", e)
            _failed = True
            return
        if _lender is None:
            _failed = True  # not under a launcher with a board: never look again
            return
    _lender.step(busy, time.monotonic(), decoded)


def status() -> dict[str, Any] | None:
    """The lender's section of /memx/status (None: no board)."""
    return None if _lender is None else _lender.status()
