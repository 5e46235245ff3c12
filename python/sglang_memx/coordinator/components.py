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

from sglang_memx.coordinator.parts import Iteration, Source, Step, source, step
from sglang_memx.elastic import demand, host_buffer, iteration, shared_pool, slo
from sglang_memx.elastic.ballooning import grow_over_activation, hold_head_activation
from sglang_memx.peer import server as peer_server
from sglang_memx.upstream import kv as up_kv
from sglang_memx.weights import lending, remap, sleep


@dataclass(eq=False)
class KVCore:
    """The KV space: its free list inside mapped groups, grown and shrunk (``ElasticKV``)."""

    kv: Any
    name: str = "kv space"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("cap request lengths", self._cap_request_lengths),
            step("work?", self._note_work),
            step("deflate", lambda it: iteration.deflate(it.kv, it.allocator, it.busy)),
            step("premap", self._premap),
        )

    def sources(self) -> tuple[Source, ...]:
        return (source("map from the local pool", lambda allocator, pages: self.kv.grow(allocator, pages)),)

    def status(self) -> dict[str, Any] | None:
        return None  # the KV space's own numbers are the section's body (``Coordinator.status``)

    @staticmethod
    def _cap_request_lengths(it: Iteration) -> None:
        if not it.kv.lengths_capped:  # once: the budget is read then
            iteration.cap_request_lengths(it.scheduler, it.kv, *it.coordinator.physical_budget())

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

    kv: Any
    lent: Any
    name: str = "shared-pool lender"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("consume wake-ups", lambda it: shared_pool.attend(it.kv, it.scheduler)),
            step("answer reclaims", self._answer_reclaim),
            step("give back, borrow", self._balance),
            step("report to the arbiter", self._report),
        )

    def sources(self) -> tuple[Source, ...]:
        return (source("borrow from the shared pool", self._borrow_shortfall),)

    def status(self) -> dict[str, Any] | None:
        return {"shared_pool": dict(self.lent.status(), chunk_bytes=self.kv.buffers.pool.chunk_bytes)}

    def _borrow_shortfall(self, allocator, pages: int) -> None:
        """Memory that looked growable when a chunked prefill was admitted may have gone back to the
        arbiter since (a RECLAIM answered between two of its chunks): borrow it at once (urgent)."""
        short = pages - up_kv.free_page_count(allocator)
        if short > 0 and shared_pool.borrow_tokens(self.kv, short * up_kv.page_size(allocator), urgent=True):
            self.kv.grow(allocator, pages)

    @staticmethod
    def _answer_reclaim(it: Iteration) -> None:
        weights = it.coordinator.part(WeightLender)
        release = None if weights is None else weights.release_for_reclaim
        shared_pool.answer_reclaim(it.kv, it.allocator, it.tree, it.scheduler, it.coordinator.activation_side(),
                                   release_layers=release)  # fmt: skip

    @staticmethod
    def _balance(it: Iteration) -> None:
        activation = it.coordinator.activation_side()
        shared_pool.balance(it.kv, it.allocator, it.tree, it.scheduler,
                            activation.head_prefill_chunks(it.scheduler), activation)  # fmt: skip

    @staticmethod
    def _report(it: Iteration) -> None:
        weights = it.coordinator.part(WeightLender)
        lendable = None if weights is None else weights.lendable_chunks
        shared_pool.report(it.kv, it.allocator, it.tree, it.scheduler, it.coordinator.activation_side(),
                           lendable=lendable)  # fmt: skip


@dataclass(eq=False)
class ActivationBalloonPart:
    """Activations sharing the pool (``memory_ext.pool.activation_balloon.ActivationBalloon``)."""

    kv: Any
    balloon: Any
    name: str = "activation balloon"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("end the activation's iteration", lambda it: self.balloon.end_iteration()),
            step("hold the head's activation",
                 lambda it: hold_head_activation(it.kv, self.balloon, it.allocator, it.tree, it.scheduler)),
        )  # fmt: skip

    def sources(self) -> tuple[Source, ...]:
        return (source("over the activation balloon", self._over_live_chunks),)

    def status(self) -> dict[str, Any] | None:
        return {"activation": self.balloon.status()}

    def _over_live_chunks(self, allocator, pages: int) -> None:
        grow_over_activation(self.kv, self.balloon, allocator, pages)

    # the activation side the shared pool and sleep ask (``shared_pool.ActivationSide``)
    def held_chunks(self) -> int:
        return self.balloon.held

    def idle_chunks(self) -> int:
        return self.balloon.idle()

    def next_step_chunks(self, scheduler) -> int:
        return demand.admitted_activation_chunks(self.balloon, scheduler, self.kv)

    def head_prefill_chunks(self, scheduler) -> int:
        return demand.head_activation_chunks(self.balloon, scheduler, self.kv)

    def release_idle(self, keep: int) -> None:
        self.balloon.release_idle(keep=keep)


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


@dataclass(eq=False)
class HostBufferPart:
    """The host KV buffer (``elastic.host_buffer.HostBufferState``)."""

    kv: Any
    host: Any
    name: str = "host buffer"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("park offloaded prefills", lambda it: host_buffer.park_offloaded_prefills(it.kv, it.scheduler)),
            step("host buffer size (Alg. 2)", lambda it: slo.observe(it.kv, it.scheduler)),
            step("fetch parked KV", self._fetch_parked),
            step("reopen admission for offload",
                 lambda it: iteration.reopen_admission_for_offload(it.kv, it.scheduler)),
        )  # fmt: skip

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"host_buffer": self.host.status()}

    @staticmethod
    def _fetch_parked(it: Iteration) -> None:  # first: the head's prefill size depends on its parked KV being back
        host_buffer.fetch_parked(it.kv, it.scheduler, int(demand.decode_reserve_tokens(it.scheduler)))


@dataclass(eq=False)
class WeightLender:
    """Decoder layers in the pool, lent to KV and back (``weights.state.WeightsState``)."""

    kv: Any
    weights: Any
    name: str = "weight lender"

    def steps(self) -> tuple[Step, ...]:
        return (
            step("sleep or wake", self._sleep_or_wake),
            step("Oneiros step", lambda it: remap.step(self.weights, it.kv, it.allocator, it.scheduler)),
        )

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return {"weights": self.weights.status()}

    def lendable_chunks(self) -> int:
        """Chunks releasing layers could free for the arbiter now (``weights.lending``)."""
        return lending.lendable_chunks(self.weights, self.kv)

    def release_for_reclaim(self, chunks: int) -> int:
        return lending.release_for_reclaim(self.weights, self.kv, chunks)

    def _sleep_or_wake(self, it: Iteration) -> None:
        if it.coordinator.part(SharedPoolLender) is not None:  # sleep gives the memory to the pool's peers
            sleep.step(self.weights, it.kv, it.allocator, it.tree, it.scheduler, it.coordinator.activation_side())


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

    kv: Any
    name: str = "peer donor / borrower"

    def steps(self) -> tuple[Step, ...]:
        return (step("peer tier step", self._tick, in_tick=False),)

    def sources(self) -> tuple[Source, ...]:
        return ()

    def status(self) -> dict[str, Any] | None:
        return None  # the tier reports under ``peer_kv`` (``status.scheduler_status``)

    def _tick(self, it: Iteration) -> None:
        streamed = it.coordinator.part(LayerStreamPart)  # the tier serves the layer stream cache too
        peer_server.tick(it.scheduler, self.kv, None if streamed is None else streamed.stream)
