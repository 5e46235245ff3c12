"""Three co-located servers sharing one KV budget through the pool arbiter (--memx-pool).

The budget (131 chunks of 4 KiB, KV and activations together: a 64-token prefill's
activations take 45 chunks, a KV group of 32 float32 tokens 4) is far below what
the three servers' logical capacities add up to, so memory must move: a busy
server borrows, an idle server's cached KV is reclaimed (evicted and given
back) and flows to the next busy one, live, with no restart. Then one server
is SIGKILLed mid-load: the others keep answering, the arbiter takes the dead
server's chunks back, and nothing leaks. Last, the arbiter itself is SIGKILLed
mid-load: the servers finish their requests on what they hold (private budgets),
one of them starts a new arbiter (a crash leaves the pid file of a dead process), and
all adopt what they kept into it.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from memory_ext.pool.arbiter_client import query_arbiter_status
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_with_pool, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
# 536870 B -> 131 chunks of 4 KiB: activations of one 64-token prefill (45 chunks) + 21 KV groups of 32 tokens
BUDGET_GB = "0.0005"
BUDGET_CHUNKS = 131
CHUNKS_PER_GROUP = 4  # 2 layers x (K, V), 32 float32 tokens x 128 B each
# float32: servers see different batch shapes; bf16 rounding could flip a flat random model's argmax
DTYPE = ["--dtype", "float32", "--chunked-prefill-size", "64"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_root):
    model = tiny_model(SPEC, tiny_model_root)
    pool_dir = tmp_path_factory.mktemp("pools")
    name = f"t{os.getpid()}"
    args = DTYPE + [
        "--memx-elastic-kv",
        "--memx-pool",
        name,
        "--memx-pool-budget-gb",
        BUDGET_GB,
        "--memx-pool-dir",
        str(pool_dir),
        "--memx-chunk-kb",
        "4",
    ]
    servers = [SGLangServer(model, name=f"colo-{x}", max_total_tokens=4096, extra_args=args) for x in "abc"]
    start_all(servers)
    sock = pool_dir / f"{name}.sock"
    yield {"servers": servers, "sock": sock, "dir": pool_dir, "name": name}
    release_with_pool(servers, name, pool_dir)


def _gen(server, texts, n):
    return server.request(
        "/generate", {"text": texts, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )


def _held(sock):
    st = query_arbiter_status(sock)
    return {c["pid"]: c["held"] for c in st["clients"] if c["name"].startswith("sglang-")}, st


def _scheduler_pid(server):
    return server.request("/memx/status")["schedulers"][0]["pid"]


def _shared(server):
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["shared_pool"]


def _wait(predicate, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return predicate()


def test_every_server_joined_one_arbiter(pool):
    held, st = _held(pool["sock"])
    assert st["budget"] == BUDGET_CHUNKS and st["granularity"] == 4096
    assert sorted(held) == sorted(_scheduler_pid(s) for s in pool["servers"])
    assert sum(st_c["held"] for st_c in st["clients"]) <= st["budget"]


def test_memory_flows_from_idle_to_busy_server(pool):
    a, b, _ = pool["servers"]
    texts = [f"load {i} " + " ".join(f"q{i}_{j}" for j in range(30)) for i in range(6)]
    out_a = _gen(a, texts, 80)  # 6 x ~115 tokens: more than the 21 KV groups left beside activations
    held, _ = _held(pool["sock"])
    a_pid, _b_pid = _scheduler_pid(a), _scheduler_pid(b)
    assert held[a_pid] > 4 * CHUNKS_PER_GROUP, held  # a borrowed well beyond its group 0
    # a is idle now, its KV sits in its prefix cache; b needs nearly the whole budget
    out_b = _gen(b, texts, 80)
    assert [r["output_ids"] for r in out_b] == [r["output_ids"] for r in out_a]  # same model, same answers
    assert _shared(a)["reclaim_requests"] > 0  # b's borrow made the arbiter reclaim from a
    assert _shared(b)["borrowed_total"] > 4 * CHUNKS_PER_GROUP
    held, st = _held(pool["sock"])
    assert sum(c["held"] for c in st["clients"]) <= st["budget"]


def test_killing_a_server_returns_its_memory_and_spares_the_others(pool):
    a, b, c = pool["servers"]
    c_pid = _scheduler_pid(c)
    errors, results = [], []

    def load(server, tag):
        for k in range(3):
            try:
                r = _gen(server, [f"{tag} {k} {i} " + "w " * 20 for i in range(3)], 40)
                results.append((tag, [len(x["output_ids"]) for x in r]))
            except Exception as exc:  # noqa: BLE001 - any failure on a survivor is the bug
                errors.append((tag, repr(exc)))

    def doomed():
        try:
            _gen(c, [f"doomed {i} " + "z " * 40 for i in range(4)], 200)
        except Exception:
            pass  # c dies mid-request

    threads = [
        threading.Thread(target=load, args=(a, "a")),
        threading.Thread(target=load, args=(b, "b")),
        threading.Thread(target=doomed),
    ]
    for t in threads:
        t.start()
    time.sleep(3)
    os.killpg(c.proc.pid, signal.SIGKILL)
    for t in threads:
        t.join(600)
    assert errors == [], errors
    assert sorted(results) == sorted([("a", [40] * 3)] * 3 + [("b", [40] * 3)] * 3)
    assert _wait(lambda: c_pid not in _held(pool["sock"])[0])  # the arbiter dropped c
    # no leak: once a and b flush their caches, each holds only its group 0
    for s in (a, b):
        s.request_text("/flush_cache")
    assert _wait(lambda: sorted(_held(pool["sock"])[0].values()) == [CHUNKS_PER_GROUP] * 2), _held(pool["sock"])
    _, st = _held(pool["sock"])
    assert st["created"] - st["free"] == 2 * CHUNKS_PER_GROUP  # every other chunk is back in FREE


def test_top_and_metrics_show_the_pool(pool):
    a = pool["servers"][0]
    frame = subprocess.run(
        [sys.executable, "-m", "sglang_memx.cli", "top", "--once", "--pool-dir", str(pool["dir"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert frame.returncode == 0, frame.stderr
    assert pool["name"] in frame.stdout and a.url in frame.stdout
    metrics = a.request_text("/memx/metrics")
    assert "memx_shared_pool_borrowed_chunks_total{" in metrics
    assert 'memx_pool_owner_bytes{dp_rank="0",owner="kv",pool="' in metrics


def test_killing_the_arbiter_a_survivor_restarts_it_and_everyone_adopts_what_they_kept(pool):
    """SIGKILL of the pool's arbiter mid-load: the servers fall back to what they hold, one of them
    starts a new arbiter (its pid file names a dead process: a crash), every server rejoins it and
    adopts its kept chunks; no request fails, the books balance, nothing leaks."""
    live = [s for s in pool["servers"] if s.proc.poll() is None]  # c too when this test runs alone
    a, b = live[:2]
    pid_file = pool["dir"] / f"{pool['name']}.pid"
    errors, results = [], []

    def load(server, tag):
        for k in range(3):
            try:
                r = _gen(server, [f"{tag} arb {k} {i} " + "v " * 20 for i in range(3)], 40)
                results.append((tag, [len(x["output_ids"]) for x in r]))
            except Exception as exc:  # noqa: BLE001 - a failed request is the bug
                errors.append((tag, repr(exc)))

    threads = [threading.Thread(target=load, args=(s, t)) for s, t in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    time.sleep(2)
    killed = int(pid_file.read_text())
    os.kill(killed, signal.SIGKILL)  # mid-load
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung after the arbiter died"
    assert errors == [], errors
    assert sorted(results) == sorted([("a", [40] * 3)] * 3 + [("b", [40] * 3)] * 3)

    def rejoined():
        for s in live:
            _gen(s, ["tick"], 1)  # an iteration runs the tick that rejoins
        return all(_shared(s)["arbiter"]["connected"] for s in live)

    assert _wait(rejoined), [_shared(s)["arbiter"] for s in live]
    restarted = int(pid_file.read_text())
    assert restarted != killed and os.path.exists(f"/proc/{restarted}")
    kept = {}
    for s in live:  # the loss stays listed after the rejoin
        arb = _shared(s)["arbiter"]
        assert arb["lost_reason"] and arb["lost_at"], arb
        assert arb["rejoins"] == 1 and arb["private_budget_chunks"] == 0 and arb["adopted_chunks"] > 0, arb
        kept[_scheduler_pid(s)] = arb["adopted_chunks"]
        assert 'memx_pool_arbiter_connected{dp_rank="0",pool="' in s.request_text("/memx/metrics")
    held, st = _held(pool["sock"])
    assert sorted(held) == sorted(kept)
    assert sum(c["held"] for c in st["clients"]) + st["free"] + (st["budget"] - st["created"]) == st["budget"]
    assert 0 < st["adopted"] and st["created"] <= st["budget"]
    for s in live:  # no leak: flushed, each holds only its group 0 again; the rest left the books or is FREE
        s.request_text("/flush_cache")
    group0 = [CHUNKS_PER_GROUP] * len(live)
    assert _wait(lambda: sorted(_held(pool["sock"])[0].values()) == group0), _held(pool["sock"])
    _, st = _held(pool["sock"])
    assert st["created"] - st["free"] == sum(group0)
    texts = [f"again {i} " + " ".join(f"r{i}_{j}" for j in range(30)) for i in range(6)]
    assert [len(r["output_ids"]) for r in _gen(a, texts, 80)] == [80] * 6  # borrowing works again
    _, st = _held(pool["sock"])
    assert st["created"] <= st["budget"]
    assert os.path.exists(f"/proc/{restarted}")  # the fixture's `pool stop` ends it through the pid file
