"""Prometheus text exposition of the /memx/status document (served at ``/memx/metrics``).

Pure function of the status document: every sample is labelled with the
scheduler's ``dp_rank`` (and ``pool`` when the server joined a shared pool),
so several servers scraped by one Prometheus stay apart by their ``instance``.
Names follow Prometheus conventions: ``_bytes`` / ``_tokens`` gauges,
``_total`` counters, ``_seconds_total`` for summed latencies. The text format
itself is ``sglang_memx.prometheus`` (shared with the router's ``/metrics``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from memory_ext.policy.governor import CAP_REASONS, NO_SLO

from .prometheus import CONTENT_TYPE, Samples, number, render

__all__ = ["CONTENT_TYPE", "METRICS_PATH", "render_prometheus"]

METRICS_PATH = "/memx/metrics"

# (name, type, help)
_HELP = {
    "memx_kv_capacity_tokens": ("gauge", "Logical KV capacity in tokens."),
    "memx_kv_used_tokens": ("gauge", "KV tokens held by requests (not evictable)."),
    "memx_kv_available_tokens": ("gauge", "KV tokens allocatable now (free mapped + mappable)."),
    "memx_kv_evictable_tokens": ("gauge", "KV tokens held only by the prefix cache."),
    "memx_kv_mapped_bytes": ("gauge", "Physical bytes backing the KV buffers."),
    "memx_kv_logical_bytes": ("gauge", "Bytes the KV buffers would take fully backed."),
    "memx_kv_groups_mapped": ("gauge", "KV groups currently backed."),
    "memx_kv_slab_bytes_per_token": ("gauge", "KV bytes of one token over all layers (the model's KV cell, F2)."),
    "memx_kv_slab_tokens": ("gauge", "Tokens one KV slab (group) holds."),
    "memx_kv_slab_bytes": ("gauge", "Bytes of one KV slab: whole pool chunks."),
    "memx_kv_slab_waste_bytes": ("gauge", "Bytes of a slab's chunks that hold no token row (format waste)."),
    "memx_kv_slabs": ("gauge", "KV slabs of this server by state (FREE: not backed, PARTIAL, FULL)."),
    "memx_kv_slab_stranded_bytes": ("gauge", "Free KV inside backed slabs: usable by this server only."),
    "memx_pool_owner_bytes": ("gauge", "Physical bytes held per owner in this server's pool."),
    "memx_pool_capacity_bytes": ("gauge", "Capacity of this server's pool (or of its share)."),
    "memx_kv_map_total": ("counter", "KV groups mapped."),
    "memx_kv_unmap_total": ("counter", "KV groups unmapped."),
    "memx_kv_grow_refused_total": ("counter", "Group maps the pool refused."),
    "memx_kv_map_seconds_total": ("counter", "Time spent mapping KV groups."),
    "memx_kv_unmap_seconds_total": ("counter", "Time spent unmapping KV groups."),
    "memx_kv_map_seconds_max": ("gauge", "Longest single map call."),
    "memx_kv_unmap_seconds_max": ("gauge", "Longest single unmap call."),
    "memx_vmm_calls_total": ("counter", "Virtual-memory backend calls by kind."),
    "memx_activation_held_bytes": ("gauge", "Pool bytes held for activations (live + idle)."),
    "memx_activation_peak_held_bytes": ("gauge", "Most pool bytes ever held for activations."),
    "memx_activation_chunks_from_kv_total": ("counter", "Chunks activation took from idle KV (deflation)."),
    "memx_activation_chunks_lent_to_kv_total": ("counter", "Idle activation chunks KV took (inflation)."),
    "memx_activation_deferred_requests_total": ("counter", "Admissions deferred: the activation did not fit."),
    "memx_activation_arena_live_bytes": ("gauge", "CUDA: bytes of torch segments live in the activation arena."),
    "memx_activation_arena_overflow_allocs_total": (
        "counter",
        "CUDA: segments that did not fit the arena and came from plain device memory.",
    ),
    "memx_host_buffer_used_bytes": ("gauge", "Host bytes holding parked KV."),
    "memx_weights_resident_layers": ("gauge", "Decoder layers whose weights own their pool chunks."),
    "memx_weights_streamed_layers": ("gauge", "Decoder layers streamed from the host copy before they run."),
    "memx_weights_lent_bytes": ("gauge", "Weight bytes lent to the KV cache (or to peers) by released layers."),
    "memx_weights_copy_bytes_total": ("counter", "Bytes copied from the host copy (fetches and restores)."),
    "memx_weights_copy_seconds_total": ("counter", "Time the weight copies took."),
    "memx_weights_stall_seconds_total": ("counter", "Time forwards waited for a layer's copy."),
    "memx_weights_hidden_fraction": ("gauge", "Fraction of weight copy time hidden under compute."),
    "memx_weights_decisions_total": ("counter", "Remap controller decisions, by action."),
    "memx_weights_link_layers": ("gauge", "Layers per iteration the shared host link leaves this server."),
    "memx_weights_sleeping": ("gauge", "1 while the server sleeps (--memx-sleep-after-s), else 0."),
    "memx_weights_wakes_total": ("counter", "Times the server woke up from sleep."),
    "memx_weights_last_wake_seconds": ("gauge", "How long the last wake took (layers restored and copied)."),
    "memx_host_buffer_logical_bytes": ("gauge", "Host buffer size the SLO rule allows now."),
    "memx_host_buffer_parked_total": ("counter", "Requests whose KV was parked on the host."),
    "memx_host_buffer_restored_total": ("counter", "Parked requests whose KV was fetched back."),
    "memx_host_buffer_dropped_total": ("counter", "Parked entries dropped (request gone or recomputed)."),
    "memx_host_buffer_fetched_total": ("counter", "Copies of parked KV back to the device."),
    "memx_host_buffer_prefill_offloads_total": ("counter", "Requests admitted as prefills whose KV goes to the host."),
    "memx_shared_pool_borrowed_chunks_total": ("counter", "Chunks borrowed from the pool arbiter."),
    "memx_shared_pool_returned_chunks_total": ("counter", "Chunks returned to the pool arbiter."),
    "memx_shared_pool_denied_total": ("counter", "Borrow requests the arbiter refused."),
    "memx_shared_pool_reclaim_requests_total": ("counter", "Reclaim requests from the arbiter."),
    "memx_shared_pool_held_bytes": ("gauge", "Bytes currently borrowed from the arbiter."),
    "memx_shared_pool_budget_bytes": ("gauge", "Budget of the shared pool."),
    "memx_pool_arbiter_connected": ("gauge", "1 while connected to the pool's arbiter, 0 after losing it."),
    "memx_shared_pool_private_bytes": (
        "gauge",
        "Bytes this server holds that no arbiter counts (kept when the arbiter was lost, not yet adopted).",
    ),
    "memx_router_activity_queued": ("gauge", "Requests the router holds queued for this model (last message)."),
    "memx_router_activity_inflight": ("gauge", "Requests the router has in flight to this model (last message)."),
    "memx_router_activity_arrival_rate": ("gauge", "Router arrivals per second for this model (last message)."),
    "memx_router_activity_queued_tokens": ("gauge", "Router's estimate of its queued requests' KV tokens."),
    "memx_router_activity_age_seconds": ("gauge", "Seconds since the last router activity message arrived."),
    "memx_router_activity_live": ("gauge", "1 while the last router activity is younger than its TTL, else 0."),
    "memx_router_activity_received_total": ("counter", "Router activity messages received."),
    "memx_peer_kv_donated_bytes": ("gauge", "KV bytes this server lends to peers now, per borrower."),
    "memx_peer_kv_reclaims_total": ("counter", "Times this donor took donated KV back for its own load."),
    "memx_peer_kv_reclaimed_bytes_total": ("counter", "Donated bytes this donor took back."),
    "memx_peer_kv_borrowed_bytes": ("gauge", "KV bytes borrowed from a peer now, per donor."),
    "memx_peer_kv_spills_total": ("counter", "Evicted prefixes spilled to peers."),
    "memx_peer_kv_hits_total": ("counter", "Prefix matches extended by pages loaded from a peer."),
    "memx_peer_kv_pages_stored_total": ("counter", "Pages written to peers."),
    "memx_peer_kv_pages_loaded_total": ("counter", "Pages loaded from peers into the KV cache."),
    "memx_peer_kv_bytes_stored_total": ("counter", "Bytes written to peers."),
    "memx_peer_kv_bytes_loaded_total": ("counter", "Bytes loaded from peers."),
    "memx_peer_kv_entries_dropped_total": ("counter", "Peer pages lost, by cause (reclaim, donor death)."),
    "memx_peer_kv_recomputes_after_reclaim_total": (
        "counter",
        "Loads cut short by a page reclaimed or lost between match and read (the rest was recomputed).",
    ),
    "memx_governor_tpot_slo_seconds": (
        "gauge",
        "TPOT SLO the governor keeps the running batch within; source: the flag or models.yaml field it came from.",
    ),
    "memx_governor_ttft_slo_seconds": ("gauge", "TTFT SLO this server holds (sizes the host buffer); source as above."),
    "memx_governor_batch_cap": ("gauge", "Largest running batch predicted within the TPOT SLO (absent: no cap)."),
    "memx_governor_batch_cap_reason": (
        "gauge",
        "1 for why the batch cap is what it is (no_slo, learning, slo_infeasible, predicted_tpot_within_slo), "
        "0 for the others.",
    ),
    "memx_governor_predicted_tpot_seconds": (
        "gauge",
        "Predicted TPOT of the running batch: its decode step plus the prefill stalls its requests wait through.",
    ),
    "memx_governor_measured_tpot_seconds": (
        "gauge",
        "Measured TPOT: recent decode steps' exponential mean plus the batch times the prefill stalls per token.",
    ),
    "memx_governor_prefill_stall_seconds_per_token": (
        "gauge",
        "Seconds running requests waited through other requests' prefills, per token decoded (recent iterations).",
    ),
    "memx_governor_decisions_total": (
        "counter",
        "Batch-growth decisions by reason; reason=over_slo counts refusals to grow (a request kept waiting).",
    ),
    "memx_governor_step_samples_total": ("counter", "Decode steps the governor's step-time model learned from."),
    "memx_governor_admission_verdicts_total": (
        "counter",
        "memx admission verdicts passed through the governor's do-no-harm rules, by reason "
        "(protects_running / park_protects_running: a refusal or parking kept a running request's KV).",
    ),
    "memx_requests_running": ("gauge", "Requests decoding."),
    "memx_requests_waiting": ("gauge", "Requests waiting for admission."),
}


def _samples(rank: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any], float]]:
    base = {"dp_rank": rank.get("dp_rank", 0)}
    if rank.get("pool_name"):
        base["pool"] = rank["pool_name"]
    kv = rank.get("kv_pool", {})
    for key, name in (
        ("capacity_tokens", "memx_kv_capacity_tokens"),
        ("used_tokens", "memx_kv_used_tokens"),
        ("available_tokens", "memx_kv_available_tokens"),
        ("evictable_tokens", "memx_kv_evictable_tokens"),
    ):
        if key in kv:
            yield name, base, kv[key]
    req = rank.get("requests", {})
    yield "memx_requests_running", base, req.get("running", 0)
    yield "memx_requests_waiting", base, req.get("waiting", 0)
    act = rank.get("router_activity")
    if act:
        yield "memx_router_activity_queued", base, act["queued"]
        yield "memx_router_activity_inflight", base, act["inflight"]
        yield "memx_router_activity_arrival_rate", base, act["arrival_rate"]
        if act["queued_tokens"] is not None:
            yield "memx_router_activity_queued_tokens", base, act["queued_tokens"]
        yield "memx_router_activity_age_seconds", base, act["age_s"]
        yield "memx_router_activity_live", base, int(act["live"])
        yield "memx_router_activity_received_total", base, act["received_total"]
    yield from _peer_samples(base, rank.get("peer_kv"))
    el = rank.get("elastic_kv")
    if not el:
        return
    yield "memx_kv_mapped_bytes", base, el["mapped_bytes"]
    yield "memx_kv_logical_bytes", base, el["logical_bytes"]
    yield "memx_kv_groups_mapped", base, el["groups_mapped"]
    yield "memx_pool_capacity_bytes", base, el["pool_capacity_bytes"]
    for owner, nbytes in sorted(el.get("owners_bytes", {}).items()):
        yield "memx_pool_owner_bytes", dict(base, owner=owner), nbytes
    yield "memx_kv_map_total", base, el["groups_mapped_total"]
    yield "memx_kv_unmap_total", base, el["groups_unmapped_total"]
    yield "memx_kv_grow_refused_total", base, el["grow_refused"]
    yield "memx_kv_map_seconds_total", base, el["map_seconds"]
    yield "memx_kv_unmap_seconds_total", base, el["unmap_seconds"]
    yield "memx_kv_map_seconds_max", base, el["max_map_seconds"]
    yield "memx_kv_unmap_seconds_max", base, el["max_unmap_seconds"]
    yield from _governor_samples(base, el.get("governor"))
    slab = el.get("slab")
    if slab:
        fmt = dict(base, format=slab["format"])
        yield "memx_kv_slab_bytes_per_token", fmt, slab["bytes_per_token"]
        yield "memx_kv_slab_tokens", fmt, slab["tokens_per_slab"]
        yield "memx_kv_slab_bytes", fmt, slab["slab_bytes"]
        yield "memx_kv_slab_waste_bytes", fmt, slab["waste_bytes"]
        for state in ("FREE", "PARTIAL", "FULL"):
            yield "memx_kv_slabs", dict(fmt, state=state), slab["slabs"][state]
        yield "memx_kv_slab_stranded_bytes", fmt, slab["stranded_bytes"]
    for call, n in sorted(el.get("backend", {}).items()):
        yield "memx_vmm_calls_total", dict(base, call=call), n
    act = el.get("activation")
    if act:
        chunk = el["chunk_bytes"]
        yield "memx_activation_held_bytes", base, act["held_bytes"]
        yield "memx_activation_peak_held_bytes", base, act["peak_held"] * chunk
        yield "memx_activation_chunks_from_kv_total", base, act["chunks_from_kv"]
        yield "memx_activation_chunks_lent_to_kv_total", base, act["chunks_lent_to_kv"]
        yield "memx_activation_deferred_requests_total", base, act["deferred_requests"]
        arena = act.get("allocator") or {}
        if arena.get("kind") == "memx arena":
            yield "memx_activation_arena_live_bytes", base, arena["live_bytes"]
            yield "memx_activation_arena_overflow_allocs_total", base, arena["overflow_allocs"]
    host = el.get("host_buffer")
    if host:
        yield "memx_host_buffer_used_bytes", base, host["used_bytes"]
        yield "memx_host_buffer_logical_bytes", base, host["logical_bytes"]
        yield "memx_host_buffer_parked_total", base, host["parked"]
        yield "memx_host_buffer_restored_total", base, host["restored"]
        yield "memx_host_buffer_dropped_total", base, host["dropped"]
        yield "memx_host_buffer_fetched_total", base, host["fetched"]
        yield "memx_host_buffer_prefill_offloads_total", base, host["prefill_offloads"]
    w = el.get("weights")
    if w:
        yield "memx_weights_resident_layers", base, w["resident_layers"]
        yield "memx_weights_streamed_layers", base, w["streamed_layers"]
        yield "memx_weights_lent_bytes", base, w["lent_bytes"]
        yield "memx_weights_copy_bytes_total", base, w["fetch_bytes"] + w["restore_bytes"]
        yield "memx_weights_copy_seconds_total", base, w["copy_seconds"]
        yield "memx_weights_stall_seconds_total", base, w["stall_seconds"]
        if w["hidden_fraction"] is not None:
            yield "memx_weights_hidden_fraction", base, w["hidden_fraction"]
        for action, n in sorted(w["decisions"].items()):
            yield "memx_weights_decisions_total", dict(base, action=action), n
        if w.get("link") is not None and w["link"]["layers"] is not None:
            yield "memx_weights_link_layers", base, w["link"]["layers"]
        if w.get("sleep") is not None:
            yield "memx_weights_sleeping", base, int(w["sleep"]["state"] == "sleeping")
            yield "memx_weights_wakes_total", base, w["sleep"]["wakes"]
            if w["sleep"]["last_wake_s"] is not None:
                yield "memx_weights_last_wake_seconds", base, w["sleep"]["last_wake_s"]
    shared = el.get("shared_pool")
    if shared:
        chunk = shared.get("chunk_bytes", el["chunk_bytes"])
        yield "memx_shared_pool_borrowed_chunks_total", base, shared["borrowed_total"]
        yield "memx_shared_pool_returned_chunks_total", base, shared["returned_total"]
        yield "memx_shared_pool_denied_total", base, shared["denied_total"]
        yield "memx_shared_pool_reclaim_requests_total", base, shared["reclaim_requests"]
        yield "memx_shared_pool_held_bytes", base, shared["held_chunks"] * chunk
        yield "memx_shared_pool_budget_bytes", base, shared["budget_chunks"] * chunk
        arb = shared.get("arbiter")
        if arb:
            yield "memx_pool_arbiter_connected", base, int(arb["connected"])
            yield "memx_shared_pool_private_bytes", base, arb["private_budget_chunks"] * chunk


def _governor_samples(base: dict[str, Any], gov: dict[str, Any] | None) -> Iterable[tuple[str, dict[str, Any], float]]:
    """The governor's SLOs, batch cap and why, predicted vs measured TPOT, decisions, admission
    verdicts; without a governor (neither a TPOT SLO nor ``--memx-governor``: the batch grows as
    stock's) only the cap's reason, ``no_slo``."""
    why = NO_SLO if gov is None else gov["batch_cap_reason"]
    for reason in CAP_REASONS:
        yield "memx_governor_batch_cap_reason", dict(base, reason=reason), int(reason == why)
    if gov is None:
        return
    for kind, slo in sorted((gov.get("slos") or {}).items()):
        if slo is not None:
            yield f"memx_governor_{kind}_slo_seconds", dict(base, source=slo["source"]), slo["ms"] / 1e3
    if gov["batch_cap"] is not None:
        yield "memx_governor_batch_cap", base, gov["batch_cap"]
    for key, name in (("predicted_tpot_ms", "memx_governor_predicted_tpot_seconds"),
                      ("measured_tpot_ms", "memx_governor_measured_tpot_seconds")):  # fmt: skip
        if gov[key] is not None:
            yield name, base, gov[key] / 1e3
    yield "memx_governor_prefill_stall_seconds_per_token", base, gov["prefill_stalls"]["ms_per_token"] / 1e3
    for reason, n in sorted(gov["decisions"].items()):
        yield "memx_governor_decisions_total", dict(base, reason=reason), n
    yield "memx_governor_step_samples_total", base, gov["model"]["samples"]
    for reason, n in sorted((gov.get("admission_verdicts") or {}).items()):
        yield "memx_governor_admission_verdicts_total", dict(base, reason=reason), n


def _peer_samples(base: dict[str, Any], peer: dict[str, Any] | None) -> Iterable[tuple[str, dict[str, Any], float]]:
    if not peer:
        return
    donor = peer.get("donor")
    if donor:
        for lease in donor["leases"]:
            yield "memx_peer_kv_donated_bytes", dict(base, borrower=lease["borrower"]), lease["donated_bytes"]
        yield "memx_peer_kv_reclaims_total", base, peer.get("reclaims", 0)
        yield "memx_peer_kv_reclaimed_bytes_total", base, donor["reclaimed_bytes"]
    b = peer.get("borrower")
    if b:
        for p in b["peers"]:
            yield "memx_peer_kv_borrowed_bytes", dict(base, donor=p["donor"]), p["borrowed_bytes"]
        yield "memx_peer_kv_spills_total", base, peer.get("spills", 0)
        yield "memx_peer_kv_hits_total", base, peer.get("hits", 0)
        yield "memx_peer_kv_pages_stored_total", base, b["pages_stored"]
        yield "memx_peer_kv_pages_loaded_total", base, peer.get("pages_loaded", 0)
        yield "memx_peer_kv_bytes_stored_total", base, b["bytes_stored"]
        yield "memx_peer_kv_bytes_loaded_total", base, b["bytes_loaded"]
        yield "memx_peer_kv_entries_dropped_total", dict(base, cause="reclaim"), b["entries_dropped_reclaim"]
        yield "memx_peer_kv_entries_dropped_total", dict(base, cause="donor_lost"), b["entries_dropped_dead"]
        yield "memx_peer_kv_recomputes_after_reclaim_total", base, peer.get("recomputes_after_reclaim", 0)


def render_prometheus(doc: dict[str, Any]) -> str:
    """The status document as Prometheus text format 0.0.4 (one HELP/TYPE block per metric)."""
    out = Samples()
    for rank in doc.get("schedulers", []):
        for name, labels, value in _samples(rank):
            out.add(name, labels, number(value))
    return render(_HELP, out)
