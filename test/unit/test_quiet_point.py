"""``benchmark.quiet_point.snapshot``: an engine's KV in pool units from its status and the
arbiter's books, its peer donation counted apart, per pool."""

from __future__ import annotations

from benchmark import quiet_point

CHUNK = 1 << 16


def status(pid: int, kv_chunks: int, donated_chunks: int | None) -> dict:
    donated = donated_chunks or 0
    elastic = {"groups_mapped": kv_chunks // 4, "mapped_bytes": kv_chunks * CHUNK, "group_bytes": 4 * CHUNK,
               "chunks_per_group": 4,
               "owners_bytes": {"free": 0, "kv": kv_chunks * CHUNK, "peer_donation": donated * CHUNK},
               "shared_pool": {"held_chunks": kv_chunks + donated, "chunk_bytes": CHUNK, "borrowed_total": 30,
                               "returned_total": 10, "denied_total": 1, "late_grants": 0, "outstanding": 0,
                               "pending_reclaim": 0}}  # fmt: skip
    sched = {"pid": pid, "kv_pool": {"evictable_tokens": 0}, "elastic_kv": elastic}
    if donated_chunks is not None:
        sched["peer_kv"] = {"donor": {"cap_bytes": 16 * CHUNK, "donated_bytes": donated_chunks * CHUNK}}
    return {"schedulers": [sched]}


def test_snapshot_counts_each_engines_donation_and_each_pools(monkeypatch):
    answers = {"http://r/memx/serve": {"engines": {"a": {"url": "http://a"}, "b": {"url": "http://b"}}},
               "http://a/memx/status": status(11, 4, 12), "http://b/memx/status": status(12, 8, None)}  # fmt: skip
    monkeypatch.setattr(quiet_point, "http_json", lambda url, *args, **kw: answers[url])
    pools = [{"pool": "cpu0", "held": 24, "held_by_pid": {"11": 16, "12": 8}}, {"pool": "other", "held": 0}]
    snap = quiet_point.snapshot("http://r", pools, [{"rss_bytes": 5, "fds": 2, "threads": 3, "memfd_fds": 1}])
    a, b = snap["engines"]["a"], snap["engines"]["b"]
    assert (a["donated_chunks"], a["donation_cap_chunks"], a["held_chunks"], a["arbiter_held"]) == (12, 16, 16, 16)
    assert a["owners_chunks"] == {"free": 0, "kv": 4, "peer_donation": 12}
    assert a["arbiter_traffic"] == {"borrowed_total": 30, "returned_total": 10, "denied_total": 1, "late_grants": 0,
                                    "outstanding": 0, "pending_reclaim": 0}  # fmt: skip
    assert (b["donated_chunks"], b["donation_cap_chunks"], b["kv_groups"]) == (0, None, 2)
    assert snap["pool_donated"] == {"cpu0": 12, "other": 0}
    assert snap["pool_held"] == {"cpu0": 24, "other": 0}
    assert snap["processes"] == {"rss_bytes": 5, "fds": 2, "threads": 3, "memfd_fds": 1}
