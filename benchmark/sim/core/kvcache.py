"""Paged KV pool of one model instance with a prefix cache.

Blocks hold ``block_size`` tokens. A block is in exactly one state:

* free;
* private: owned by one running request (its partial tail, or blocks not
  yet published to the cache);
* cached: identified by a content key (see ``Request.block_key``), shared by
  any number of requests; ``refs`` counts the running requests using it.
  Cached blocks with ``refs == 0`` are evictable, kept in LRU order.

Matching walks a request's block keys from the first block and stops at the
first miss, like a radix tree. Released chains are pushed deepest block
first, so eviction removes leaves before their ancestors.

Invariants (``check()``): ``private + cached <= capacity``; every evictable
block has ``refs == 0`` and every ``refs == 0`` cached block is evictable.
Only counts are stored for private blocks (no per-block objects), keeping the
hot path O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, capacity_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError("capacity_blocks must be >= 0 and block_size >= 1")
        self.capacity = int(capacity_blocks)
        self.block_size = int(block_size)
        self.prefix_caching = prefix_caching
        self.private = 0
        self.refs: dict[Hashable, int] = {}
        self.lru: OrderedDict[Hashable, None] = OrderedDict()
        self.hit_tokens = 0
        self.evicted = 0

    # ---- occupancy --------------------------------------------------------
    @property
    def cached(self) -> int:
        return len(self.refs)

    @property
    def free(self) -> int:
        """Blocks allocatable without eviction."""
        return self.capacity - self.private - len(self.refs)

    @property
    def available(self) -> int:
        """Blocks allocatable if every evictable block were evicted."""
        return self.free + len(self.lru)

    @property
    def used(self) -> int:
        """Blocks held by running requests (private + referenced cached)."""
        return self.private + len(self.refs) - len(self.lru)

    # ---- prefix cache -----------------------------------------------------
    def match(self, keys: Iterable[Hashable]) -> int:
        """Take a reference on the longest cached prefix of ``keys``;
        returns how many blocks matched."""
        if not self.prefix_caching:
            return 0
        n = 0
        refs, lru = self.refs, self.lru
        for k in keys:
            r = refs.get(k)
            if r is None:
                break
            if r == 0:
                del lru[k]
            refs[k] = r + 1
            n += 1
        return n

    def release_cached(self, keys: list[Hashable]) -> None:
        """Drop one reference on each of ``keys`` (a matched/published chain)."""
        refs, lru = self.refs, self.lru
        for k in reversed(keys):  # deepest first -> evicted first
            r = refs[k] - 1
            refs[k] = r
            if r == 0:
                lru[k] = None

    def publish(self, keys: list[Hashable]) -> list[Hashable]:
        """Turn ``len(keys)`` private blocks into cached blocks with one
        reference each. Keys already cached (another request published the
        same content) take a reference instead and the private block is
        freed. Returns the keys, all now referenced once more."""
        refs, lru = self.refs, self.lru
        for k in keys:
            r = refs.get(k)
            if r is None:
                refs[k] = 1
            else:
                if r == 0:
                    del lru[k]
                refs[k] = r + 1
            self.private -= 1
        return keys

    # ---- private blocks ---------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.available

    def allocate(self, n: int) -> bool:
        """Take ``n`` private blocks, evicting LRU cached blocks as needed.
        All or nothing: False (and no change) if ``n`` cannot be had."""
        if n <= 0:
            return True
        short = n - self.free
        if short > 0:
            if short > len(self.lru):
                return False
            self._evict(short)
        self.private += n
        return True

    def free_private(self, n: int) -> None:
        assert 0 <= n <= self.private, (n, self.private)
        self.private -= n

    def _evict(self, n: int) -> None:
        lru, refs = self.lru, self.refs
        for _ in range(n):
            k, _ = lru.popitem(last=False)
            del refs[k]
        self.evicted += n

    # ---- capacity changes (memory hooks) ----------------------------------
    def resize(self, capacity_blocks: int) -> int:
        """Grow or shrink the pool. Shrinking evicts cached blocks but never
        takes blocks in use; returns the capacity actually set."""
        target = max(int(capacity_blocks), self.used)
        excess = (self.private + len(self.refs)) - target
        if excess > 0:
            self._evict(min(excess, len(self.lru)))
        self.capacity = max(target, self.private + len(self.refs))
        return self.capacity

    def check(self) -> None:
        """Assert the invariants listed in the module docstring."""
        assert 0 <= self.private, self.private
        assert self.private + len(self.refs) <= self.capacity, (self.private, len(self.refs), self.capacity)
        zero = {k for k, r in self.refs.items() if r == 0}
        assert all(r >= 0 for r in self.refs.values())
        assert zero == set(self.lru), "evictable set and refs==0 set differ"
