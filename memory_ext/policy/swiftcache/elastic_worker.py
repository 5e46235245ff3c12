"""W4 bookkeeping: the sliding request window (R6) and one worker's allocation and donation,
updated by the decisions of Algorithm 1."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .._checks import check_int as _int
from ._inputs import number as _num
from .elastic_unit import ElasticUnit
from .scaling import ScaleDecision, check_meu, scale_down, scale_up


class RequestWindow:
    """Request lengths seen in the last ``window_s`` seconds (inclusive, R6). Caller supplies time."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = _num("window_s", window_s)
        self._items: deque[tuple[float, int]] = deque()
        self._last = float("-inf")

    def record(self, now: float, request_len: int) -> None:
        now = _num("now", now, positive=False)
        _int("request_len", request_len)
        if now < self._last:
            raise ValueError(f"now must not go backwards: {now} < {self._last}")
        self._last = now
        self._items.append((now, request_len))

    def lengths(self, now: float) -> tuple[int, ...]:
        now = _num("now", now, positive=False)
        cutoff = now - self.window_s
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()
        return tuple(n for ts, n in self._items if ts <= now)

    def max_len(self, now: float) -> int:
        return max(self.lengths(now), default=0)


@dataclass
class ElasticWorkerPolicy:
    """Bookkeeping for one worker: allocation and blocks lent to the master, both in worker blocks.

    ``on_request`` runs SCALEUP (never reclaims more than is lent), ``on_tick`` runs
    SCALEDOWN over the last window. Each returns the decision and applies it to the
    counters; the caller performs the actual remap and block-table sync.
    """

    block_size: int
    meu_worker: int
    meu_master: int
    current_blocks: int
    donated_blocks: int = 0
    window_s: float = 60.0
    min_blocks: int = 0
    max_donated_blocks: int | None = None
    _window: RequestWindow = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _int("block_size", self.block_size, minimum=1)
        check_meu(self.meu_worker, self.meu_master)
        _int("current_blocks", self.current_blocks)
        _int("donated_blocks", self.donated_blocks)
        _int("min_blocks", self.min_blocks)
        if self.max_donated_blocks is not None:
            _int("max_donated_blocks", self.max_donated_blocks)
        self._window = RequestWindow(self.window_s)

    @classmethod
    def from_unit(cls, unit: ElasticUnit, **kw) -> ElasticWorkerPolicy:
        return cls(meu_worker=unit.meu_worker, meu_master=unit.meu_master, **kw)

    @property
    def total_blocks(self) -> int:
        return self.current_blocks + self.donated_blocks

    def _apply(self, d: ScaleDecision) -> ScaleDecision:
        self.current_blocks = d.worker_blocks_after
        if d.donated_blocks_after is not None:
            self.donated_blocks = d.donated_blocks_after
        return d

    def on_request(self, now: float, request_len: int) -> ScaleDecision:
        self._window.record(now, request_len)
        return self._apply(
            scale_up(
                self.current_blocks,
                self.block_size,
                self.meu_worker,
                self.meu_master,
                request_len,
                donated_blocks=self.donated_blocks,
            )
        )

    def on_tick(self, now: float) -> ScaleDecision:
        return self._apply(
            scale_down(
                self.current_blocks,
                self.block_size,
                self.meu_worker,
                self.meu_master,
                self._window.lengths(now),
                min_blocks=self.min_blocks,
                donated_blocks=self.donated_blocks,
                max_donated_blocks=self.max_donated_blocks,
            )
        )
