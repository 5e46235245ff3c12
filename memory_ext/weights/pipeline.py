"""LayerPipeline: the per-layer steps of a forward over a WeightStore.

Before layer ``i`` runs, ``before_layer(i)`` waits for its bytes (``WeightStore.ensure``) and
starts fetching the next streamed layers in forward order into the free staging slots; after
it ran, ``after_layer(i)`` evicts it if it is streamed (its slot is free again) and fetches
the next streamed layer into that slot. The order is circular: after the last layer the
first streamed layers of the next forward are fetched, so a decode step starts with them in
place.

A change of the streamed set is requested from any thread (``request``) and applied between
forwards: by ``begin_forward`` on the forward's thread, or by ``apply_if_idle`` when no
forward runs (a layer is never released while a forward may be reading it).
Engine-agnostic: the engine calls the steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable, Sequence

from .store import WeightStore


class LayerPipeline:
    def __init__(self, store: WeightStore, order: Sequence[Hashable]):
        missing = [k for k in order if k not in store.keys]
        if missing:
            raise ValueError(f"order: layers {missing} are not in the store")
        self.store = store
        self.order = list(order)
        self._next = {k: self.order[(i + 1) % len(self.order)] for i, k in enumerate(self.order)}
        self._lock = threading.Lock()
        self._forward_lock = threading.RLock()  # held while a change is applied or a forward runs its layers
        self._in_forward = False
        self._pending: tuple[frozenset, int] | None = None
        self.last_change: dict | None = None
        self.forwards = 0
        self.forward_seconds = 0.0
        self.last_layer_seconds = 0.0  # the last forward's time inside decoder layers (after their waits)
        self._t0: float | None = None
        self._layer_t0 = 0.0
        self._layer_sum = 0.0

    # --------------------------------------------------------- plan changes
    def request(self, streamed: Iterable[Hashable], slots: int) -> None:
        """Ask for ``streamed`` layers through ``slots`` slots from the next forward on."""
        with self._lock:
            self._pending = (frozenset(streamed), int(slots))

    def pending(self) -> tuple[frozenset, int] | None:
        with self._lock:
            return self._pending

    def apply_if_idle(self) -> dict | None:
        """Apply a requested change now unless a forward is running (it then applies at the next
        forward's start). An engine with no forward to run (a request waits for the memory this
        change frees) needs this."""
        with self._forward_lock:
            return None if self._in_forward else self.apply_pending()

    def apply_pending(self) -> dict | None:
        """Apply a requested change now (the caller guarantees no forward is running)."""
        with self._lock:
            plan, self._pending = self._pending, None
        if plan is None:
            return None
        change = self.store.set_streamed(plan[0], plan[1])
        if change["not_restored"]:  # the pool could not back them yet: ask again next time
            with self._lock:
                if self._pending is None:
                    self._pending = plan
        self.last_change = change
        self._prefetch_from(self.order[-1])
        return change

    # ---------------------------------------------------------- the forward
    def begin_forward(self) -> None:
        with self._forward_lock:
            self.apply_pending()
            self._in_forward = True
        self._layer_sum = 0.0
        self._t0 = time.perf_counter()

    def end_forward(self) -> None:
        with self._forward_lock:
            self._in_forward = False
        if self._t0 is not None:
            self.last_layer_seconds = self._layer_sum
            self.forwards += 1
            self.forward_seconds += time.perf_counter() - self._t0
            self._t0 = None

    def before_layer(self, key: Hashable) -> None:
        self.store.ensure(key)
        self._prefetch_from(key)
        self._layer_t0 = time.perf_counter()

    def after_layer(self, key: Hashable) -> None:
        self._layer_sum += time.perf_counter() - self._layer_t0
        if not self.store.is_resident(key):
            self.store.evict(key)
            self._prefetch_from(key)

    def _prefetch_from(self, key: Hashable) -> None:
        """Fetch streamed layers after ``key`` (circularly) while slots are free."""
        k = self._next[key]
        for _ in range(len(self.order)):
            if not self.store.is_resident(k) and not self.store.is_fetched(k) and not self.store.fetch(k):
                return  # no free slot
            k = self._next[k]
