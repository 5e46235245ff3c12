"""The supervisor's rules (pure data): when a dead engine is started again (``RestartPolicy``,
``RestartBudget``) and how a live one is probed for a hang (``HealthProbe``).

Invariants: the policies reject bad values at construction, naming the field; a budget
counts only the attempts within the policy's window (time is passed in, never read).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["RestartPolicy", "RestartBudget", "HealthProbe", "BUSY_CPU_FRACTION", "READY_PATH", "READY_TIMEOUT_S",
           "SLEEP_POLL_S"]  # fmt: skip

SLEEP_POLL_S = 1.0  # how often the supervisor reads a sleeping-capable engine's state
# Readiness of a (re)started engine: upstream's /health runs a one-token generation and sleeps a
# whole second before it looks for the answer, so it never answers in under 1 s. A 1-second
# timeout passed only when asyncio's timer fired a hair early; on other machines a restarted
# engine never became awake (issue 27).
READY_PATH = "/health"
READY_TIMEOUT_S = 10.0
BUSY_CPU_FRACTION = 0.1  # a group using this much of one core while a probe waited is computing, not hung


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine is brought back: the k-th attempt within ``window_s`` waits
    ``min(backoff_max_s, backoff_s * 2**k)`` first; after ``max_restarts`` attempts within
    the window the engine is left ``dead`` (``max_restarts=0``: never restart)."""

    max_restarts: int = 3
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self):
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for name in ("window_s", "backoff_s", "backoff_max_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class HealthProbe:
    """How live engines are probed: a GET of ``path`` every ``interval_s`` (counted from the end
    of the previous probe, so probes never overlap), each given ``timeout_s``; ``failures``
    probes in a row without a 200 while the process lives: hung. The engine is declared hung
    at the earliest ``failures * timeout_s + (failures - 1) * interval_s`` after it stopped
    answering (plus up to one interval)."""

    interval_s: float = 5.0
    timeout_s: float = 10.0
    failures: int = 3
    path: str = "/memx/status"

    def __post_init__(self):
        for name in ("interval_s", "timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if isinstance(self.failures, bool) or not isinstance(self.failures, int) or self.failures < 1:
            raise ValueError(f"failures must be an integer >= 1, got {self.failures!r}")
        if not isinstance(self.path, str) or not self.path.startswith("/"):
            raise ValueError(f"path must be an absolute URL path, got {self.path!r}")


class RestartBudget:
    """The attempts of one engine within the policy's window (pure: time is passed in)."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.attempts: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next attempt, or None when the budget is spent."""
        while self.attempts and now - self.attempts[0] > self.policy.window_s:
            self.attempts.popleft()
        k = len(self.attempts)
        if k >= self.policy.max_restarts:
            return None
        return min(self.policy.backoff_max_s, self.policy.backoff_s * (2**k))

    def record(self, now: float) -> None:
        self.attempts.append(now)
