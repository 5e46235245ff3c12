"""Whether the next decode step fits, with elastic KV (upstream's ``check_decode_capacity``).

First the step's activation is reserved (if it cannot fit, the step does not fit and
upstream retracts a request and asks again); with a shared pool, what the arbiter has free
is borrowed at once, and if upstream still finds the step short (after evicting its own
cache) the arbiter may reclaim from idle peers before upstream retracts a running request.
"""

from __future__ import annotations

from collections.abc import Callable

from memory_ext.pool.lent_pool import LentPool
from sglang_memx.elastic.activation_side import ActivationSide
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.elastic.shared_pool import borrow_tokens
from sglang_memx.upstream import kv as up_kv


def decode_step_fits(kv: ElasticKV, allocator, check: Callable[[], bool], num_tokens: int, tree, requests: int | None,
                     *, activation: ActivationSide, lent: LentPool | None) -> bool:  # fmt: skip
    """``check()`` is upstream's own test (it evicts cache and compares with available); ``lent``:
    the shared pool's link when the KV space is on one (the coordinator's lender), else None;
    ``activation``: the activation sharing the pool (the coordinator's side)."""
    if requests is not None and not activation.reserve(allocator, tree, requests, requests, lent=lent, urgent=True):
        return False
    if lent is None:
        return check()
    borrow_tokens(kv, lent, num_tokens - up_kv.available_tokens(allocator), may_wait=False)  # what is free at once
    if check():
        return True
    # still short after evicting our own cache: let the arbiter reclaim from idle peers
    if borrow_tokens(kv, lent, num_tokens - up_kv.available_tokens(allocator), may_wait=True, urgent=True):
        return check()
    return False
