"""Shared pool: an inactive server's weights lent to its peers through the arbiter.

Oneiros remaps layers of inactive models first. Across processes that order is the
arbiter's: an inactive server reports the chunks it could free by releasing layers (up to
its Oneiros limit as an inactive model) among what it could give back, so the arbiter's
planner (``plan_takes``) may reclaim them for a busy peer; the server answers such a reclaim
by releasing layers (applied at once, no forward runs on an idle server) and giving their
chunks back. With a router in front, an inactive model offers only
``router_activity.lend_fraction`` of those layers (none while the router holds requests for
it; fewer the higher its arrival rate), and the arbiter takes from the donor with the most
lendable first: among idle models, the one with the lowest arrival rate lends first. The
layers come back through the normal restore (``remap.step``) once the server
is active again and the arbiter can lend the memory.
"""

from __future__ import annotations

from memory_ext.policy.oneiros import model_limit, plan_layers
from memory_ext.pool.lent_pool import LentPool
from sglang_memx import router_activity
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.weights import remap


def _slots_kept_by_first_release(w) -> int:
    """Staging slots the first release keeps mapped (a streamed layer needs a slot to run in);
    later releases keep none more."""
    return 0 if w.alpha else (w.depth or 2)


def lendable_chunks(w, kv: ElasticKV, lent: LentPool) -> int:
    """Chunks releasing layers of ``w`` (the weights in ``kv``'s pool) could free now: 0 for an
    active model (it remaps only under its own KV pressure), else up to its Oneiros limit as an
    inactive model."""
    if w.mode != "remap":
        return 0
    state = remap.model_state(w, kv, lent, busy=False)
    if state.active or state.compute_s is None:
        return 0
    limit, _ = model_limit(state, remap.buffer_mode(w.depth))
    more = int(max(0, limit - w.alpha) * router_activity.lend_fraction(w.idle_after_s))  # by arrival rate
    return max(0, (more - _slots_kept_by_first_release(w)) * w.store.slot_chunks)


def release_for_reclaim(w, kv: ElasticKV, lent: LentPool, chunks: int) -> int:
    """Release enough layers to free ``chunks`` (within ``lendable_chunks``); returns the layers
    newly lent. The change applies at once when no forward runs."""
    if chunks <= 0 or lendable_chunks(w, kv, lent) <= 0:
        return 0
    state = remap.model_state(w, kv, lent, busy=False)
    limit, _ = model_limit(state, remap.buffer_mode(w.depth))
    target = min(limit, w.alpha + -(-chunks // w.store.slot_chunks) + _slots_kept_by_first_release(w))
    if target <= w.alpha:
        return 0
    plan = plan_layers(w.n_layers, target, state.layer_transfer_s, state.compute_s / w.n_layers,
                       remap.buffer_mode(w.depth))  # fmt: skip
    if not plan.feasible:
        return 0
    before = w.alpha
    w.pipeline.request([w.layer_keys[j] for j in plan.shared_layers], plan.beta)
    w.pipeline.apply_if_idle()
    gained = w.alpha - before
    w.lent_to_peers += max(0, gained)
    return gained
