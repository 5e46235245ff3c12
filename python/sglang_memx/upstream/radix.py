"""The prefix (radix) cache (``sglang.srt.mem_cache``), as memx reads and drives it.

Upstream names only through here (see ``manifest``).
"""

from __future__ import annotations

from sglang_memx.upstream.manifest import resolve


def evictable_tokens(tree) -> int:
    """Tokens only the cache holds (0 without a cache)."""
    return 0 if tree is None else int(tree.evictable_size())


def shares_prefixes(tree) -> bool:
    return tree is not None and bool(tree.supports_prefix_sharing())


def evict(tree, tokens: int) -> int:
    """Evict at least ``tokens`` cached tokens (LRU); return how many went."""
    if tokens <= 0 or not shares_prefixes(tree):
        return 0
    params = resolve("sglang.srt.mem_cache.base_prefix_cache.EvictParams")
    evicted = tree.evict(params(num_tokens=tokens))
    return int(evicted.num_tokens_evicted)


def match(tree, key) -> tuple[int, object]:
    """(device prefix length, last matched device node) of ``key``."""
    params = resolve("sglang.srt.mem_cache.base_prefix_cache.MatchPrefixParams")
    matched = tree.match_prefix(params(key=key))
    return int(matched.device_prefix_len), matched.last_device_node


def insert(radix, key, value) -> None:
    """Insert ``value`` (KV slots) under ``key`` into a radix cache (the host buffer needs one)."""
    params = resolve("sglang.srt.mem_cache.base_prefix_cache.InsertParams")
    radix.insert(params(key=key, value=value))


def lock(tree, node):
    """Protect ``node``'s path from eviction; returns what ``unlock`` takes."""
    return tree.lock(node)


def unlock(tree, handle) -> None:
    tree.unlock(handle)
