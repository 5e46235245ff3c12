"""The embedded SmolLM2-135M-Instruct through real SGLang on CPU, memx vs stock.

This is what `scripts/serve.sh` serves, with its memx features on (elastic KV and the
host buffer); the chat answer is checked for content, and greedy outputs (chat, generate,
frontend-language programs) must be identical with the plugin filtered out.
"""

import re
import shlex
from pathlib import Path

import pytest

from sglang_memx.models.embedded import prepare_embedded_model
from support.server import SGLangServer, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

NAME = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Water boils at"]


SERVE_FEATURES = ["--memx-elastic-kv", "--memx-host-buffer-gb", "1"]  # scripts/serve.sh's defaults


def test_serve_script_serves_with_these_features():
    script = (Path(__file__).resolve().parents[2] / "scripts" / "serve.sh").read_text()
    default = re.search(r'MEMX_FEATURES="\$\{MEMX_FEATURES-"([^"]*)"\}"', script)
    assert default and shlex.split(default.group(1)) == SERVE_FEATURES


@pytest.fixture(scope="module")
def servers():
    model = prepare_embedded_model()
    extra = ["--served-model-name", NAME]
    memx = SGLangServer(model, name="smollm2-memx", max_total_tokens=8192, extra_args=extra + SERVE_FEATURES)
    stock = SGLangServer(model, name="smollm2-stock", stock=True, max_total_tokens=8192, extra_args=extra)
    start_all([memx, stock])
    yield memx, stock
    memx.stop()
    stock.stop()


def _chat(server, **kw):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    return client.chat.completions.create(model=NAME, messages=CHAT, temperature=0, max_tokens=24, **kw)


def test_chat_answers_paris_and_stops(servers):
    memx, _ = servers
    resp = _chat(memx)
    text = resp.choices[0].message.content
    assert "Paris" in text, text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.model == NAME


def test_chat_and_generate_identical_to_stock(servers):
    memx, stock = servers
    assert _chat(memx).choices[0].message.content == _chat(stock).choices[0].message.content
    for prompt in PROMPTS:
        a = memx.generate(prompt, max_new_tokens=20, temperature=0)
        b = stock.generate(prompt, max_new_tokens=20, temperature=0)
        assert a["output_ids"] == b["output_ids"], prompt


def test_prefix_cache_hit_gives_same_answer(servers):
    memx, _ = servers
    first = memx.generate(PROMPTS[0] + " red,", max_new_tokens=12, temperature=0)
    again = memx.generate(PROMPTS[0] + " red,", max_new_tokens=12, temperature=0)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"]


def test_status_reports_the_embedded_model_pool(servers):
    memx, _ = servers
    rank = memx.request("/memx/status")["schedulers"][0]
    pool, elastic = rank["kv_pool"], rank["elastic_kv"]
    assert pool["capacity_tokens"] == 8192 and pool["layers"] == 30
    # SmolLM2-135M: 30 layers, 3 KV heads x 64 dims, K and V, bf16: the logical size; mapped is what is used
    assert elastic["logical_bytes"] >= 8192 * 30 * 2 * 3 * 64 * 2
    assert pool["bytes"] == elastic["mapped_bytes"] <= elastic["logical_bytes"]
    assert pool["used_tokens"] + pool["available_tokens"] + pool["evictable_tokens"] == 8192
    assert rank["features"] == {"status_endpoint": True, "elastic_kv": True, "shared_pool": False,
                                "host_buffer": True, "weights": False}  # fmt: skip
    assert rank["hooks"] and all(h["in_force"] for h in rank["hooks"])


def test_frontend_language_with_memx_features_on(servers):
    """fork, select, regex-constrained gen and run_batch through ``RuntimeEndpoint``: same as stock."""
    import sglang as sgl

    @sgl.function
    def program(s, topic):
        s += sgl.user(f"Give two facts about {topic}.")
        s += sgl.assistant_begin()
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=12, temperature=0)
        s += "Facts: " + forks[0]["fact"] + forks[1]["fact"] + " Is that right? "
        s += sgl.select("verdict", choices=["yes", "no"])
        s += " Year:" + sgl.gen("year", max_tokens=6, temperature=0, regex=r" [12][0-9]{3}")
        s += sgl.assistant_end()

    results = {}
    for server in servers:
        backend = sgl.RuntimeEndpoint(server.url)
        states = program.run_batch([{"topic": "Paris"}, {"topic": "water"}], backend=backend)
        results[server.name] = [(st.text(), st["verdict"], st["year"]) for st in states]
        for _, verdict, year in results[server.name]:
            assert verdict in ("yes", "no") and re.fullmatch(r" [12][0-9]{3}", year), (verdict, year)
    memx, stock = servers
    assert results[memx.name] == results[stock.name]


def test_steady_decode_makes_no_map_call_on_the_request_path(servers):
    """The tick premaps the next decode steps' KV groups: a long decode maps nothing on the request
    path (every map it needed was made between iterations, counted as premap)."""
    memx, _ = servers

    def counters():
        el = memx.request("/memx/status")["schedulers"][0]["elastic_kv"]
        return el["decode_steps"], el["decode_map_calls"], el["map_calls"]["premap"]

    steps0, maps0, _ = counters()
    out = memx.generate("Write a long story about the sea.", max_new_tokens=600, temperature=0, ignore_eos=True)
    steps1, maps1, premap1 = counters()
    assert out["meta_info"]["completion_tokens"] == 600
    assert steps1 - steps0 >= 590  # one decode step per token after the first
    assert maps1 - maps0 == 0 and premap1 >= 2  # 600 tokens cross group boundaries: mapped ahead of time


def test_malformed_requests_to_memx_get_a_4xx_never_a_5xx(servers):
    """On the real server (upstream's app and middleware, memx's routes): wrong methods, unknown
    sub-paths, bad bodies and query strings. ``test/unit/test_memx_http.py`` fuzzes the same routes."""
    import urllib.error
    import urllib.request

    memx, _ = servers
    cases = [
        ("POST", "/memx/status", b"{not json", 405),
        ("PUT", "/memx/metrics", b"[]", 405),
        ("DELETE", "/memx/status", None, 405),
        ("GET", "/memx/nope", None, 404),
        ("GET", "/memx/status/x", None, 404),
        ("GET", "/memx/status?dp_rank=x&&=%ff", None, 200),
        ("GET", "/memx/status", b"\xff" * (1 << 20), 200),  # a 1 MiB body on a GET is ignored
    ]
    for method, path, body, want in cases:
        req = urllib.request.Request(memx.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                code = r.status
        except urllib.error.HTTPError as exc:
            code = exc.code
        assert code == want, (method, path, code)
