"""The borrower's peer tier: its links to donors, the prefix index, and which block takes a page.

``store(tokens, pages)`` puts the KV of every full page of ``tokens`` that the index does not
hold yet into donated blocks (``pages[i]``: page ``i``'s block-major KV, ``layout.block_shape``
or ``block_bytes`` bytes). Blocks come from a donor's free blocks first, else the least recently
used block of the donor with the most blocks is overwritten (its old page leaves the index).
Each donor's blocks are written in one fenced ``PeerLink.write``.

``load(tokens, out, start)`` copies the longest run of held pages from page ``start`` (the
first page not held locally; a page's chain hash covers its whole prefix, so the run can start
anywhere) into ``out`` and returns how many pages are valid. A page whose read fails validation (reclaimed, overwritten,
donor gone) is dropped from the index and ends the run: the caller recomputes from there.

Tier bookkeeping is under one lock that is never held across a link's copy or round trip
(links call back into the tier from their receiver threads). One link per donor socket is the
tier's (``links()``): a link registers only while alive, and only the registered link's grow,
revoke and death touch the tier, so a link that died before ``connect`` returned is never kept
(a server would take its donor for linked and never link to it again).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import torch

from ..vmm.base import VmmBackend
from .index import PrefixIndex, chain_hashes
from .layout import PeerKVLayout
from .link import PeerLink


class PeerKVTier:
    def __init__(self, layout: PeerKVLayout, *, salt: bytes = b""):
        if not isinstance(layout, PeerKVLayout):
            raise ValueError(f"layout must be a PeerKVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.salt = repr(sorted(layout.to_wire().items())).encode() + salt
        self.index = PrefixIndex()
        self._lock = threading.Lock()
        self._links: dict[str, PeerLink] = {}
        self._free: dict[str, set[int]] = {}
        self._lru: dict[str, OrderedDict[int, bytes]] = {}  # block -> page hash, oldest first
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ donors
    def connect(self, socket_path, name: str, backend: VmmBackend, **kw) -> PeerLink:
        """Open a lease with the donor at ``socket_path`` (ValueError if it refuses our layout)."""
        link = PeerLink(
            socket_path,
            name,
            self.layout,
            backend,
            on_grow=self._on_grow,
            on_revoke=self._on_revoke,
            on_dead=self._on_dead,
            **kw,
        )
        with self._lock:
            self._register(link)
        return link

    def links(self) -> list[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def _register(self, link: PeerLink) -> bool:
        """Whether ``link`` is the tier's link to its donor, making it so when there is none and it
        is alive (lock held). A link marks itself dead before its ``on_dead`` takes this lock, so a
        link registered here always gets its ``_on_dead``."""
        if link.peer not in self._links and not link.dead:
            self._links[link.peer] = link
        return self._links.get(link.peer) is link

    def _on_grow(self, link: PeerLink, blocks: range) -> None:
        with self._lock:
            if not self._register(link):
                return
            self._free.setdefault(link.peer, set()).update(blocks)
            self._lru.setdefault(link.peer, OrderedDict())

    def _on_revoke(self, link: PeerLink, blocks: range) -> None:
        with self._lock:
            if self._links.get(link.peer) is not link:
                return
            self._free.get(link.peer, set()).difference_update(blocks)
            lru = self._lru.get(link.peer, {})
            for b in blocks:
                lru.pop(b, None)
            self.stats["entries_dropped_reclaim"] += self.index.drop_blocks(link.peer, blocks)

    def _on_dead(self, link: PeerLink) -> None:
        with self._lock:
            if self._links.get(link.peer) is not link:
                return  # never the tier's (died before ``connect`` registered it): nothing of it here
            del self._links[link.peer]
            self._free.pop(link.peer, None)
            self._lru.pop(link.peer, None)
            self.stats["entries_dropped_dead"] += self.index.drop_peer(link.peer)
            self.stats["donors_lost"] += 1

    # ------------------------------------------------------------------ data
    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return chain_hashes(tokens, self.layout.block_tokens, self.salt)

    def _take_block(self) -> tuple[str, int] | None:
        """A block to write (lock held): a free one, else the LRU block of the largest lease."""
        best = max(self._free.items(), key=lambda kv: len(kv[1]), default=None)
        if best is not None and best[1]:
            return best[0], best[1].pop()
        victim = max(self._lru.items(), key=lambda kv: len(kv[1]), default=None)
        if victim is None or not victim[1]:
            return None
        peer, lru = victim
        block, h = lru.popitem(last=False)
        self.index.drop_blocks(peer, [block])
        self.stats["blocks_overwritten"] += 1
        return peer, block

    def store(self, tokens: Sequence[int], pages: Sequence[torch.Tensor]) -> int:
        """Store the pages of ``tokens`` not held yet; return how many were written."""
        hashes = self.hashes(tokens)
        if len(pages) < len(hashes):
            raise ValueError(f"pages: {len(pages)} given for {len(hashes)} full pages of tokens")
        plan: dict[str, list[tuple[int, bytes, int]]] = {}
        with self._lock:
            for i, h in enumerate(hashes):
                ref = self.index.get(h)
                if ref is not None:
                    lru = self._lru.get(ref.peer)
                    if lru is not None and ref.block in lru:
                        lru.move_to_end(ref.block)
                    continue
                taken = self._take_block()
                if taken is None:
                    self.stats["store_no_space"] += 1
                    break
                plan.setdefault(taken[0], []).append((i, h, taken[1]))
        written = 0
        for peer, items in plan.items():
            link = self._links.get(peer)
            refs = None
            if link is not None:
                refs = link.write([b for _, _, b in items], [pages[i] for i, _, _ in items])
            with self._lock:
                for n, (_, h, b) in enumerate(items):
                    ok = refs is not None and link.has_block(b) and peer in self._lru
                    if ok:
                        self.index.put(h, refs[n])
                        self._lru[peer][b] = h
                        written += 1
                    elif link is not None and link.has_block(b) and peer in self._free:
                        self._free[peer].add(b)
        self.stats["pages_stored"] += written
        self.stats["bytes_stored"] += written * self.layout.block_bytes
        return written

    def match(self, tokens: Sequence[int], start: int = 0) -> int:
        """How many pages of ``tokens`` from page ``start`` on the index holds in a row (no copy)."""
        return len(self.index.match(self.hashes(tokens)[start:]))

    def load(
        self,
        tokens: Sequence[int],
        out: Sequence[torch.Tensor],
        start: int = 0,
        on_page: Callable[[int, torch.Tensor], None] | None = None,
    ) -> int:
        """Copy the held pages of ``tokens`` from page ``start`` on into ``out`` (``out[0]`` is page
        ``start``: the pages before it are already local); return how many are valid in a row.
        ``on_page(i, dst)`` runs after page ``start + i`` was read and validated into ``dst``
        (so ``out`` may repeat one staging block)."""
        hashes = self.hashes(tokens)[start:]
        refs = self.index.match(hashes)
        n = 0
        for h, ref, dst in zip(hashes, refs, out):
            link = self._links.get(ref.peer)
            if link is None or not link.read(ref, dst):
                self.index.drop(h, ref)
                self.stats["stale_dropped"] += 1
                break
            with self._lock:
                lru = self._lru.get(ref.peer)
                if lru is not None and ref.block in lru:
                    lru.move_to_end(ref.block)
            if on_page is not None:
                on_page(n, dst)
            n += 1
        self.stats["pages_hit"] += n
        self.stats["pages_missed"] += len(hashes) - n
        self.stats["bytes_loaded"] += n * self.layout.block_bytes
        return n

    def status(self) -> dict:
        """Per donor: blocks and bytes borrowed, blocks free, pages held; plus the counters."""
        with self._lock:
            peers = [
                {
                    "peer": peer,
                    "lease": link.lease,
                    "blocks": link.num_blocks,
                    "borrowed_bytes": link.num_blocks * link.block_bytes,
                    "free_blocks": len(self._free.get(peer, ())),
                    "pages": self.index.entries_of(peer),
                }
                for peer, link in self._links.items()
            ]
            return {"peers": peers, "pages": len(self.index), **dict(self.stats)}

    def close(self) -> None:
        for link in self.links():
            link.close()
