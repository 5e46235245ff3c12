"""The layer stream cache (SwiftCache W2, section 3.2): streamed layers' KV lives in a donor's memory.

An engine whose KV pool gives each token one slot shared by all layers (``k[layer][slot]``, as
SGLang's MHA pool) keeps, for the layers ``streamed``, no buffer of its own: all of them share one
local *staging* layer buffer (K and V), and their full-capacity K/V planes live in a pinned lease
of a donor (``PeerLink(pin_bytes=...)``, which the donor never reclaims while it lives). Around
each streamed layer's attention:

* ``load(layer, rows)``: the rows the batch reads (every slot of every request in it) are copied
  from the layer's planes at the donor into the staging buffer;
* the attention writes the new tokens' K/V into the staging buffer and reads it;
* ``store(layer, rows)``: the rows written (the new tokens' slots) are copied back.

Layout of the lease (bytes from 0): for streamed index ``s`` (the ``s``-th of ``streamed``), the K
plane ``rows x k_row_bytes`` then the V plane ``rows x v_row_bytes``; a row of a plane is the slot's
row of that layer's buffer. The lease's blocks (``PeerKVLayout``) play no part beyond its size.

Failure: the planes exist only at the donor, so a request whose streamed KV is there cannot go on
without it and cannot recompute part of it. When the donor is gone (or the lease no longer covers
the planes) ``load`` / ``store`` raise ``LayerStreamLost`` and ``broken`` says why; the caller
aborts the requests (the server: docs/peer-kv.md, "Layer stream cache (W2)"). A copy runs inside
``PeerLink.span``, so the donor's chunks are never unmapped under it; ``alive`` is checked after
each copy (a hang-up is seen at once), so bytes copied from a donor that died meanwhile are not
taken as valid.

Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ..policy._checks import check_int
from .link import PeerLink


class LayerStreamLost(RuntimeError):
    """The donor holding the streamed layers' KV is gone: the requests using it cannot continue."""


def plane_bytes(rows: int, k_row_bytes: int, v_row_bytes: int) -> int:
    """Bytes of one streamed layer at the donor (its K and V planes)."""
    return rows * (k_row_bytes + v_row_bytes)


class LayerStreamCache:
    def __init__(
        self,
        link: PeerLink,
        streamed: Sequence[int],
        staging_k: torch.Tensor,
        staging_v: torch.Tensor,
    ):
        if not isinstance(link, PeerLink):
            raise ValueError(f"link must be a PeerLink, got {type(link).__name__}")
        streamed = [check_int(f"streamed[{i}]", s) for i, s in enumerate(streamed)]
        if not streamed or len(set(streamed)) != len(streamed):
            raise ValueError(f"streamed: need distinct layer ids, got {streamed}")
        if staging_k.shape[0] != staging_v.shape[0] or staging_k.dtype != staging_v.dtype:
            raise ValueError("staging: K and V buffers need the same rows and dtype")
        if not (staging_k.is_contiguous() and staging_v.is_contiguous()):
            raise ValueError("staging: K and V buffers must be contiguous")
        self.link = link
        self.streamed = tuple(streamed)
        self._index = {layer: s for s, layer in enumerate(streamed)}
        self.staging_k, self.staging_v = staging_k, staging_v
        self.rows = staging_k.shape[0]
        self.k_row_bytes = staging_k[0].numel() * staging_k.element_size()
        self.v_row_bytes = staging_v[0].numel() * staging_v.element_size()
        self.plane_bytes = plane_bytes(self.rows, self.k_row_bytes, self.v_row_bytes)
        self.need_bytes = self.plane_bytes * len(streamed)
        have = link.usable_bytes
        if have < self.need_bytes:
            raise ValueError(
                f"pin_bytes: the lease holds {have} bytes, {len(streamed)} streamed layers of {self.rows} rows "
                f"need {self.need_bytes}"
            )
        self.broken: str | None = None
        self.stats: Counter[str] = Counter()

    def streams(self, layer: int) -> bool:
        return layer in self._index

    def _planes(self, view: torch.Tensor):
        k_bytes = self.rows * self.k_row_bytes
        k = view[:k_bytes].view(self.staging_k.dtype).view(self.staging_k.shape)
        v = view[k_bytes:].view(self.staging_v.dtype).view(self.staging_v.shape)
        return k, v

    def _move(self, layer: int, rows: torch.Tensor, *, to_peer: bool) -> None:
        if self.broken is not None:
            raise LayerStreamLost(self.broken)
        s = self._index[layer]
        copier = self.link.copier
        with self.link.span(s * self.plane_bytes, self.plane_bytes) as view:
            if view is None:
                self.broken = "the donor holding the streamed layers' KV is gone (lease closed or revoked)"
                raise LayerStreamLost(self.broken)
            peer_k, peer_v = self._planes(view)
            if to_peer:
                copier.copy_rows(peer_k, self.staging_k, rows)
                copier.copy_rows(peer_v, self.staging_v, rows)
            else:
                copier.copy_rows(self.staging_k, peer_k, rows)
                copier.copy_rows(self.staging_v, peer_v, rows)
            copier.fence(self.staging_v, peer_v)
        if not self.link.alive():
            self.broken = "the donor holding the streamed layers' KV died during a copy"
            raise LayerStreamLost(self.broken)
        n = int(rows.numel())
        kind = "stored" if to_peer else "loaded"
        self.stats[f"layers_{kind}"] += 1
        self.stats[f"rows_{kind}"] += n
        self.stats[f"bytes_{kind}"] += n * (self.k_row_bytes + self.v_row_bytes)

    def load(self, layer: int, rows: torch.Tensor) -> None:
        """Donor -> staging: rows ``rows`` of streamed layer ``layer``, before its attention."""
        self._move(layer, rows, to_peer=False)

    def store(self, layer: int, rows: torch.Tensor) -> None:
        """Staging -> donor: rows ``rows`` of streamed layer ``layer`` (written by its attention)."""
        self._move(layer, rows, to_peer=True)

    def status(self) -> dict:
        return {
            "streamed_layers": list(self.streamed),
            "rows": self.rows,
            "peer_bytes": self.need_bytes,
            "staging_bytes": self.rows * (self.k_row_bytes + self.v_row_bytes),
            "broken": self.broken,
            **dict(self.stats),
        }
