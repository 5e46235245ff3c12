"""The one-minute soak (``benchmark/soak.py``, 60 s of traffic after a 10 s warm-up; the
30-minute run is the script's default, figures in docs/reliability.md): ``sglang-memx serve`` with three co-located tiny
models, elastic KV + shared pool, host buffer, sleep / wake and, when the build runs it, the peer tier
(the first model as two replicas lending KV to each other; then the tier must have moved bytes),
under seeded bursty mixed traffic. Every check of the soak must hold (every scheduled
request answered stop / length with its tokens or aborted by us, no engine death, no leak of a
KV group between quiet points); a failure prints the seed and the first violations so the run
replays with ``--seed``.

Here the greedy probes are held to the answers ``serve`` gave at start (``--stock-reference off``),
not to three stock servers started first: those cost the suite about 75 s of the 2-core box, and
memx-under-serve's greedy answers equal to stock's are checked by ``test_serve_router.py``. The
script's own runs keep the stock reference on (its default)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def test_one_minute_soak_keeps_every_invariant(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmark" / "soak.py"), "--duration-s", "60", "--warmup-s", "10",
           "--results-dir", str(tmp_path), "--out", "soak_ci", "--stock-reference", "off"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    out = proc.stdout + proc.stderr
    doc_path = tmp_path / "soak_ci.json"
    assert doc_path.exists(), out[-4000:]
    doc = json.loads(doc_path.read_text())
    sent = doc["sent"]
    print(f"soak seed {doc['params']['seed']}: {sent} of {doc['scheduled']} requests sent {doc['requests']}, "
          f"leak growth {doc['leak']['growth']}, peer tier: {doc['peer_kv']}")  # fmt: skip
    failed = {k: v for k, v in doc["checks"].items() if not v}
    why = (doc["failure_reasons"], doc["self_deaths"], doc["leak"]["violations"], doc["violations"][:10])
    assert not failed, (failed, why, doc["failures"][:5], f"replay: --seed {doc['params']['seed']}")
    assert proc.returncode == 0, out[-4000:]
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
