"""W4: Algorithm 1's SCALEUP / SCALEDOWN of one worker, as pure functions of its counters
(R4, R5, R7, R8)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from .._checks import check_int as _int


class ScaleAction(str, enum.Enum):
    NONE = "none"
    SCALE_UP = "scale_up"  # worker reclaims from the master
    SCALE_DOWN = "scale_down"  # worker donates to the master


@dataclass(frozen=True)
class ScaleDecision:
    """Outcome of SCALEUP / SCALEDOWN. Counts are always >= 0; ``action`` gives the direction (R7)."""

    action: ScaleAction
    units: int  # k, whole MEUs moved
    worker_blocks: int  # k * MEU_i (worker gains on SCALE_UP, releases on SCALE_DOWN)
    master_blocks: int  # k * MEU_m (master releases on SCALE_UP, gains on SCALE_DOWN)
    needed_blocks: int  # need (up) or max_need (down)
    worker_blocks_before: int
    worker_blocks_after: int
    donated_blocks_after: int | None  # worker blocks lent to the master afterwards, if tracked
    shortfall_blocks: int = 0  # up only: blocks still missing because the donation ran out (R4)
    reason: str = ""

    @property
    def changed(self) -> bool:
        return self.units > 0


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """ceil(tokens / block_size), Alg. 1 lines 11 and 23."""
    _int("tokens", tokens)
    _int("block_size", block_size, minimum=1)
    return -(-tokens // block_size)


def check_meu(meu_worker: int, meu_master: int) -> None:
    _int("meu_worker", meu_worker, minimum=1)
    _int("meu_master", meu_master, minimum=1)


def scale_up(
    current_blocks: int,
    block_size: int,
    meu_worker: int,
    meu_master: int,
    request_len: int,
    *,
    donated_blocks: int | None = None,
) -> ScaleDecision:
    """Alg. 1 SCALEUP: reclaim ceil((need - N_i) / MEU_i) MEUs, capped by the donation (R4)."""
    _int("current_blocks", current_blocks)
    check_meu(meu_worker, meu_master)
    if donated_blocks is not None:
        _int("donated_blocks", donated_blocks)
    need = blocks_for_tokens(_int("request_len", request_len), block_size)
    if need <= current_blocks:
        return ScaleDecision(
            ScaleAction.NONE,
            0,
            0,
            0,
            need,
            current_blocks,
            current_blocks,
            donated_blocks,
            reason="allocation already covers the request",
        )
    diff = need - current_blocks
    k = -(-diff // meu_worker)
    reason = "reclaim whole MEUs for the request"
    if donated_blocks is not None:
        k_max = donated_blocks // meu_worker
        if k > k_max:
            k = k_max
            reason = "donation exhausted; reclaim all lent MEUs"
    after = current_blocks + k * meu_worker
    return ScaleDecision(
        ScaleAction.SCALE_UP if k else ScaleAction.NONE,
        k,
        k * meu_worker,
        k * meu_master,
        need,
        current_blocks,
        after,
        None if donated_blocks is None else donated_blocks - k * meu_worker,
        shortfall_blocks=max(0, need - after),
        reason=reason if k else "nothing lent to reclaim",
    )


def scale_down(
    current_blocks: int,
    block_size: int,
    meu_worker: int,
    meu_master: int,
    window_lengths: Iterable[int],
    *,
    min_blocks: int = 0,
    donated_blocks: int | None = None,
    max_donated_blocks: int | None = None,
) -> ScaleDecision:
    """Alg. 1 SCALEDOWN: release floor((N_i - max_need) / MEU_i) MEUs not needed by the last window (R5),
    at most up to ``max_donated_blocks`` donated in total (R8; needs ``donated_blocks``)."""
    _int("current_blocks", current_blocks)
    check_meu(meu_worker, meu_master)
    _int("min_blocks", min_blocks)
    if donated_blocks is not None:
        _int("donated_blocks", donated_blocks)
    if max_donated_blocks is not None:
        _int("max_donated_blocks", max_donated_blocks)
        if donated_blocks is None:
            raise ValueError("max_donated_blocks needs donated_blocks (what is lent already)")
    if isinstance(window_lengths, (str, bytes)):
        raise ValueError(f"window_lengths must be an iterable of ints, got {window_lengths!r}")
    max_len = 0
    for i, n in enumerate(window_lengths):
        max_len = max(max_len, _int(f"window_lengths[{i}]", n))
    max_need = blocks_for_tokens(max_len, block_size)
    floor_blocks = max(max_need, min_blocks)
    if floor_blocks >= current_blocks:
        return ScaleDecision(
            ScaleAction.NONE,
            0,
            0,
            0,
            max_need,
            current_blocks,
            current_blocks,
            donated_blocks,
            reason="recent demand needs the whole allocation",
        )
    k = (current_blocks - floor_blocks) // meu_worker
    reason = "release MEUs unused in the last window" if k else "surplus smaller than one MEU"
    if max_donated_blocks is not None:
        k_cap = max(0, max_donated_blocks - donated_blocks) // meu_worker
        if k > k_cap:
            k = k_cap
            reason = "donation cap reached" if not k else "release MEUs up to the donation cap"
    after = current_blocks - k * meu_worker
    return ScaleDecision(
        ScaleAction.SCALE_DOWN if k else ScaleAction.NONE,
        k,
        k * meu_worker,
        k * meu_master,
        max_need,
        current_blocks,
        after,
        None if donated_blocks is None else donated_blocks + k * meu_worker,
        reason=reason,
    )
