"""/memx/metrics rendering and the `sglang-memx top` frame, from a status document."""

import os
import re
import time

import pytest

from memory_ext.policy.governor import CAP_REASONS
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


def _governor(**over):
    """A governor section as ``GovernorPart.status`` writes it (``/memx/status`` → elastic_kv.governor)."""
    doc = {
        "tpot_slo_ms": 80.0, "batch_cap": 5, "batch_cap_reason": "predicted_tpot_within_slo", "running": 3,
        "predicted_tpot_ms": 16.0, "measured_tpot_ms": 16.5, "last_measured_tpot_ms": 17.0, "max_running_seen": 5,
        "measured_decode_step_ms": 15.0, "prefill_stalls": {"ms_per_token": 0.5, "iterations": 60, "stalls": 6},
        "model": {"samples": 40, "min_samples": 8, "intercept_ms": 10.0, "per_request_ms": 2.0,
                  "per_kv_token_ms": 0.0},
        "decisions": {"no_slo": 0, "empty_batch": 2, "learning": 8, "within_slo": 30, "over_slo": 7},
        "last_decision": None,
        "slos": {"tpot": {"ms": 80.0, "source": "models.yaml: models[0].tpot_slo_ms"}, "ttft": None},
        "admission_verdicts": {"over_slo": 0, "park_protects_running": 0, "protects_running": 2,
                               "mechanism_admits": 9, "stock_first": 0, "no_predicted_gain": 4},
    }  # fmt: skip
    doc.update(over)
    return doc


def _with_governor(gov):
    return {"schedulers": [dict(RANK, elastic_kv=dict(RANK["elastic_kv"], governor=gov))]}


# governor section -> (lines that must be in /memx/metrics, metric names that must not, top's line fragments)
GOVERNED = [
    (  # no TPOT SLO: not registered, the batch grows as stock's; only the cap's reason says so
        None,
        ['memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="no_slo"} 1',
         'memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="predicted_tpot_within_slo"} 0'],
        ["memx_governor_batch_cap ", "memx_governor_tpot_slo_seconds", "memx_governor_decisions_total"],
        ["governor off: no TPOT SLO"],
    ),
    (  # an SLO, too few samples: no cap yet
        _governor(batch_cap=None, batch_cap_reason="learning", predicted_tpot_ms=None, measured_tpot_ms=2.5,
                  slos={"tpot": {"ms": 80.0, "source": "--memx-tpot-slo-ms"}, "ttft": None},
                  model={"samples": 3, "min_samples": 8}),
        ['memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="learning"} 1',
         'memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="no_slo"} 0',
         'memx_governor_tpot_slo_seconds{dp_rank="0",pool="gpu0",source="--memx-tpot-slo-ms"} 0.080000000000000002',
         'memx_governor_measured_tpot_seconds{dp_rank="0",pool="gpu0"} 0.0025000000000000001',
         'memx_governor_step_samples_total{dp_rank="0",pool="gpu0"} 3'],
        ["memx_governor_batch_cap ", "memx_governor_predicted_tpot_seconds", "memx_governor_ttft_slo_seconds"],
        ["governor SLO TPOT 80.0 ms (--memx-tpot-slo-ms)", "cap - (learning), run 3",
         "TPOT predicted - / measured 2.5 ms", "refused 7"],
    ),
    (  # capped: both SLOs, the cap and why, predicted vs measured, refusals to grow
        _governor(slos={"tpot": {"ms": 80.0, "source": "models.yaml: models[0].tpot_slo_ms"},
                        "ttft": {"ms": 500.0, "source": "--memx-ttft-slo-ms"}}),
        ['memx_governor_batch_cap{dp_rank="0",pool="gpu0"} 5',
         'memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="predicted_tpot_within_slo"} 1',
         'memx_governor_tpot_slo_seconds{dp_rank="0",pool="gpu0",source="models.yaml: models[0].tpot_slo_ms"} '
         "0.080000000000000002",
         'memx_governor_ttft_slo_seconds{dp_rank="0",pool="gpu0",source="--memx-ttft-slo-ms"} 0.5',
         'memx_governor_predicted_tpot_seconds{dp_rank="0",pool="gpu0"} 0.016',
         'memx_governor_measured_tpot_seconds{dp_rank="0",pool="gpu0"} 0.016500000000000001',
         'memx_governor_prefill_stall_seconds_per_token{dp_rank="0",pool="gpu0"} 0.00050000000000000001',
         'memx_governor_decisions_total{dp_rank="0",pool="gpu0",reason="over_slo"} 7',
         'memx_governor_decisions_total{dp_rank="0",pool="gpu0",reason="within_slo"} 30',
         "# TYPE memx_governor_decisions_total counter", "# TYPE memx_governor_batch_cap gauge"],
        [],
        ["governor SLO TPOT 80.0 ms (models.yaml: models[0].tpot_slo_ms), TTFT 500.0 ms (--memx-ttft-slo-ms)",
         "cap 5 (predicted_tpot_within_slo), run 3",
         "TPOT predicted 16.0 ms / measured 16.5 ms (prefill stalls 0.5 ms/token)", "refused 7",
         "admission mechanism_admits 9, no_predicted_gain 4, protects_running 2"],
    ),
    (  # --memx-governor without an SLO: no cap, the admission verdicts it passed
        _governor(tpot_slo_ms=None, batch_cap=None, batch_cap_reason="no_slo", predicted_tpot_ms=None,
                  slos={"tpot": None, "ttft": None},
                  admission_verdicts={"protects_running": 0, "mechanism_admits": 0, "stock_first": 3}),
        ['memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="no_slo"} 1',
         'memx_governor_admission_verdicts_total{dp_rank="0",pool="gpu0",reason="stock_first"} 3',
         'memx_governor_admission_verdicts_total{dp_rank="0",pool="gpu0",reason="protects_running"} 0'],
        ["memx_governor_batch_cap ", "memx_governor_tpot_slo_seconds", "memx_governor_predicted_tpot_seconds"],
        ["governor SLO -  cap - (no_slo), run 3", "admission stock_first 3"],
    ),
    (  # --memx-governor, its default SLO still measuring the solo decode step
        _governor(tpot_slo_ms=None, batch_cap=None, batch_cap_reason="no_slo", slos={"tpot": None, "ttft": None},
                  default_slo={"scale": 20.0, "solo_samples": 3, "samples_needed": 5, "solo_step_ms": None,
                               "tpot_slo_ms": None}),  # fmt: skip
        ['memx_governor_batch_cap_reason{dp_rank="0",pool="gpu0",reason="no_slo"} 1'],
        ["memx_governor_tpot_slo_seconds"],
        ["governor SLO TPOT - (default 20 x the solo step: measuring, 3/5)  cap - (no_slo)"],
    ),
    (  # a tiny SLO stays readable in top
        _governor(tpot_slo_ms=0.01, batch_cap=1, slos={"tpot": {"ms": 0.01, "source": "--memx-tpot-slo-ms"},
                                                      "ttft": None}),
        ['memx_governor_tpot_slo_seconds{dp_rank="0",pool="gpu0",source="--memx-tpot-slo-ms"} 1.0000000000000001e-05',
         'memx_governor_batch_cap{dp_rank="0",pool="gpu0"} 1'],
        [],
        ["TPOT 0.01 ms (--memx-tpot-slo-ms)", "cap 1 (predicted_tpot_within_slo)"],
    ),
]  # fmt: skip


@pytest.mark.parametrize("gov,present,absent,top_parts", GOVERNED)
def test_governor_metrics_and_top_line(gov, present, absent, top_parts):
    doc = _with_governor(gov)
    text = render_prometheus(doc)
    lines = text.splitlines()
    for line in present:
        assert line in lines, line
    for name in absent:
        assert name not in text, name
    for line in lines:
        if line.startswith("memx_governor_"):
            name = line.split("{")[0]
            assert f"# HELP {name} " in text and f"# TYPE {name} " in text
    assert sum(line.startswith("memx_governor_batch_cap_reason{") for line in lines) == len(CAP_REASONS)  # one each
    frame = render({"time": time.time(), "pools": [], "servers": [{"url": "http://x", "status": doc}]})
    (gov_line,) = [line for line in frame.splitlines() if line.strip().startswith("governor")]
    for part in top_parts:
        assert part in gov_line, (part, gov_line)


def test_without_elastic_kv_there_is_no_governor_metric_or_line():
    rank = {k: v for k, v in RANK.items() if k not in ("elastic_kv", "pool_name")}
    assert "memx_governor" not in render_prometheus({"schedulers": [rank]})
    server = {"url": "http://x", "status": {"schedulers": [rank]}}
    frame = render({"time": time.time(), "pools": [], "servers": [server]})
    assert "governor" not in frame


def test_a_socket_left_by_a_killed_arbiter_is_shown_stale_not_unreachable(tmp_path, capsys):
    """An arbiter killed with SIGKILL leaves ``<pool>.sock`` and ``<pool>.pid``: its pid is gone, so
    ``top`` and ``pool list`` say "stale" (the next server with the pool's budget replaces it); a
    socket nobody answers whose pid file is missing or alive stays "unreachable"."""
    import subprocess
    import sys

    from sglang_memx.cli import main
    from sglang_memx.top import collect

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that was an arbiter's and is gone
    for name, pid in (("killed", dead.pid), ("nopid", None), ("alive", os.getpid())):
        (tmp_path / f"{name}.sock").write_text("")
        if pid is not None:
            (tmp_path / f"{name}.pid").write_text(f"{pid}\n")
    pools = {p["name"]: p for p in collect(tmp_path, [], timeout=1)["pools"]}
    assert set(pools) == {"killed", "nopid", "alive"} and all("error" in p for p in pools.values())
    assert f"pid {dead.pid}) is gone" in pools["killed"]["stale"]
    assert "stale" not in pools["nopid"] and "stale" not in pools["alive"]
    frame = render({"time": 0.0, "pools": list(pools.values()), "servers": [], "routers": []})
    assert re.search(r"killed +stale: its arbiter", frame) and re.search(r"nopid +unreachable: ", frame)
    assert main(["pool", "list", "--pool-dir", str(tmp_path)]) == 0
    listed = dict(line.split("\t")[:2] for line in capsys.readouterr().out.splitlines())
    assert listed == {"alive": "unreachable", "killed": "stale", "nopid": "unreachable"}
