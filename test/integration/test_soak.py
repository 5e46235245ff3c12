"""The one-minute soak (``benchmark/soak.py``, 60 s of traffic after a 10 s warm-up; the
30-minute run is the script's default, figures in docs/reliability.md): ``sglang-memx serve`` with three co-located tiny
models, elastic KV + shared pool, host buffer, sleep / wake and, when the build runs it, the peer tier
(the first model as two replicas lending KV to each other; then the tier must have moved bytes),
under seeded bursty mixed traffic. Every check of the soak must hold (every scheduled
request answered stop / length with its tokens or aborted by us, no engine death, no leak of a
KV group between quiet points); a failure prints the seed and the first violations so the run
replays with ``--seed``.

The run starts with the first integration test (``conftest.background_soak``) and runs beside the
other modules, its engines sharing the cores with theirs; this test waits for it and reads its
JSON. Greedy probes are held to the answers ``serve`` gave at start (``--stock-reference off``,
``support.background_soak``)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_one_minute_soak_keeps_every_invariant(background_soak):
    code, doc, out = background_soak.result(timeout_s=840)
    assert doc is not None, out
    sent = doc["sent"]
    print(f"soak seed {doc['params']['seed']}: {sent} of {doc['scheduled']} requests sent {doc['requests']}, "
          f"leak growth {doc['leak']['growth']}, peer tier: {doc['peer_kv']}")  # fmt: skip
    failed = {k: v for k, v in doc["checks"].items() if not v}
    why = (doc["failure_reasons"], doc["self_deaths"], doc["leak"]["violations"], doc["violations"][:10])
    assert not failed, (failed, why, doc["failures"][:5], f"replay: --seed {doc['params']['seed']}")
    assert code == 0, out
    # The soak is only evidence if the traffic happened: every kind, every request accounted for,
    # at least the schedule's minimum (a quarter of its mean for this duration and rate).
    kinds = {"chat", "chat_stream", "long", "program", "generate", "abort"}
    if doc["peer"] is not None:
        kinds.add("reuse")  # the replicated model's reused prefixes
    assert set(doc["requests"]) == kinds, doc["requests"]
    assert sent == doc["scheduled"] == len(doc["outcomes"]) >= doc["min_scheduled"], doc["requests"]
    assert all(o["verdict"].startswith("pass") for o in doc["outcomes"])
    assert len(doc["samples"]) >= 5
    if doc["peer"] is not None:  # the tier is on: two replicas of one model lent KV to each other
        peer = doc["peer"]
        assert peer["totals"]["bytes_stored"] > 0 and peer["max_borrowed_bytes"] > 0, peer
        assert peer["max_donated_bytes"] > 0 and peer["totals"]["spills"] > 0, peer
