"""Spill and load pages between an engine's layer-major KV buffers and the peer tier.

What a server hook calls (docs/peer-kv.md, "Hooking into SGLang"): ``spill(tokens, slots)``
when the prefix cache is about to free the slots of a token path (eviction), ``load(tokens,
start, slots)`` when a request's prefix continues past what the device holds. Pages are
``block_tokens`` tokens; only full pages move. Pages the index already holds are not gathered
again (the tier asks for a page's bytes only when it writes it); a load reads each page into
one staging block, validates it and only then scatters it into its slots, and stops at the
first page that fails: the caller keeps the slots of the pages loaded and recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..policy._checks import check_int
from .kvpack import gather_block, layout_of_buffers, scatter_block
from .tier import PeerKVTier


class _GatheredPages(Sequence):
    """Page ``i``'s block, gathered from the KV buffers when (and only if) it is asked for."""

    def __init__(self, io: PeerKVIO, slots: torch.Tensor, n: int):
        self._io, self._slots, self._n = io, slots, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if not 0 <= i < self._n:
            raise IndexError(i)
        io, t = self._io, self._io.layout.block_tokens
        block = torch.empty(io.layout.block_shape, dtype=io.k_layers[0].dtype, device=io.k_layers[0].device)
        return gather_block(io.layout, io.k_layers, io.v_layers, self._slots[i * t : (i + 1) * t], block)


class _Repeat(Sequence):
    def __init__(self, item, n: int):
        self._item, self._n = item, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._item


class PeerKVIO:
    def __init__(self, tier: PeerKVTier, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor]):
        if not isinstance(tier, PeerKVTier):
            raise ValueError(f"tier must be a PeerKVTier, got {type(tier).__name__}")
        layout = layout_of_buffers(k_layers, v_layers, tier.layout.block_tokens, tier.layout.model)
        tier.layout.check_same(layout)
        self.tier, self.layout = tier, layout
        self.k_layers, self.v_layers = list(k_layers), list(v_layers)

    def _slots(self, slots, name: str) -> torch.Tensor:
        slots = torch.as_tensor(slots, dtype=torch.int64)
        if slots.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of slot indices, got shape {tuple(slots.shape)}")
        return slots

    def spill(self, tokens: Sequence[int], slots) -> int:
        """Store the full pages of ``tokens`` whose KV sits in ``slots`` (one slot per token)."""
        slots = self._slots(slots, "slots")
        if slots.numel() != len(tokens):
            raise ValueError(f"slots: {slots.numel()} slots for {len(tokens)} tokens")
        n = len(tokens) // self.layout.block_tokens
        return self.tier.store(tokens[: n * self.layout.block_tokens], _GatheredPages(self, slots, n))

    def load(self, tokens: Sequence[int], start: int, slots) -> int:
        """Load pages ``start, start+1, ...`` of ``tokens`` into ``slots`` (``block_tokens`` slots per
        page, as many pages as they hold); return how many pages are valid in a row."""
        check_int("start", start)
        slots = self._slots(slots, "slots")
        t = self.layout.block_tokens
        if slots.numel() % t:
            raise ValueError(f"slots: {slots.numel()} is not a whole number of {t}-token pages")
        n = min(slots.numel() // t, len(tokens) // t - start)
        if n <= 0:
            return 0
        staging = torch.empty(self.layout.block_shape, dtype=self.k_layers[0].dtype, device=self.k_layers[0].device)

        def scatter(i: int, block: torch.Tensor) -> None:
            scatter_block(self.layout, block, self.k_layers, self.v_layers, slots[i * t : (i + 1) * t])

        return self.tier.load(tokens[: (start + n) * t], _Repeat(staging, n), start=start, on_page=scatter)
