"""The unified radix cache (``sglang.srt.mem_cache.unified_radix_cache``) as the peer KV tier
reads and drives it: a node's device slots, a match's device prefix, a key's tokens, an insert.

Upstream names only through here (see ``manifest``). Backend-neutral: only the cache's public
methods are used (``path_device_indices`` works with the Rust and the Python tree core alike),
never tree nodes.
"""

from __future__ import annotations

import torch

from sglang_memx.upstream.manifest import resolve

STATE_ATTR = "_memx_peer_kv"


def attach_peer(unified, state) -> None:
    """Hang memx's peer-tier state on the cache (one namespace, like ``kv.attach_memx``)."""
    setattr(unified, STATE_ATTR, state)


def peer_of(unified):
    """The peer-tier state of a cache, or None (memx's own marker, not an upstream name)."""
    return vars(unified).get(STATE_ATTR)  # memx's own attribute, absent until attached


def is_unified(tree) -> bool:
    return isinstance(tree, resolve("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"))


def path_slots(unified, node_id) -> torch.Tensor:
    """KV slots of every token on the path root -> ``node_id`` (root order)."""
    return unified.path_device_indices(node_id)


def cache_allocator(unified):
    return unified.token_to_kv_pool_allocator


def match_request(match_params):
    """The request a match is made for (None for the cache's own probes)."""
    return match_params.req


def match_key(match_params):
    return match_params.key


def device_match(matched) -> tuple[int, object]:
    """(device prefix length, last device node) of a match."""
    return int(matched.device_prefix_len), matched.last_device_node


def host_hit(matched) -> int:
    return int(matched.host_hit_length)


def plain_tokens(radix_key) -> list[int] | None:
    """The key's tokens when it is a plain token key (no LoRA / cache-salt namespace, no bigram
    view), else None: the peer tier does not hash namespaces yet."""
    if radix_key.is_bigram or radix_key.extra_key is not None or radix_key.cache_salt is not None:
        return None
    return list(radix_key.raw_token_ids())


def key_prefix(radix_key, n: int):
    return radix_key[:n]


def insert_parts(insert_params) -> tuple[object, object]:
    """(key, value) of an insert."""
    return insert_params.key, insert_params.value


def insert(unified, radix_key, value: torch.Tensor, prev_prefix_len: int) -> int:
    """Insert ``value`` (KV slots) under ``radix_key``; returns the length the tree already held.

    Upstream's insert frees, as duplicates, the slots of ``value`` past ``prev_prefix_len`` for
    tokens the tree already holds (``InsertParams.prev_prefix_len``): the caller passes the length
    of ``value`` that *is* the tree's own slots (its device match), so those are never freed and
    its spare copies of tokens the tree got meanwhile go back to the allocator here, once."""
    params = resolve("sglang.srt.mem_cache.base_prefix_cache.InsertParams")
    return int(unified.insert(params(key=radix_key, value=value, prev_prefix_len=prev_prefix_len)).prefix_len)
