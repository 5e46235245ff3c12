"""/memx/metrics rendering and the `sglang-memx top` frame, from a status document."""

import re
import time

from sglang_memx.metrics import render_prometheus
from sglang_memx.top import render

RANK = {
    "dp_rank": 0,
    "pool_name": "gpu0",
    "kv_pool": {
        "capacity_tokens": 4096,
        "used_tokens": 100,
        "available_tokens": 300,
        "evictable_tokens": 50,
        "bytes": 65536,
    },
    "requests": {"running": 2, "waiting": 1},
    "elastic_kv": {
        "mapped_bytes": 65536,
        "logical_bytes": 1 << 20,
        "groups_mapped": 4,
        "pool_capacity_bytes": 1 << 19,
        "owners_bytes": {"kv": 65536, "free": 4096},
        "groups_mapped_total": 9,
        "groups_unmapped_total": 5,
        "grow_refused": 1,
        "map_seconds": 0.002,
        "unmap_seconds": 0.001,
        "max_map_seconds": 0.0005,
        "max_unmap_seconds": 0.0002,
        "chunk_bytes": 4096,
        "backend": {"map_calls": 36, "unmap_calls": 20},
        "activation": {
            "held_bytes": 8192,
            "peak_held": 45,
            "chunks_from_kv": 4,
            "chunks_lent_to_kv": 30,
            "deferred_requests": 2,
            "allocator": {"kind": "memx arena", "live_bytes": 6 << 20, "overflow_allocs": 1},
        },
        "host_buffer": {
            "used_bytes": 1000,
            "logical_bytes": 4096,
            "parked": 3,
            "restored": 2,
            "dropped": 0,
            "fetched": 4,
            "prefill_offloads": 5,
        },
        "shared_pool": {
            "borrowed_total": 40,
            "returned_total": 20,
            "denied_total": 2,
            "reclaim_requests": 3,
            "held_chunks": 17,
            "budget_chunks": 52,
            "chunk_bytes": 4096,
            "arbiter": {
                "connected": False,
                "lost_reason": "EOF",
                "lost_at": 1.0,
                "private_budget_chunks": 5,
                "adopted_chunks": 0,
                "rejoins": 0,
            },
        },
    },
}
DOC = {"schedulers": [RANK]}


def test_prometheus_text_has_help_type_and_labelled_samples():
    text = render_prometheus(DOC)
    assert text.endswith("\n")
    assert "# TYPE memx_kv_map_total counter" in text
    assert 'memx_kv_map_total{dp_rank="0",pool="gpu0"} 9' in text
    assert 'memx_pool_owner_bytes{dp_rank="0",owner="kv",pool="gpu0"} 65536' in text
    assert 'memx_vmm_calls_total{call="map_calls",dp_rank="0",pool="gpu0"} 36' in text
    assert 'memx_shared_pool_held_bytes{dp_rank="0",pool="gpu0"} 69632' in text
    assert 'memx_pool_arbiter_connected{dp_rank="0",pool="gpu0"} 0' in text  # the arbiter was lost
    assert 'memx_shared_pool_private_bytes{dp_rank="0",pool="gpu0"} 20480' in text
    assert 'memx_activation_peak_held_bytes{dp_rank="0",pool="gpu0"} 184320' in text
    assert 'memx_activation_chunks_lent_to_kv_total{dp_rank="0",pool="gpu0"} 30' in text
    assert 'memx_host_buffer_restored_total{dp_rank="0",pool="gpu0"} 2' in text
    assert 'memx_activation_arena_live_bytes{dp_rank="0",pool="gpu0"} 6291456' in text
    assert 'memx_activation_arena_overflow_allocs_total{dp_rank="0",pool="gpu0"} 1' in text
    assert 'memx_host_buffer_prefill_offloads_total{dp_rank="0",pool="gpu0"} 5' in text
    sample = re.compile(r"^[a-z_]+(\{[^}]*\})? -?[0-9.e+-]+$")
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    names = [l.split()[2] for l in text.splitlines() if l.startswith("# TYPE")]
    assert len(names) == len(set(names))  # one HELP/TYPE block per metric


def test_prometheus_without_elastic_kv_has_only_token_gauges():
    rank = {k: v for k, v in RANK.items() if k not in ("elastic_kv", "pool_name")}
    text = render_prometheus({"schedulers": [rank]})
    assert 'memx_kv_capacity_tokens{dp_rank="0"} 4096' in text
    assert "memx_kv_mapped_bytes" not in text and "shared_pool" not in text


def test_top_frame_shows_pools_clients_and_servers():
    snap = {
        "time": time.time(),
        "pools": [
            {
                "name": "gpu0",
                "socket": "/x/gpu0.sock",
                "budget": 52,
                "created": 20,
                "free": 3,
                "floor": 0,
                "pending": 0,
                "granularity": 4096,
                "clients": [
                    {"name": "sglang-11", "pid": 11, "held": 17, "asked": 1},
                    {"name": "sglang-memx-top", "pid": 99, "held": 0, "asked": 0},
                ],
            },
            {"name": "dead", "socket": "/x/dead.sock", "error": "no answer"},
        ],
        "servers": [
            {"url": "http://127.0.0.1:30001", "pool": "gpu0", "status": DOC},
            {"url": "http://127.0.0.1:30002", "error": "refused"},
        ],
    }
    frame = render(snap)
    assert "gpu0" in frame and "68.00 KiB lent of 208.00 KiB" in frame
    assert "sglang-11" in frame and "sglang-memx-top" not in frame
    assert "dead" in frame and "unreachable" in frame
    assert "http://127.0.0.1:30001" in frame and "map 9 unmap 5" in frame and "pool gpu0" in frame


WEIGHTS = {
    "layers": 8, "resident_layers": 2, "streamed_layers": 6, "lent_bytes": 4 << 20, "fetch_bytes": 3 << 20,
    "restore_bytes": 1 << 20, "copy_seconds": 0.5, "stall_seconds": 0.01, "hidden_fraction": 0.98,
    "copy_bytes_per_s": 8 << 20, "decisions": {"remap": 6, "restore": 4, "hold": 90},
}  # fmt: skip


def test_weights_metrics_and_top_columns():
    rank = dict(RANK, elastic_kv=dict(RANK["elastic_kv"], weights=WEIGHTS))
    text = render_prometheus({"schedulers": [rank]})
    assert re.search(r"^memx_weights_lent_bytes\{.*\} 4194304$", text, re.M)
    assert re.search(r"^memx_weights_copy_bytes_total\{.*\} 4194304$", text, re.M)
    assert re.search(r'^memx_weights_decisions_total\{.*action="remap".*\} 6$', text, re.M)
    assert "# TYPE memx_weights_stall_seconds_total counter" in text
    assert "memx_weights_link_layers" not in text  # no shared link asked
    linked = dict(WEIGHTS, link={"interval": 2, "sharing": 2, "reason": "2 on the link", "layers": 4})
    text = render_prometheus({"schedulers": [dict(RANK, elastic_kv=dict(RANK["elastic_kv"], weights=linked))]})
    assert re.search(r"^memx_weights_link_layers\{.*\} 4$", text, re.M)
    asleep = dict(WEIGHTS, sleep={"state": "sleeping", "sleeps": 2, "wakes": 1, "last_wake_s": 0.25})
    text = render_prometheus({"schedulers": [dict(RANK, elastic_kv=dict(RANK["elastic_kv"], weights=asleep))]})
    assert re.search(r"^memx_weights_sleeping\{.*\} 1$", text, re.M)
    assert re.search(r"^memx_weights_last_wake_seconds\{.*\} 0.25$", text, re.M)
    frame = render(
        {"time": time.time(), "pools": [], "servers": [{"url": "http://x", "status": {"schedulers": [rank]}}]}
    )
    assert "layers 2/8 resident" in frame and "stall 0.01 s" in frame


PEER = {
    "mode": "both", "name": "s1-2", "block_tokens": 16, "block_bytes": 8192, "spills": 5, "pages_spilled": 12,
    "hits": 3, "pages_loaded": 7, "tokens_loaded": 100, "reclaims": 2, "reclaimed_chunks": 4,
    "recomputes_after_reclaim": 1,
    "donor": {"socket": "/x/p.peer.s1-2.sock", "cap_bytes": 1 << 20, "donated_bytes": 3 << 16,
              "policy_donated_bytes": 3 << 16, "leases": [{"borrower": "s3-4", "pid": 4, "donated_bytes": 3 << 16,
                                                          "fenced_units": 0}],
              "reclaimed_bytes": 4 << 16, "refused": 0},
    "borrower": {"peers": [{"donor": "p.peer.s5-6.sock", "borrowed_bytes": 1 << 17, "blocks": 16, "free_blocks": 4,
                            "pages": 12}],
                 "borrowed_bytes": 1 << 17, "pages_held": 12, "pages_stored": 12, "bytes_stored": 12 * 8192,
                 "pages_hit": 7, "pages_missed": 1, "bytes_loaded": 7 * 8192, "entries_dropped_reclaim": 2,
                 "entries_dropped_dead": 0, "stale_dropped": 1, "donors_lost": 0, "refused_by": []},
}  # fmt: skip


def test_peer_kv_metrics_and_top_line():
    rank = dict(RANK, peer_kv=PEER)
    text = render_prometheus({"schedulers": [rank]})
    assert re.search(r'^memx_peer_kv_donated_bytes\{.*borrower="s3-4".*\} 196608$', text, re.M)
    assert re.search(r'^memx_peer_kv_borrowed_bytes\{.*donor="p.peer.s5-6.sock".*\} 131072$', text, re.M)
    assert re.search(r"^memx_peer_kv_hits_total\{.*\} 3$", text, re.M)
    assert re.search(r"^memx_peer_kv_pages_loaded_total\{.*\} 7$", text, re.M)
    assert re.search(r'^memx_peer_kv_entries_dropped_total\{.*cause="reclaim".*\} 2$', text, re.M)
    assert re.search(r"^memx_peer_kv_recomputes_after_reclaim_total\{.*\} 1$", text, re.M)
    assert "# TYPE memx_peer_kv_spills_total counter" in text
    assert "memx_peer_kv" not in render_prometheus({"schedulers": [RANK]})
    frame = render(
        {"time": time.time(), "pools": [], "servers": [{"url": "http://x", "status": {"schedulers": [rank]}}]}
    )
    assert "peer KV both" in frame and "lends 192.00 KiB to 1" in frame and "reclaims 2" in frame
    assert "borrows 128.00 KiB from 1, spills 5, hits 3 (7 pages)" in frame
