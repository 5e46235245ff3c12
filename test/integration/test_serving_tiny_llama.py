"""Real upstream SGLang on CPU with the memx plugin, next to stock SGLang.

One memx server and one stock server (plugin filtered out with
SGLANG_PLUGINS) serve the same tiny random Llama (GQA); every API surface is
exercised on the memx server and greedy outputs are compared with stock. The model and
arguments are test_elastic_kv.py's and test_tensor_parallel.py's, so the stock server is the
session's shared one (a test here only sends it requests).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPTS = [
    "The capital of France is",
    "Memory pages map to chunks when",
    "one two three",
    "A small model answers the question",
    "hello world what is the budget of the pool",
]
MAX_TOTAL_TOKENS = 4096
SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
COMMON = ["--chunked-prefill-size", "16", "--dtype", "float32"]


@pytest.fixture(scope="module")
def servers(tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)
    memx = SGLangServer(model, name="tiny-llama-memx", max_total_tokens=MAX_TOTAL_TOKENS, extra_args=COMMON)
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-s5-f32", stock=True, max_total_tokens=MAX_TOTAL_TOKENS,
                     extra_args=COMMON)
    )  # fmt: skip
    start_all([memx, stock])
    yield memx, stock
    release_all((memx, stock))


def _greedy(server, text, n=16):
    return server.generate(text, max_new_tokens=n, temperature=0)


def test_startup_line_names_versions_and_features(servers):
    memx, stock = servers
    log = memx.log_path.read_text()
    assert "sglang-memx 0.1.0 active on sglang 0.5.23; features on: status_endpoint" in log
    assert "sglang-memx 0.1.0" not in stock.log_path.read_text()


def test_greedy_generate_matches_stock(servers):
    memx, stock = servers
    for prompt in PROMPTS:
        a, b = _greedy(memx, prompt), _greedy(stock, prompt)
        assert a["output_ids"] == b["output_ids"], prompt
        assert a["text"] == b["text"]
        assert a["meta_info"]["completion_tokens"] == 16


def test_batched_generate_matches_stock(servers):
    memx, stock = servers
    a = memx.request("/generate", {"text": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    b = stock.request("/generate", {"text": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    # Batched greedy equals one-by-one greedy on the same server.
    assert a[0]["output_ids"][:12] == _greedy(memx, PROMPTS[0], 12)["output_ids"]


def test_sampled_generate_respects_sampling_params(servers):
    memx, stock = servers
    greedy = _greedy(memx, PROMPTS[1])["output_ids"]
    for server in servers:
        # top_k=1 leaves one candidate per step: sampling must reproduce greedy.
        top1 = server.generate(PROMPTS[1], max_new_tokens=16, temperature=1.0, top_k=1)
        assert top1["output_ids"] == greedy
    samples = [memx.generate(PROMPTS[1], max_new_tokens=16, temperature=1.5, top_p=0.95) for _ in range(4)]
    assert all(len(x["output_ids"]) == x["meta_info"]["completion_tokens"] for x in samples)
    assert len({tuple(x["output_ids"]) for x in samples}) >= 2, "sampling looks greedy"


def test_streaming_matches_non_streaming(servers):
    memx, _ = servers
    req = urllib.request.Request(
        memx.url + "/generate",
        data=json.dumps(
            {"text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[5:]))
    assert len(chunks) >= 2, "expected several streamed chunks"
    assert chunks[-1]["text"] == _greedy(memx, PROMPTS[0])["text"]


def test_openai_chat_completions_match_stock(servers):
    import openai

    memx, stock = servers
    answers = []
    for server in (memx, stock):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        resp = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "What is the pool?"}], max_tokens=12, temperature=0
        )
        assert resp.choices[0].message.role == "assistant"
        assert resp.usage.completion_tokens > 0
        answers.append(resp.choices[0].message.content)
    assert answers[0] == answers[1]


def test_openai_completions_match_stock(servers):
    import openai

    memx, stock = servers
    texts = []
    for server in (memx, stock):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        resp = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=10, temperature=0)
        texts.append(resp.choices[0].text)
        assert resp.usage.completion_tokens == 10
    assert texts[0] == texts[1]


def test_frontend_program_fork_and_run_batch(servers):
    import sglang as sgl

    @sgl.function
    def two_continuations(s, topic):
        s += "Topic: " + topic + "."
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Point {i}:" + sgl.gen("point", max_tokens=8, temperature=0)
        s += " Summary:" + forks[0]["point"] + forks[1]["point"]
        s += sgl.gen("summary", max_tokens=8, temperature=0)

    results = {}
    for server in servers:
        backend = sgl.RuntimeEndpoint(server.url)
        states = two_continuations.run_batch([{"topic": "memory"}, {"topic": "cache"}], backend=backend)
        results[server.name] = [st["summary"] for st in states]
        assert all(isinstance(x, str) for x in results[server.name])
        single = two_continuations.run(topic="memory", backend=backend)
        assert single["summary"] == results[server.name][0]
    memx, stock = servers
    assert results[memx.name] == results[stock.name]


def test_memx_status_reports_live_pool(servers):
    memx, stock = servers
    doc = memx.request("/memx/status")
    assert doc["memx_version"] == "0.1.0" and doc["sglang_version"] == "0.5.23"
    assert doc["enabled"] is True and doc["features"]["status_endpoint"] is True
    [rank] = doc["schedulers"]
    assert rank["dp_rank"] == 0
    pool = rank["kv_pool"]
    assert pool["capacity_tokens"] == MAX_TOTAL_TOKENS
    assert pool["page_size"] == 1 and pool["dtype"] == "float32" and pool["device"] == "cpu"
    assert pool["kind"] == "MHATokenToKVPool" and pool["layers"] == 2
    # K and V, 2 layers, 2 KV heads x 16 dims, float32, capacity (+ upstream's padding slots).
    per_token = 2 * 2 * 2 * 16 * 4
    assert MAX_TOTAL_TOKENS * per_token <= pool["bytes"] <= (MAX_TOTAL_TOKENS + 1024) * per_token
    assert pool["used_tokens"] + pool["available_tokens"] + pool["evictable_tokens"] == pool["capacity_tokens"]
    assert rank["pid"] != memx.proc.pid  # read from the scheduler process, not the HTTP one
    # The radix cache keeps finished prompts: evictable tokens are visible.
    assert pool["evictable_tokens"] > 0
    with pytest.raises(urllib.error.HTTPError) as err:
        stock.request("/memx/status")
    assert err.value.code == 404


def test_memx_status_sees_running_request(servers):
    memx, _ = servers
    done = threading.Event()

    def long_request():
        try:
            memx.generate("Keep going: " * 20, max_new_tokens=400, temperature=0, ignore_eos=True)
        finally:
            done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    seen = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        rank = memx.request("/memx/status")["schedulers"][0]
        if rank["requests"]["running"] >= 1 and rank["kv_pool"]["used_tokens"] > 0:
            seen = rank
            break
        time.sleep(0.05)
    worker.join(timeout=300)
    assert seen is not None, "status never showed the running request"
    assert seen["kv_pool"]["used_tokens"] >= 20


def test_cli_status_prints_the_document(servers):
    import subprocess
    import sys

    memx, _ = servers
    out = subprocess.run(
        [sys.executable, "-m", "sglang_memx.cli", "status", "--url", memx.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["schedulers"][0]["kv_pool"]["capacity_tokens"] == MAX_TOTAL_TOKENS
