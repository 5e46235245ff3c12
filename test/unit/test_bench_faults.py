"""benchmark/faults.py's bookkeeping, without servers: a stream closed without ``[DONE]`` right
after a router kill was cut by it (a clear end); anywhere else it stays a failure."""

from benchmark.faults import CUT_DETAIL, cut_by_router_kills


def _failure(t, detail=CUT_DETAIL, outcome="failed", kind="chat_stream"):
    return {"t": t, "model": "m", "kind": kind, "outcome": outcome, "latency_s": 0.4, "detail": detail}


def test_only_streams_closed_right_after_a_router_kill_count_as_cut():
    faults = [{"n": 0, "kind": "engine", "t": 100.0}, {"n": 1, "kind": "router", "t": 376.4}]
    failures = [
        _failure(227.1),  # 149.3 + 227.1 = 376.4: the router's kill
        _failure(229.0),  # 378.3: still within ROUTER_CUT_S of it
        _failure(-49.0),  # 100.3: right after the *engine* kill: the router had to name the error
        _failure(300.0),  # long after: a living router closed a stream without [DONE]
        _failure(227.2, detail="HTTP 500: oops"),  # another failure at the kill stays one
        _failure(227.3, outcome="error", detail="connection: refused", kind="chat"),
    ]
    counts = {"chat_stream": {"ok": 3, "failed": 5}, "chat": {"error": 1}}
    assert cut_by_router_kills(failures, counts, faults, 149.3) == 2
    assert [f["outcome"] for f in failures] == ["error", "error", "failed", "failed", "failed", "error"]
    assert "router's kill (fault 1)" in failures[0]["detail"]
    assert counts == {"chat_stream": {"ok": 3, "failed": 3, "error": 2}, "chat": {"error": 1}}


def test_counts_lose_the_failed_key_when_every_failure_was_cut():
    counts = {"chat_stream": {"failed": 1}}
    failures = [_failure(10.0)]
    assert cut_by_router_kills(failures, counts, [{"n": 0, "kind": "router", "t": 20.0}], 10.5) == 1
    assert counts == {"chat_stream": {"error": 1}}
