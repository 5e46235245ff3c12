"""Prefix index of the peer tier: token-hash chain -> (peer, block, generation).

``chain_hashes(tokens, block_tokens, salt)`` gives one 16-byte hash per *full* page of
``block_tokens`` tokens: ``h_i = blake2b(h_{i-1} || tokens of page i)``, ``h_{-1} = blake2b(salt)``.
A page's hash therefore names the page *and everything before it* (KV of a token depends on
its whole prefix), and ``salt`` keeps models / layouts apart (the tier salts with the layout).

``PrefixIndex`` maps a hash to the ``BlockRef`` holding that page. ``match(hashes)`` returns the
refs of the longest run of consecutive hits from the start. One block holds at most one page:
putting a page into a block that held another drops the old entry. Entries can be dropped by
hash, by (peer, blocks) (a reclaim) or by peer (a dead donor). Thread-safe.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable, Sequence

from ..policy._checks import check_int
from .link import BlockRef


def chain_hashes(tokens: Sequence[int], block_tokens: int, salt: bytes = b"") -> list[bytes]:
    check_int("block_tokens", block_tokens, minimum=1)
    if not isinstance(salt, bytes):
        raise ValueError(f"salt must be bytes, got {type(salt).__name__}")
    prev = hashlib.blake2b(salt, digest_size=16).digest()
    out = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        page = tokens[start : start + block_tokens]
        try:
            body = struct.pack(f"<{block_tokens}q", *page)
        except struct.error as exc:
            raise ValueError(f"tokens: page at {start} is not a list of 64-bit ints ({exc})") from None
        prev = hashlib.blake2b(prev + body, digest_size=16).digest()
        out.append(prev)
    return out


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_hash: dict[bytes, BlockRef] = {}
        self._by_block: dict[tuple[str, int], bytes] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, h: bytes) -> BlockRef | None:
        return self._by_hash.get(h)

    def put(self, h: bytes, ref: BlockRef) -> None:
        with self._lock:
            old = self._by_hash.pop(h, None)
            if old is not None:
                self._by_block.pop((old.peer, old.block), None)
            prev_h = self._by_block.pop((ref.peer, ref.block), None)
            if prev_h is not None:
                self._by_hash.pop(prev_h, None)
            self._by_hash[h] = ref
            self._by_block[(ref.peer, ref.block)] = h

    def match(self, hashes: Iterable[bytes]) -> list[BlockRef]:
        out = []
        with self._lock:
            for h in hashes:
                ref = self._by_hash.get(h)
                if ref is None:
                    break
                out.append(ref)
        return out

    def drop(self, h: bytes, ref: BlockRef | None = None) -> bool:
        """Drop ``h`` (only if it still maps to ``ref``, when given)."""
        with self._lock:
            cur = self._by_hash.get(h)
            if cur is None or (ref is not None and cur != ref):
                return False
            del self._by_hash[h]
            self._by_block.pop((cur.peer, cur.block), None)
            return True

    def drop_blocks(self, peer: str, blocks: Iterable[int]) -> int:
        n = 0
        with self._lock:
            for b in blocks:
                h = self._by_block.pop((peer, b), None)
                if h is not None:
                    del self._by_hash[h]
                    n += 1
        return n

    def drop_peer(self, peer: str) -> int:
        with self._lock:
            gone = [k for k in self._by_block if k[0] == peer]
            for k in gone:
                del self._by_hash[self._by_block.pop(k)]
        return len(gone)

    def entries_of(self, peer: str) -> int:
        with self._lock:
            return sum(1 for k in self._by_block if k[0] == peer)
