"""Upstream subsystem: the unified radix cache (``sglang.srt.mem_cache.unified_radix_cache``):
the peer KV tier (``--memx-peer-kv borrow|both``; docs/peer-kv.md).

* ``UnifiedRadixCache._evict_device_leaf`` (around): before upstream frees an evicted device
  leaf's KV slots, the full pages of its path go to a peer (``PeerKVServer.spill``).
* ``UnifiedRadixCache.match_prefix`` (around): after the device match, the pages a peer holds
  past the device prefix are loaded into new slots and inserted, and the match runs again
  (``PeerKVServer.load``): tier order local -> peer -> recompute. A failed peer read is a miss.
* ``UnifiedRadixCache.insert`` (after): which token each inserted slot holds (the tree core
  does not expose a path's tokens), so an evicted path can be hashed.

Each hook does nothing on a cache without the tier (``peer_of`` is None), and never turns a
peer failure into a request failure: the request then recomputes, as in stock SGLang.
"""

from __future__ import annotations

import logging

from sglang_memx.upstream import peer_radix as up_peer
from sglang_memx.upstream.registry import HookSpec

logger = logging.getLogger("sglang_memx")


def around_evict_device_leaf(original, unified, node_id, tracker):
    peer = up_peer.peer_of(unified)
    if peer is not None:
        try:
            peer.spill(node_id)
        except Exception:  # the leaf is evicted anyway; its prefix is then recomputed
            logger.exception("memx peer KV: could not spill an evicted prefix")
    return original(unified, node_id, tracker)


def around_match_prefix(original, unified, params, *args, **kwargs):
    matched = original(unified, params, *args, **kwargs)
    peer = up_peer.peer_of(unified)
    if peer is None:
        return matched
    try:
        return peer.load(params, matched, lambda: original(unified, params, *args, **kwargs))
    except Exception:  # a miss: the request recomputes what the peer could not give
        logger.exception("memx peer KV: load failed; recomputing")
        return matched


def after_insert(result, unified, params, *args, **kwargs):
    peer = up_peer.peer_of(unified)
    if peer is not None:
        radix_key, value = up_peer.insert_parts(params)
        peer.note_insert(radix_key, value)
    return result


_U = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache."
HOOKS = (
    HookSpec(_U + "_evict_device_leaf", "around", around_evict_device_leaf, "peer_kv",
             "spill an evicted device leaf's KV to a peer before its slots are freed"),
    HookSpec(_U + "match_prefix", "around", around_match_prefix, "peer_kv",
             "after the device match, load the continuation a peer holds, insert it and match again"),
    HookSpec(_U + "insert", "after", after_insert, "peer_kv",
             "remember which token each inserted KV slot holds (evicted paths are hashed by token)"),
)  # fmt: skip
