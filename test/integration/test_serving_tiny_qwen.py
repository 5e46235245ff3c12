"""Qwen3 (MHA, q/k norms) and Qwen2 (GQA, qkv bias) tiny models: memx vs stock greedy,
with a custom status path."""

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SPECS = {
    "qwen3-mha": TinyModelSpec(arch="qwen3", num_layers=3, num_heads=4, num_kv_heads=4, head_dim=32, seed=1),
    "qwen2-gqa": TinyModelSpec(arch="qwen2", num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, seed=2),
}
PROMPTS = ["The capital of France is", "Pages map to chunks", "one two three four"]


@pytest.fixture(scope="module")
def all_servers(tiny_model_root):
    """Both models' memx and stock servers, started together (four starts share the cores)."""
    pairs = {}
    for name, spec in sorted(SPECS.items()):
        model = tiny_model(spec, tiny_model_root)
        memx = SGLangServer(model, name=f"{name}-memx", max_total_tokens=2048,
                            extra_args=["--memx-status-path", "/ops/memx"])  # fmt: skip
        pairs[name] = (memx, SGLangServer(model, name=f"{name}-stock", stock=True, max_total_tokens=2048))
    everyone = [server for pair in pairs.values() for server in pair]
    start_all(everyone)
    yield pairs
    release_all(everyone)


@pytest.fixture(params=sorted(SPECS))
def servers(request, all_servers):
    memx, stock = all_servers[request.param]
    return request.param, memx, stock


def test_greedy_matches_stock(servers):
    _, memx, stock = servers
    a = memx.request("/generate", {"text": PROMPTS, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    b = stock.request("/generate", {"text": PROMPTS, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert all(len(x["output_ids"]) == 16 for x in a)


def test_custom_status_path(servers):
    name, memx, _ = servers
    pool = memx.request("/ops/memx")["schedulers"][0]["kv_pool"]
    spec = SPECS[name]
    assert pool["layers"] == spec.num_layers and pool["capacity_tokens"] == 2048
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
    assert pool["bytes"] >= 2048 * per_token
