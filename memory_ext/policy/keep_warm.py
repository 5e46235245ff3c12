"""How many spare chunks a server in a shared pool keeps instead of giving them back unasked.

A server gives spare memory back to the device's arbiter when nothing waits, so a co-located
peer can borrow it without a reclaim. Given back at once, the memory a server used a moment ago
must be borrowed again for its next request: a round trip to the arbiter (and, for a prefill's
activation, the chunks mapped anew) on that request's TTFT, at every request of steady traffic
(``docs/elastic-kv.md``, "Keeping memory warm", measured it). A static split never pays this.

The rule: the chunks a server used at its busiest within the last ``window_s`` seconds stay with
it, beyond what it uses now; only what exceeds that recent peak goes back unasked. Nothing is
withheld from a peer that needs it: the kept chunks are still reported idle, and the arbiter's
reclaim takes them (``shared_pool.answer_reclaim`` ignores this rule). ``window_s = 0`` gives
everything spare back at once (the rule before it existed).

Numbers in, decisions out: ``now`` is passed in. Invariants: ``keep`` is in [0, recent peak -
in use]; an observation older than ``window_s`` never raises it; O(1) amortised per call.
"""

from __future__ import annotations

from collections import deque

from memory_ext.policy._checks import check_int, check_num

__all__ = ["DEFAULT_WINDOW_S", "KeepWarm", "WarmSpares"]

DEFAULT_WINDOW_S = 2.0  # ``--memx-pool-keep-warm-s``'s default


class KeepWarm:
    """The recent peak of a server's chunks in use, over a sliding window (module docstring)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S):
        self.window_s = check_num("window_s", window_s, 0.0)
        self._peaks: deque[tuple[float, int]] = deque()  # (time, chunks), chunks strictly decreasing
        self._last_now = -float("inf")

    def observe(self, now: float, in_use: int) -> None:
        """``in_use`` chunks were in use at ``now`` (seconds, never decreasing)."""
        check_num("now", now, self._last_now)
        check_int("in_use", in_use, 0)
        self._last_now = now
        while self._peaks and self._peaks[-1][1] <= in_use:
            self._peaks.pop()
        self._peaks.append((now, in_use))
        self._expire(now)

    def peak(self, now: float) -> int:
        """The most chunks in use seen within the last ``window_s`` seconds (0: none seen)."""
        self._expire(now)
        return self._peaks[0][1] if self._peaks else 0

    def keep(self, now: float, in_use: int) -> int:
        """Spare chunks to keep now: the recent peak beyond ``in_use`` (``observe`` it first)."""
        check_int("in_use", in_use, 0)
        return max(0, self.peak(now) - in_use)

    def _expire(self, now: float) -> None:
        while self._peaks and self._peaks[0][0] < now - self.window_s:
            self._peaks.popleft()


class WarmSpares:
    """A server's two kinds of spare, each kept by its own ``KeepWarm``: KV chunks (mapped groups;
    what deflation unmapped turns FREE) and activation chunks (what each forward used)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S):
        self.kv = KeepWarm(window_s)
        self.activation = KeepWarm(window_s)

    def observe(self, now: float, kv_chunks: int, activation_chunks: int) -> None:
        """This iteration: ``kv_chunks`` mapped for KV, ``activation_chunks`` used by the last forward."""
        self.kv.observe(now, kv_chunks)
        self.activation.observe(now, activation_chunks)

    def kv_keep(self, now: float, kv_chunks: int) -> int:
        """FREE chunks to keep: the recent peak of KV chunks beyond ``kv_chunks`` mapped now."""
        return self.kv.keep(now, kv_chunks)

    def activation_keep(self, now: float) -> int:
        """Activation chunks to keep held: the largest recent forward's (0 with a window of 0: the
        last forward is over, nothing is kept for the next)."""
        return self.activation.peak(now) if self.activation.window_s > 0 else 0

    def status(self, now: float) -> dict:
        return {"window_s": self.kv.window_s, "recent_peak_kv_chunks": self.kv.peak(now),
                "recent_peak_activation_chunks": self.activation.peak(now)}  # fmt: skip
