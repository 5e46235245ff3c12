"""The memory mechanisms of one device as coordinator components (``parts.Component``).

Each holds the typed object it stands for (never ``None``: a mechanism that is off is a
component that is not registered) and names its steps and sources; their ranks place them
in the two orders (``parts.ITERATION_RANKS``, ``parts.SOURCE_RANKS``).

* ``KVCore``: the KV space itself (always present): request-length cap, deflation, premap;
  source: map groups from the local pool.
* ``SharedPoolLender``: a shared pool's arbiter link (``--memx-pool``): wake-ups, reclaims,
  give back / borrow, report; source: an urgent borrow of the shortfall.
* ``ActivationBalloonPart``: activations sharing the pool (ballooning): the iteration's end,
  the head's prefill activation held; source: map over live activation chunks when they only
  count torch's allocations. Where another mechanism asks an activation's numbers and there is
  none, the coordinator passes ``NoActivation``.
* ``HostBufferPart``: the host KV buffer (``--memx-host-buffer-gb``).
* ``WeightLender``: decoder layers in the pool (``--memx-weights``): sleep / wake, Oneiros.
* ``LayerStreamPart``: the layer stream cache's staging layers (``--memx-peer-layer-stream``).
* ``PeerTier``: the peer KV tier's donor / borrower step (``--memx-peer-kv``), after the tick.

The governor's component (``--memx-tpot-slo-ms``) is in ``coordinator.governor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memory_ext.pool.activation_balloon import ActivationBalloon
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.coordinator.governor import GovernorPart
from sglang_memx.coordinator.parts import Iteration, Source, Step, source, step
from sglang_memx.coordinator.rank_agreement import RankAgreement
from sglang_memx.coordinator.rank_pools import RankPools
from sglang_memx.coordinator.swa_spaces import SwaSpaces
from sglang_memx.elastic import demand, host_buffer, iteration, shared_pool, slo
from sglang_memx.elastic.ballooning import grow_over_activation, hold_head_activation, reserve_activation
from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.peer import server as peer_server
from sglang_memx.upstream import kv as up_kv
from sglang_memx.weights import lending, remap, sleep


@dataclass(eq=False)
class KVCore:
    """The KV space: its free list inside mapped groups, grown and shrunk (``ElasticKV``)."""

    kv: ElasticKV
    name: str = "kv space"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("cap request lengths", self._cap_request_lengths),
            step("work?", self._note_work),
            step("deflate", lambda it: iteration.deflate(it.kv, it.allocator, it.busy)),
            step("premap", self._premap),
            step(
                "reopen admission when the head fits",
                lambda it: iteration.reopen_admission_when_head_fits(it.kv, it.scheduler, it.allocator, it.tree),
            ),
        )

    def sources(self) -> tuple[Source, ...]:
        return (source("map from the local pool", lambda allocator, pages: self.kv.grow(allocator, pages)),)

    def status(self) -> dict[str, Any] | None:
        return None  # the KV space's own numbers are the section's body (``Coordinator.status``)

    @staticmethod
    def _cap_request_lengths(it: Iteration) -> None:
        if not it.kv.lengths_capped:  # once: the budget is read then
            swa = it.coordinator.part(SwaSpaces)  # a hybrid sliding-window model: both spaces back each token
            rule = iteration.physical_max_tokens if swa is None else (lambda kv, b, k: swa.physical_max_tokens(b, k))
            iteration.cap_request_lengths(it.scheduler, it.kv, *it.coordinator.physical_budget(), max_tokens=rule)

    @staticmethod
    def _note_work(it: Iteration) -> None:
        it.busy = iteration.has_work(it.scheduler)

    @staticmethod
    def _premap(it: Iteration) -> None:
        if it.busy:
            keep = it.coordinator.activation_side().next_step_chunks(it.scheduler)
            iteration.premap(it.kv, it.allocator, it.scheduler, keep)


@dataclass(eq=False)
class SharedPoolLender:
    """This server's side of the device's shared pool (``memory_ext.pool.lent_pool.LentPool``)."""

    kv: ElasticKV
    lent: LentPool
    name: str = "shared-pool lender"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("consume wake-ups", lambda it: shared_pool.attend(it.kv, self.lent, it.scheduler)),
            step("answer reclaims", self._answer_reclaim),
            step("give back, borrow", self._balance),
            step("report to the arbiter", self._report),
        )

    def sources(self) -> tuple[Source, ...]:  # a lockstep pool borrows in the tick only (``rank_pools``)
        if isinstance(self.lent, LockstepLentPool):
            return ()
        return (source("borrow from the shared pool", self._borrow_shortfall),)

    def status(self) -> dict[str, Any] | None:
        return {"shared_pool": dict(self.lent.status(), chunk_bytes=self.kv.buffers.pool.chunk_bytes)}

    def _borrow_shortfall(self, allocator, pages: int) -> None:
        """Memory that looked growable when a chunked prefill was admitted may have gone back to the
        arbiter since (a RECLAIM answered between two of its chunks): borrow it at once (urgent)."""
        short = pages - up_kv.free_page_count(allocator)
        if short > 0 and shared_pool.borrow_tokens(self.kv, self.lent, short * up_kv.page_size(allocator), urgent=True):
            self.kv.grow(allocator, pages)

    def _lending_weights(self, it: Iteration) -> WeightLender | None:
        """The weights whose layers may answer the arbiter's reclaims: None at --tp > 1 (which layers to
        release is planned from what each rank measures alone; the ranks would part)."""
        return None if it.coordinator.part(RankPools) is not None else it.coordinator.part(WeightLender)

    def _answer_reclaim(self, it: Iteration) -> None:
        weights = self._lending_weights(it)
        release = None if weights is None else (lambda chunks: weights.release_for_reclaim(self.lent, chunks))
        ranks = it.coordinator.part(RankPools)  # --tp > 1: every rank frees the ranks' agreed ask
        shared_pool.answer_reclaim(it.kv, self.lent, it.allocator, it.tree, it.scheduler,
                                   it.coordinator.activation_side(), release_layers=release,
                                   agreed=None if ranks is None else ranks.take_agreed_reclaim())  # fmt: skip

    def _balance(self, it: Iteration) -> None:
        activation = it.coordinator.activation_side()
        weights = it.coordinator.part(WeightLender)  # a lockstep pool's restore borrows here (``remap``)
        restore = 0 if weights is None else remap.take_restore_ask(weights.weights)
        shared_pool.balance(it.kv, self.lent, it.allocator, it.tree, it.scheduler,
                            activation.head_prefill_chunks(it.scheduler), activation, restore)  # fmt: skip

    def _report(self, it: Iteration) -> None:
        weights = self._lending_weights(it)
        lendable = None if weights is None else (lambda: weights.lendable_chunks(self.lent))
        shared_pool.report(it.kv, self.lent, it.allocator, it.tree, it.scheduler, it.coordinator.activation_side(),
                           lendable=lendable)  # fmt: skip


@dataclass(eq=False)
class ActivationBalloonPart:
    """Activations sharing the pool (``memory_ext.pool.activation_balloon.ActivationBalloon``)."""

    kv: ElasticKV
    balloon: ActivationBalloon
    host: HostBufferState | None = None  # the host buffer's pinned prefixes count as cached (``demand``)
    name: str = "activation balloon"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("end the activation's iteration", lambda it: self.balloon.end_iteration()),
            step("hold the head's activation",
                 lambda it: hold_head_activation(it.kv, self.balloon, it.allocator, it.tree, it.scheduler,
                                             self.host, it.coordinator.borrow_pool())),
        )  # fmt: skip

    def sources(self) -> tuple[Source, ...]:
        return (source("over the activation balloon", self._over_live_chunks),)

    def status(self) -> dict[str, Any] | None:
        return {"activation": self.balloon.status()}

    def _over_live_chunks(self, allocator, pages: int) -> None:
        grow_over_activation(self.kv, self.balloon, allocator, pages)

    # the activation side the other mechanisms ask (``elastic.activation_side.ActivationSide``)
    def held_chunks(self) -> int:
        return self.balloon.held

    def idle_chunks(self) -> int:
        return self.balloon.idle()

    def next_step_chunks(self, scheduler) -> int:
        return demand.admitted_activation_chunks(self.balloon, scheduler, self.host)

    def head_prefill_chunks(self, scheduler) -> int:
        return demand.head_activation_chunks(self.balloon, scheduler, self.host)

    def release_idle(self, keep: int) -> None:
        self.balloon.release_idle(keep=keep)

    def admission_cost_pages(self, tokens: int, seqs: int) -> int:
        need = self.balloon.need_chunks(tokens, seqs)
        return self.kv.activation_cost_pages(need - self.balloon.live)

    def reserve(self, allocator, tree, tokens: int, seqs: int, *, lent: LentPool | None, urgent: bool = False) -> bool:
        return reserve_activation(self.kv, self.balloon, allocator, tree, tokens, seqs, lent=lent, urgent=urgent)

    def live_chunks(self) -> int:
        return self.balloon.live

    def set_live_chunks(self, chunks: int) -> None:
        self.balloon.live = chunks

    def count(self, event: str) -> None:
        self.balloon.stats[event] += 1


class NoActivation:
    """The activation side of a pool no activation shares: it holds, needs and releases nothing.
    Not a component: what the coordinator passes where an activation's numbers are asked and
    there is none (``Coordinator.activation_side``)."""

    def held_chunks(self) -> int:
        return 0

    def idle_chunks(self) -> int:
        return 0

    def next_step_chunks(self, scheduler) -> int:
        return 0

    def head_prefill_chunks(self, scheduler) -> int:
        return 0

    def release_idle(self, keep: int) -> None:
        return None

    def admission_cost_pages(self, tokens: int, seqs: int) -> int:
        return 0

    def reserve(self, allocator, tree, tokens: int, seqs: int, *, lent: LentPool | None, urgent: bool = False) -> bool:
        return True  # nothing to hold: every batch fits as far as activations go

    def live_chunks(self) -> int:
        return 0

    def set_live_chunks(self, chunks: int) -> None:
        return None

    def count(self, event: str) -> None:
        return None


@dataclass(eq=False)
class HostBufferPart:
    """The host KV buffer (``elastic.host_buffer.HostBufferState``)."""

    kv: ElasticKV
    host: HostBufferState
    name: str = "host buffer"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("park offloaded prefills", lambda it: host_buffer.park_offloaded_prefills(self.host, it.scheduler)),
            step("host buffer size (Alg. 2)", self._alg2_step),
            step("fetch parked KV", self._fetch_parked),
            step("reopen admission for offload",
                 lambda it: iteration.reopen_admission_for_offload(self.host, it.scheduler)),
        )  # fmt: skip

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"host_buffer": self.host.status()}

    def _alg2_step(self, it: Iteration) -> None:
        """Alg. 2 from this iteration's TTFT / TPOT samples, timed with this rank's clock, or at
        --tp > 1 with rank 0's (``RankAgreement.tick_time``: the samples and the buffer's size then agree)."""
        ranks = it.coordinator.part(RankAgreement)
        slo.observe(self.host, it.scheduler, None if ranks is None or self.host.rule is None else ranks.tick_time())

    def _fetch_parked(self, it: Iteration) -> None:  # first: the queue's prefill sizes need their parked KV back
        reserve = int(demand.decode_reserve_tokens(it.scheduler))
        governor = it.coordinator.part(GovernorPart)  # a request it would not let in is not fetched
        host_buffer.fetch_parked(it.kv, self.host, it.coordinator.activation_side(), it.scheduler, reserve,
                                 None if governor is None else governor.would_admit)  # fmt: skip


@dataclass(eq=False)
class WeightLender:
    """Decoder layers in the pool, lent to KV and back (``weights.state.WeightsState``)."""

    kv: ElasticKV
    weights: Any
    name: str = "weight lender"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("sleep or wake", self._sleep_or_wake),
            step("Oneiros step", self._oneiros_step),
        )

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"weights": self.weights.status()}

    def lendable_chunks(self, lent: LentPool) -> int:
        """Chunks releasing layers could free for the arbiter of ``lent`` now (``weights.lending``)."""
        return lending.lendable_chunks(self.weights, self.kv, lent)

    def release_for_reclaim(self, lent: LentPool, chunks: int) -> int:
        return lending.release_for_reclaim(self.weights, self.kv, lent, chunks)

    def _oneiros_step(self, it: Iteration) -> None:
        ranks = it.coordinator.part(RankAgreement)  # --tp > 1: every rank applies rank 0's decision
        remap.step(self.weights, it.kv, it.allocator, it.scheduler, it.coordinator.shared_pool(),
                   it.coordinator.host_buffer(), rank0s=None if ranks is None else ranks.rank0s)  # fmt: skip

    def _sleep_or_wake(self, it: Iteration) -> None:
        lent = it.coordinator.shared_pool()
        if lent is not None:  # sleep gives the memory to the pool's peers
            ranks = it.coordinator.part(RankAgreement)  # --tp > 1: every rank applies rank 0's answer
            sleep.step(self.weights, it.kv, lent, it.allocator, it.tree, it.scheduler, it.coordinator.activation_side(),
                       rank0s=None if ranks is None else ranks.rank0s)  # fmt: skip


@dataclass(eq=False)
class LayerStreamPart:
    """The layer stream cache's plan and staging layers (``peer.layer_stream.LayerStreamSetup``);
    its per-iteration work runs in the peer tier's step, its status in the peer tier's."""

    stream: Any
    name: str = "layer stream"

    def steps(self) -> tuple[Step, ...]:
        return ()

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return None


@dataclass(eq=False)
class PeerTier:
    """The peer KV tier (donor / borrower, ``peer.server``), built on its first step."""

    kv: ElasticKV
    name: str = "peer donor / borrower"

    def steps(self) -> tuple[Step, ...]:
        return (step("peer tier step", self._tick, in_tick=False),)

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return None  # the tier reports under ``peer_kv`` (``status.scheduler_status``)

    def _tick(self, it: Iteration) -> None:
        streamed = it.coordinator.part(LayerStreamPart)  # the tier serves the layer stream cache too
        stream = None if streamed is None else streamed.stream
        peer_server.tick(it.scheduler, self.kv, it.coordinator.shared_pool(), stream)
