"""KV slab: two co-located models with different KV cells share one pool (FineServe F1/F2, E5).

Model A: float32, 2 layers, 2 KV heads x 16: a K or V row is 128 B, 512 B per token; its slab
(KV group) is 32 tokens in 4 chunks of 4 KiB. Model B: bfloat16, 3 layers, 1 KV head x 32: a
row is 64 B, 384 B per token; its slab is 64 tokens in 6 chunks. Both borrow the same 4 KiB
chunks from one arbiter, whose budget (0.0007 GB = 183 chunks, KV and prefill activations
together) is less than what A's burst and B's long requests hold at their peaks: B can only run
on memory A gave back. B's requests run one at a time, so its bf16 batches have stock's shapes
(a concurrent bf16 batch of other shapes could flip a random tiny model's argmax).

fp8 KV is not in this test: SGLang 0.5.23 refuses it on CPU before memx is involved
(``fp8_e5m2``: "--kv-cache-dtype fp8_e5m2 is not supported on CPU."; ``fp8_e4m3``: "CPU FP8 KV
cache requires Intel AMX support.", and with AMX it is a quantized KV cache that memx's elastic KV
refuses); see docs/memory-pool.md, "KV slab".
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from memory_ext.policy.kv_format import KVLayout, KVPrecision, slab_format, token_kv_bytes, uniform_slab_units
from memory_ext.pool.arbiter_client import query_arbiter_status
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_with_pool, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SPEC_A = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
SPEC_B = TinyModelSpec(arch="llama", num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, seed=9)
DTYPE = {"a": ("float32", 4), "b": ("bfloat16", 2)}
SPECS = {"a": SPEC_A, "b": SPEC_B}
CHUNK_KB = 4
BUDGET_GB = "0.0007"  # 751,619 B -> 183 chunks of 4 KiB
BUDGET_CHUNKS = 183
COMMON = ["--chunked-prefill-size", "64"]
BURST = [f"burst {i} " + " ".join(f"q{i}_{j}" for j in range(30)) for i in range(6)]  # A: 6 x ~115 tokens
LONG = [" ".join(["north south east west river city"] * 20) + f" part {k}" for k in range(2)]  # B: ~125 tokens
SMALL = ["hello world the model", "paris is the capital of", "memory pool share borrow"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_root, shared_servers):
    pool_dir = tmp_path_factory.mktemp("slabpools")
    name = f"s{os.getpid()}"
    shared = ["--memx-elastic-kv", "--memx-pool", name, "--memx-pool-budget-gb", BUDGET_GB,
              "--memx-pool-dir", str(pool_dir), "--memx-chunk-kb", str(CHUNK_KB)]  # fmt: skip
    servers = {}
    for key, spec in SPECS.items():
        model = tiny_model(spec, tiny_model_root)
        args = COMMON + ["--dtype", DTYPE[key][0]]
        servers[key] = SGLangServer(model, name=f"slab-{key}", max_total_tokens=4096, extra_args=args + shared)
        if key == "a":  # test_peer_kv.py's stock server too (same model and arguments): one a session
            stock = shared_servers.get(SGLangServer(model, name="stock-llama-s5-f32-c64", stock=True, extra_args=args))
        else:
            stock = SGLangServer(model, name=f"slab-stock-{key}", stock=True, extra_args=args)
        servers[f"stock-{key}"] = stock
    start_all(list(servers.values()))
    yield {"servers": servers, "sock": pool_dir / f"{name}.sock", "dir": pool_dir, "name": name}
    release_with_pool(servers.values(), name, pool_dir)


def _gen(server, texts, n):
    payload = {"text": texts, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    out = server.request("/generate", payload)
    return [r["output_ids"] for r in out] if isinstance(texts, list) else out["output_ids"]


def _rank(server):
    return server.request("/memx/status")["schedulers"][0]


def _arbiter(sock):
    st = query_arbiter_status(sock, name="slab-test")
    held = {c["pid"]: c["held"] for c in st["clients"] if c["name"].startswith("sglang-")}
    return held, st


class Sampler:
    """Polls the arbiter while a load runs: the peak each server held, and chunk conservation
    (held + free == created <= budget) at every sample."""

    def __init__(self, sock):
        self.sock, self.peak, self.bad, self.samples = sock, {}, [], 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            held, st = _arbiter(self.sock)
            total = sum(c["held"] for c in st["clients"])
            if total + st["free"] != st["created"] or st["created"] > st["budget"]:
                self.bad.append((total, st["free"], st["created"], st["budget"]))
            for pid, n in held.items():
                self.peak[pid] = max(self.peak.get(pid, 0), n)
            self.samples += 1
            self._stop.wait(0.1)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


def _expected_format(key):
    spec, (dtype, nbytes) = SPECS[key], DTYPE[key]
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, precision=KVPrecision(dtype, nbytes))
    row = spec.num_kv_heads * spec.head_dim * nbytes
    return layout, slab_format("x", [row] * (2 * spec.num_layers), CHUNK_KB << 10)


def test_each_server_formats_its_slabs_for_its_own_kv_cell(pool):
    held, st = _arbiter(pool["sock"])
    assert st["budget"] == BUDGET_CHUNKS and st["granularity"] == CHUNK_KB << 10
    slabs = {}
    for key in ("a", "b"):
        rank = _rank(pool["servers"][key])
        assert rank["pid"] in held  # both joined the one arbiter
        sl = rank["elastic_kv"]["slab"]
        layout, fmt = _expected_format(key)
        assert sl["kv_dtype"] == DTYPE[key][0] and sl["layers"] == SPECS[key].num_layers
        assert sl["token_bytes_per_layer"] == token_kv_bytes(layout)  # F2's TokenSize
        assert sl["bytes_per_token"] == token_kv_bytes(layout, per_layer=False) == fmt.bytes_per_token
        assert (sl["tokens_per_slab"], sl["slab_units"]) == (fmt.tokens_per_slab, fmt.slab_units)
        assert sl["slab_bytes"] == sl["tokens_per_slab"] * sl["bytes_per_token"] and sl["waste_bytes"] == 0
        assert sl["tokens_per_slab"] == rank["elastic_kv"]["group_tokens"]
        assert sl["slab_units"] == rank["elastic_kv"]["chunks_per_group"]
        slabs[key] = sl
    assert (slabs["a"]["bytes_per_token"], slabs["a"]["tokens_per_slab"], slabs["a"]["slab_units"]) == (512, 32, 4)
    assert (slabs["b"]["bytes_per_token"], slabs["b"]["tokens_per_slab"], slabs["b"]["slab_units"]) == (384, 64, 6)
    assert uniform_slab_units([4, 6]) == 12


def test_greedy_outputs_equal_each_models_stock_server(pool):
    s = pool["servers"]
    for key in ("a", "b"):
        assert _gen(s[key], SMALL, 16) == _gen(s[f"stock-{key}"], SMALL, 16), key


def test_a_busy_then_b_runs_on_memory_a_gave_back(pool):
    s = pool["servers"]
    a_pid, b_pid = _rank(s["a"])["pid"], _rank(s["b"])["pid"]
    a_before = _rank(s["a"])["elastic_kv"]
    with Sampler(pool["sock"]) as burst:
        out_a = _gen(s["a"], BURST, 80)
    assert out_a == _gen(s["stock-a"], BURST, 80)
    before = _rank(s["b"])["elastic_kv"]
    with Sampler(pool["sock"]) as long_b:
        out_b = [_gen(s["b"], text, 300) for text in LONG]  # one at a time: stock's batch shapes
    assert out_b == [_gen(s["stock-b"], text, 300) for text in LONG]
    after = _rank(s["b"])["elastic_kv"]
    assert burst.bad == [] and long_b.bad == [], (burst.bad, long_b.bad)  # conservation at every sample
    peak_a, peak_b = burst.peak[a_pid], long_b.peak[b_pid]
    # each grew far beyond its one slab, and together beyond the budget: B used what A gave back
    assert peak_a > 20 * 4 and peak_b > 10 * 6, (peak_a, peak_b)
    assert peak_a + peak_b > BUDGET_CHUNKS, (peak_a, peak_b, burst.samples, long_b.samples)
    a_shared = _rank(s["a"])["elastic_kv"]["shared_pool"]
    assert (
        a_shared["returned_total"] > 0
        and after["shared_pool"]["borrowed_total"] > before["shared_pool"]["borrowed_total"]
    )
    # steady decode made no map call on its path: the slabs it crossed were premapped ...
    steps = after["decode_steps"] - before["decode_steps"]
    premapped = after["map_calls"]["premap"] - before["map_calls"]["premap"]
    assert steps >= 2 * 299 and premapped >= 300 // 64, (steps, premapped)
    a_after = _rank(s["a"])["elastic_kv"]
    print(
        f"\nKV slab: peak chunks A {peak_a}, B {peak_b} (budget {BUDGET_CHUNKS}); A returned "
        f"{a_shared['returned_total']}, reclaims asked {a_shared['reclaim_requests']}; B decode steps {steps}, "
        f"slabs premapped {premapped}, request-path maps in decode "
        f"{after['decode_map_calls'] - before['decode_map_calls']}; A burst: decode steps "
        f"{a_after['decode_steps'] - a_before['decode_steps']}, request-path maps in decode "
        f"{a_after['decode_map_calls'] - a_before['decode_map_calls']}, premapped "
        f"{a_after['map_calls']['premap'] - a_before['map_calls']['premap']}, unmaps in decode "
        f"{a_after['decode_unmap_calls'] - a_before['decode_unmap_calls']}; B unmapped "
        f"{after['groups_unmapped_total'] - before['groups_unmapped_total']} slabs "
        f"({after['decode_unmap_calls'] - before['decode_unmap_calls']} on decode steps' paths, tick "
        f"{after['unmap_calls']['tick'] - before['unmap_calls']['tick']}), activation took "
        f"{after['activation']['chunks_from_kv'] - before['activation']['chunks_from_kv']} chunks from KV and lent "
        f"{after['activation']['chunks_lent_to_kv'] - before['activation']['chunks_lent_to_kv']} to it; "
        f"slabs now A {a_after['slab']['slabs']}, "
        f"B {after['slab']['slabs']}"
    )
    # ... and no unmap either: the premap left the next step's activation alone (no ping-pong)
    assert after["decode_map_calls"] - before["decode_map_calls"] == 0, after
    assert after["decode_unmap_calls"] - before["decode_unmap_calls"] == 0, after


def _settled(pool):
    """Arbiter and server views once the idle servers stopped giving chunks back."""
    for _ in range(30):
        held, st = _arbiter(pool["sock"])
        ranks = {key: _rank(pool["servers"][key]) for key in ("a", "b")}
        if all(held.get(r["pid"]) == r["elastic_kv"]["shared_pool"]["held_chunks"] for r in ranks.values()):
            return held, st, ranks
        time.sleep(0.3)
    return held, st, ranks


def test_slab_view_agrees_with_the_pool_and_the_arbiter(pool):
    held, st, ranks = _settled(pool)
    for key in ("a", "b"):
        rank = ranks[key]
        el, sl = rank["elastic_kv"], rank["elastic_kv"]["slab"]
        n = sl["slabs"]
        assert n["PARTIAL"] + n["FULL"] == el["groups_mapped"] and n["FREE"] == sl["slabs_total"] - el["groups_mapped"]
        assert el["owners_bytes"]["kv"] == el["groups_mapped"] * sl["slab_bytes"]  # a slab is whole chunks
        assert (
            sl["stranded_tokens"] + sl["used_tokens"] + sl["dead_tokens"] == el["groups_mapped"] * sl["tokens_per_slab"]
        )
        assert held[rank["pid"]] == el["shared_pool"]["held_chunks"]
    assert sum(c["held"] for c in st["clients"]) + st["free"] == st["created"] <= st["budget"]
    # flushed and idle, each server keeps only its first slab: the rest went back to the pool
    for key in ("a", "b"):
        pool["servers"][key].request_text("/flush_cache")
    want = sorted([4, 6])
    deadline = time.time() + 30
    while time.time() < deadline and sorted(_arbiter(pool["sock"])[0].values()) != want:
        time.sleep(0.3)
    held, st = _arbiter(pool["sock"])
    assert sorted(held.values()) == want and st["created"] - st["free"] == sum(want), (held, st)
    for key in ("a", "b"):
        sl = _rank(pool["servers"][key])["elastic_kv"]["slab"]
        assert sl["slabs"]["PARTIAL"] + sl["slabs"]["FULL"] == 1 and sl["used_tokens"] == 0


def test_status_metrics_and_top_show_the_slabs(pool):
    a = pool["servers"]["a"]
    metrics = a.request_text("/memx/metrics")
    assert 'memx_kv_slab_bytes_per_token{dp_rank="0",format="float32 L2 2x16",pool="' in metrics
    assert 'memx_kv_slabs{dp_rank="0",format="float32 L2 2x16",pool="' in metrics and 'state="FREE"' in metrics
    frame = subprocess.run(
        [sys.executable, "-m", "sglang_memx.cli", "top", "--once", "--pool-dir", str(pool["dir"])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert frame.returncode == 0, frame.stderr
    assert "slab float32 L2 2x16: 512 B/token, 32 tokens = 4 chunk(s)" in frame.stdout
    assert "slab bfloat16 L3 1x32: 384 B/token, 64 tokens = 6 chunk(s)" in frame.stdout
    assert "one uniform slab for all would be 12" in frame.stdout
