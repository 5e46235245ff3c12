"""The borrower's side of the peer tier in the prefix cache: spill an evicted path, load a
continuation, remember which token each tree slot holds.

``PeerPrefixCache(tree, allocator, io, rows)`` is what the radix-cache hooks call (through
``server.PeerKVServer``):

* ``note_insert(key, slots)`` at every insert: ``slot_tokens[slot]`` is the token whose KV the
  slot holds (the tree core does not expose a path's tokens; every slot of a tree path got there
  through an insert). Paths of a LoRA / cache-salt namespace are marked and never spilled.
* ``spill(node_id)`` before a device leaf is evicted: the full pages of its root path go to the
  tier (pages the index holds already are not even gathered).
* ``load(params, matched, rematch)`` after a device match: the pages held past the device prefix
  are read into newly allocated slots (evicting unprotected prefixes, never the matched one, if
  the allocator is short), the valid run is inserted into the tree, and the match is run again.
  A page whose read fails ends the run (the rest is recomputed); unused slots are freed.

Invariant: no slot leaks. Every slot ``load`` allocates ends in the tree or back in the allocator,
exactly once; the tree's own slots of the device match are never freed (the insert gets
``prev_prefix_len`` = the device prefix, so upstream frees only our spare copies).
"""

from __future__ import annotations

from collections import Counter

import torch

from memory_ext.peer import PeerKVIO
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import peer_radix as up_peer
from sglang_memx.upstream import radix as up_radix


class PeerPrefixCache:
    def __init__(self, tree, allocator, io: PeerKVIO, rows: int, stats: Counter | None = None):
        self.tree, self.allocator, self.io = tree, allocator, io
        self.block_tokens = io.layout.block_tokens
        self.slot_tokens = torch.zeros(rows, dtype=torch.int64)
        self.slot_plain = torch.zeros(rows, dtype=torch.bool)
        self.stats: Counter[str] = Counter() if stats is None else stats

    def note_insert(self, radix_key, value) -> None:
        """Remember which token each inserted slot holds (and whether its path is plain)."""
        if value is None:
            return
        tokens = up_peer.plain_tokens(radix_key)
        slots = torch.as_tensor(value, dtype=torch.int64).cpu()
        if tokens is None:
            self.slot_plain[slots] = False
            return
        n = min(len(tokens), slots.numel())
        self.slot_tokens[slots[:n]] = torch.tensor(tokens[:n], dtype=torch.int64)
        self.slot_plain[slots[:n]] = True

    def spill(self, node_id) -> None:
        """Store the full pages of the path root -> ``node_id`` (a device leaf about to be evicted)."""
        slots = up_peer.path_slots(self.tree, node_id)
        n = slots.numel() // self.block_tokens * self.block_tokens
        if n == 0:
            return
        slots = slots[:n].to(torch.int64)
        host = slots.cpu()
        if not bool(self.slot_plain[host].all()):
            self.stats["spills_skipped_namespace"] += 1
            return
        stored = self.io.spill(self.slot_tokens[host].tolist(), slots)
        self.stats["spills"] += 1
        self.stats["pages_spilled"] += stored

    def load(self, match_params, matched, rematch):
        """After a device match: load the pages the peer holds past the device prefix, insert them,
        and return the match run again (or ``matched`` when the peer holds nothing more)."""
        if up_peer.match_request(match_params) is None or up_peer.host_hit(matched):
            return matched
        radix_key = up_peer.match_key(match_params)
        tokens = up_peer.plain_tokens(radix_key)
        if tokens is None:
            return matched
        t = self.block_tokens
        prefix, last = up_peer.device_match(matched)
        first = prefix // t
        tokens = tokens[: len(tokens) // t * t]
        if (first + 1) * t > len(tokens):
            return matched
        pages = self.io.tier.match(tokens, first)
        if pages == 0:
            self.stats["lookups_missed"] += 1
            return matched
        slots = self._alloc(pages * t, last)
        if slots is None:
            self.stats["loads_no_room"] += 1
            return matched
        try:
            got = self.io.load(tokens, first, slots)
        except Exception:  # a miss, and no slot leaked
            up_kv.free_tokens(self.allocator, slots)
            raise
        if got < pages:
            self.stats["recomputes_after_reclaim"] += 1  # held when matched, gone when read
        head, end = prefix - first * t, (first + got) * t
        if end <= prefix:
            up_kv.free_tokens(self.allocator, slots)
            return matched
        keep = slots[head : got * t]
        drop = torch.cat([slots[:head], slots[got * t :]])
        if drop.numel():
            up_kv.free_tokens(self.allocator, drop)
        held = up_peer.path_slots(self.tree, last)[:prefix].to(keep.dtype)
        # ``held`` is the tree's own slots: never freed. If the tree got some of the loaded tokens
        # meanwhile, the insert itself frees our spare copies (upstream's duplicate rule past
        # ``prev_prefix_len``); freeing them here too would free them twice.
        up_peer.insert(self.tree, up_peer.key_prefix(radix_key, end), torch.cat([held, keep]), prefix)
        self.stats["hits"] += 1
        self.stats["pages_loaded"] += got
        self.stats["tokens_loaded"] += end - prefix
        return rematch()

    def _alloc(self, n: int, last):
        """``n`` KV slots, evicting unprotected cached prefixes (never the matched one) if needed."""
        short = n - up_kv.available_tokens(self.allocator)
        if short > 0:
            handle = up_radix.lock(self.tree, last)
            try:
                up_radix.evict(self.tree, short)
            finally:
                up_radix.unlock(self.tree, handle)
        if up_kv.available_tokens(self.allocator) < n:
            return None
        return up_kv.alloc_tokens(self.allocator, n)
