"""The donor side of the peer tier: Algorithm 1 on the chunk-aligned MEU (R9) with a cap on the
donation (R8), its decisions also expressed in pool chunks."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_int as _int
from .elastic_unit import chunk_aligned_unit, min_elastic_unit
from .elastic_worker import ElasticWorkerPolicy
from .geometry import KVGeometry
from .scaling import ScaleAction, ScaleDecision, blocks_for_tokens


@dataclass(frozen=True)
class DonationStep:
    """One decision of a donor, in Alg. 1's terms and in what the mechanism moves."""

    decision: ScaleDecision
    chunks: int  # pool chunks that change hands (k * meu_bytes / chunk_bytes)
    master_blocks: int  # borrower blocks the donated region gains (donate) or loses (reclaim)

    @property
    def action(self) -> ScaleAction:
        return self.decision.action

    @property
    def donate(self) -> bool:
        return self.decision.action is ScaleAction.SCALE_DOWN

    @property
    def reclaim(self) -> bool:
        return self.decision.action is ScaleAction.SCALE_UP


class DonationPolicy:
    """A donor's Alg. 1 on the chunk-aligned MEU (R9), with a cap on the donation (R8).

    ``worker`` is the donor's geometry (its block: the smallest KV unit it can give back),
    ``master`` the borrower's. ``kv_tokens`` is the donor's whole KV capacity in tokens; it starts
    with all of it and donates nothing. ``on_demand(now, tokens)`` is SCALEUP for the donor's
    current demand (tokens it needs now), ``on_tick(now)`` SCALEDOWN over the last ``window_s``.
    """

    def __init__(
        self,
        worker: KVGeometry,
        master: KVGeometry,
        *,
        chunk_bytes: int,
        kv_tokens: int,
        max_donate_bytes: int | None = None,
        window_s: float = 60.0,
        min_tokens: int = 0,
    ) -> None:
        self.unit = chunk_aligned_unit(min_elastic_unit(master, worker), chunk_bytes)
        self.chunk_bytes = chunk_bytes
        total = _int("kv_tokens", kv_tokens) // worker.block_size
        cap = None
        if max_donate_bytes is not None:
            cap = _int("max_donate_bytes", max_donate_bytes) // self.unit.meu_bytes * self.unit.meu_worker
        self.policy = ElasticWorkerPolicy.from_unit(
            self.unit,
            block_size=worker.block_size,
            current_blocks=total,
            window_s=window_s,
            min_blocks=blocks_for_tokens(_int("min_tokens", min_tokens), worker.block_size),
            max_donated_blocks=cap,
        )

    @property
    def donated_chunks(self) -> int:
        return self.policy.donated_blocks // self.unit.meu_worker * self.unit.meu_bytes // self.chunk_bytes

    def _step(self, d: ScaleDecision) -> DonationStep:
        return DonationStep(d, d.units * self.unit.meu_bytes // self.chunk_bytes, d.master_blocks)

    def on_demand(self, now: float, tokens: int) -> DonationStep:
        return self._step(self.policy.on_request(now, tokens))

    def on_tick(self, now: float) -> DonationStep:
        return self._step(self.policy.on_tick(now))

    def still_lent(self, worker_blocks: int) -> None:
        """A reclaim the mechanism could not carry out (e.g. only pinned leases hold the memory):
        those blocks are still lent, and the donor does not have them."""
        _int("worker_blocks", worker_blocks)
        worker_blocks = min(worker_blocks, self.policy.current_blocks)
        self.policy.current_blocks -= worker_blocks
        self.policy.donated_blocks += worker_blocks

    def lost(self, worker_blocks: int) -> None:
        """The borrower is gone: its donation is the donor's again (the chunks came back)."""
        _int("worker_blocks", worker_blocks)
        worker_blocks = min(worker_blocks, self.policy.donated_blocks)
        self.policy.donated_blocks -= worker_blocks
        self.policy.current_blocks += worker_blocks
