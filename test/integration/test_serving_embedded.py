"""The embedded SmolLM2-135M-Instruct through real SGLang on CPU, memx vs stock.

This is what `scripts/serve.sh` serves; the chat answer is checked for
content, and greedy outputs must be identical with the plugin filtered out.
"""

import pytest

from sglang_memx.models.embedded import prepare_embedded_model
from support.server import SGLangServer, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

NAME = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def servers():
    model = prepare_embedded_model()
    extra = ["--served-model-name", NAME]
    memx = SGLangServer(model, name="smollm2-memx", max_total_tokens=8192, extra_args=extra)
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
    pool = memx.request("/memx/status")["schedulers"][0]["kv_pool"]
    assert pool["capacity_tokens"] == 8192 and pool["layers"] == 30
    # SmolLM2-135M: 30 layers, 3 KV heads x 64 dims, K and V, bf16.
    assert pool["bytes"] >= 8192 * 30 * 2 * 3 * 64 * 2
    assert pool["used_tokens"] + pool["available_tokens"] + pool["evictable_tokens"] == 8192
