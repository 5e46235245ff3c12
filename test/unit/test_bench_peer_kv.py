"""benchmark/e2e/peer_kv.py's bookkeeping, without servers: the workload is the same for every setup
of a round and fresh every round, hit rates count only returning turns, and a differing or missing
greedy output is reported as a mismatch."""

import argparse
import io

import pytest

from benchmark.e2e import peer_kv


def _args(**kw):
    base = dict(convs=3, turns=3, first_tokens=10, user_tokens=4, new_tokens=2, borrower_tokens=20,
                donor_tokens=100, lend_tokens=60)  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


def test_conversations_same_per_round_fresh_across_rounds():
    a, b, c = (peer_kv.conversations(_args(), r, 512) for r in (0, 0, 1))
    assert a == b and a[0] != c[0]
    first, user = a
    assert len(first) == 3 and all(len(p) == 10 for p in first)
    assert len(user) == 3 and all(len(u) == 2 and all(len(x) == 4 for x in u) for u in user)
    assert min(t for p in first for t in p) >= 3  # the tokenizer's specials are never sent


def test_memory_plan_refuses_a_working_set_that_fits_and_a_lend_above_the_donor():
    with pytest.raises(SystemExit, match="fits the borrower"):
        peer_kv.memory_plan(_args(borrower_tokens=10_000), peer_kv.model_spec())
    with pytest.raises(SystemExit, match="--lend-tokens"):
        peer_kv.memory_plan(_args(lend_tokens=100), peer_kv.model_spec())
    plan = peer_kv.memory_plan(_args(), peer_kv.model_spec())
    assert plan["working_set_tokens"] == 3 * (10 + 2 * 6 + 2)
    assert plan["hicache_ratio"] == 3.0 and plan["hicache_donor_tokens"] == 40
    kv = plan["kv_bytes_per_token"]
    assert plan["memx_pool_budget_bytes"] == 120 * kv + 2 * plan["activation_bytes_per_server"]


def _turn(conv, turn, ttft, prompt, cached, out, host=0):
    return {"conv": conv, "turn": turn, "ttft": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_host": host, "output_ids": out}  # fmt: skip


def test_summarize_counts_returning_turns_only():
    rs = [_turn(0, 0, 9.0, 100, 0, [1]), _turn(0, 1, 1.0, 200, 150, [2], host=50), _turn(1, 1, 3.0, 200, 50, [3]),
          {"conv": 1, "turn": 2, "error": "boom"}]  # fmt: skip
    s = peer_kv.summarize(rs, 2.0)
    assert s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["hit_rate"] == 200 / 400 and s["host_hit_rate"] == 50 / 400
    assert s["ttft_p99_s"] == 3.0 and s["ttft_all_p99_s"] == 9.0
    assert s["ttft_p50_s"] == 3.0  # nearest rank of [1, 3]


def test_mismatches_name_every_differing_or_missing_output():
    ref = {"turns": [_turn(0, 0, 1, 1, 0, [1, 2]), _turn(0, 1, 1, 1, 0, [3, 4])]}
    same = {"turns": [_turn(0, 0, 1, 1, 0, [1, 2]), _turn(0, 1, 1, 1, 0, [3, 4])]}
    diff = {"turns": [_turn(0, 0, 1, 1, 0, [1, 2]), {"conv": 0, "turn": 1, "error": "x"}]}
    m = peer_kv.mismatches([{"stock": ref, "memx": same}, {"stock": ref, "memx": diff}], "memx")
    assert m["compared"] == 4 and m["mismatched"] == 1
    assert m["first"][0]["round"] == 1 and m["first"][0]["turn"] == 1 and m["first"][0]["want"] == [3, 4]


class _Borrower:
    """A memx borrower's ``/memx/status``: loads 16 tokens a request, holds 12 MiB from its donor."""

    def __init__(self):
        self.peer = dict.fromkeys(peer_kv.PEER_COUNTERS, 0)
        self.peer["tokens_loaded"] = 1000  # from before the rounds: the counters are cumulative
        self.borrowed = 12 << 20

    def status(self, url, timeout=30):
        peer = dict(self.peer, borrower={"borrowed_bytes": self.borrowed, "entries_dropped_reclaim": 0})
        return {"schedulers": [{"peer_kv": peer, "kv_pool": {}, "elastic_kv": {}}]}

    def stream(self, url, ids, new_tokens):
        self.peer["tokens_loaded"] += 16
        return {"ttft": 0.1, "prompt_tokens": len(ids), "cached_tokens": 16, "cached_host": 0,
                "output_ids": [7] * new_tokens}  # fmt: skip


class _NoLoad:
    def __init__(self, *a, **kw):
        pass

    def stop(self):
        return {"requests": 0, "errors": [], "failed": 0}


def test_peer_totals_add_round_deltas_and_keep_the_borrowed_gauge_apart(monkeypatch):
    fake = _Borrower()
    monkeypatch.setattr(peer_kv, "http_json", fake.status)
    monkeypatch.setattr(peer_kv, "stream_ids", fake.stream)
    monkeypatch.setattr(peer_kv, "DonorLoad", _NoLoad)
    monkeypatch.setattr(peer_kv.urllib.request, "urlopen", lambda *a, **kw: io.BytesIO())  # /flush_cache
    pair = {role: argparse.Namespace(url=f"http://{role}") for role in ("borrower", "donor")}
    args = _args(convs=2, turns=2, donor_gap_s=1.0)
    rounds = [{"memx": peer_kv.run_once("memx", pair, args, r, 512)} for r in range(3)]
    assert [r["memx"]["peer"]["tokens_loaded"] for r in rounds] == [64, 64, 64]
    totals = peer_kv.peer_totals(rounds)
    assert totals["tokens_loaded"] == 3 * 64 and "borrowed_bytes_after" not in totals
    assert peer_kv.borrowed_after_each_round(rounds) == [12 << 20] * 3
