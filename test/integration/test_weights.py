"""Remappable weights (``--memx-weights``) in real SGLang on CPU, against stock.

A tiny 8-layer Llama (float32: a random tiny model's logits are flat enough for bf16
rounding to flip an argmax between batch shapes). A static server streams every decoder layer
from the host copy on every forward, the remap server (before any pressure) none; greedy
outputs must equal stock's, through prefix-cache hits and chunked prefill. (Streaming a part
of the layers in a real server is test_families.py's: one of Gemma2's two layers through one
slot; the interval's choice of layers and slots is unit-tested in test_interval_manager.py.)
A remap server's budget holds the
weights and only a few KV groups: a request whose KV does not fit beside the full weights
makes the controller release layers, is admitted, answers as stock does, and once the
pressure is gone the layers are restored.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SPEC = TinyModelSpec(arch="llama", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                     intermediate_size=512, seed=7)  # fmt: skip
COMMON = ["--chunked-prefill-size", "64", "--dtype", "float32"]
MEMX = ["--memx-elastic-kv", "--memx-chunk-kb", "16"]
# 8 layers x 2.36 MB of weights, KV 8 KiB per token: 0.0235 GB leaves ~4.5 MB (~550 tokens) of KV
TIGHT_GB = "0.0235"
PROMPTS = ["The capital of France is", "one two three four five six", "Pages map to chunks when the pool"]
LONG = " ".join(["memory layer weight pool server request answer"] * 20)  # > 64 tokens: chunked prefill


@pytest.fixture(scope="module")
def servers(tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)

    def memx(name, *extra, budget="0.1"):
        return SGLangServer(model, name=name, max_total_tokens=4096,
                            extra_args=COMMON + MEMX + ["--memx-pool-budget-gb", budget, *extra])  # fmt: skip

    everyone = {
        # the same stock server as test_weights_colocated.py's: started once a session
        "stock": shared_servers.get(
            SGLangServer(model, name="stock-llama-l8-s7-f32", stock=True, max_total_tokens=4096, extra_args=COMMON)
        ),
        "s100": memx(
            "w-static100", "--memx-weights", "static", "--memx-weights-streamed", "1", "--memx-prefetch-depth", "1"
        ),  # fmt: skip
        # the governor without an SLO (the weights lend as Oneiros does); the last test gives it one
        # at run time (POST /memx/slo)
        "remap": memx(
            "w-remap",
            "--memx-weights",
            "remap",
            "--memx-weights-idle-after-s",
            "600",
            "--memx-governor",
            budget=TIGHT_GB,
        ),  # fmt: skip
    }
    start_all(list(everyone.values()))
    yield everyone
    release_all(everyone.values())


def _gen(server, text, n=16):
    return server.generate(text, max_new_tokens=n, temperature=0, ignore_eos=True)


def _weights(server) -> dict:
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["weights"]


@pytest.mark.parametrize("name,streamed", [("remap", 0), ("s100", 8)])  # remap: no pressure yet
def test_static_streaming_answers_as_stock(servers, name, streamed):
    stock, server = servers["stock"], servers[name]
    for prompt in PROMPTS + [LONG]:
        assert _gen(server, prompt)["output_ids"] == _gen(stock, prompt)["output_ids"], prompt
    again = _gen(server, LONG)  # prefix-cache hit over a chunked prompt
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == _gen(stock, LONG)["output_ids"]
    w = _weights(server)
    assert w["streamed_layers"] == streamed and w["resident_layers"] == 8 - streamed
    if streamed:
        slots = w["slots"]
        assert w["lent_bytes"] == (streamed - slots) * w["held_bytes"] // (8 - streamed + slots)
        assert w["fetches"] >= streamed * w["forwards"] - slots  # every streamed layer came back for each forward
        assert w["hidden_fraction"] is not None and w["unfetched_waits"] == 0
    else:
        assert w["fetches"] == 0 and w["lent_bytes"] == 0


def test_batched_requests_while_streaming_match_stock(servers):
    stock, server = servers["stock"], servers["s100"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _gen(server, p, 24)["output_ids"], PROMPTS + [LONG]))
    assert got == [_gen(stock, p, 24)["output_ids"] for p in PROMPTS + [LONG]]


def test_online_weight_updates_are_refused_and_the_server_keeps_serving(servers):
    stock, server = servers["stock"], servers["s100"]
    try:
        out = server.request("/update_weights_from_disk", {"model_path": server.model_path})
    except urllib.error.HTTPError as exc:  # upstream answers a failed update with 400 and the message
        out = json.load(exc)
    assert out["success"] is False and "--memx-weights" in out["message"], out
    assert _gen(server, PROMPTS[0])["output_ids"] == _gen(stock, PROMPTS[0])["output_ids"]


def _wait(server, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = _weights(server)
        if predicate(w):
            return w
        time.sleep(0.5)
    raise AssertionError(f"timed out; weights status: {w}")


def test_pressure_releases_layers_and_relief_restores_them(servers):
    stock, remap = servers["stock"], servers["remap"]
    status = remap.request("/memx/status")["schedulers"][0]["elastic_kv"]
    w = status["weights"]
    assert w["lent_layers"] == 0 and w["streamed_layers"] == 0  # no pressure yet: every layer resident
    kv_room_tokens = (
        (int(float(TIGHT_GB) * (1 << 30)) - w["held_bytes"]) // status["group_bytes"] * status["group_tokens"]
    )
    prompt = " ".join(["one two three four five six seven eight"] * 60)  # ~480 tokens
    n_new = 200
    # 3 requests of ~680 tokens each need ~4x the KV room left beside the full weights
    assert 3 * (480 + n_new) > 2 * kv_room_tokens
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_gen, remap, prompt + f" {i}", n_new) for i in range(3)]
        lent = _wait(remap, lambda w: w["lent_layers"] > 0, timeout=120)
        outs = [f.result(timeout=600)["output_ids"] for f in futures]
    assert lent["decisions"]["remap"] >= 1
    assert outs == [_gen(stock, prompt + f" {i}", n_new)["output_ids"] for i in range(3)]
    peak = remap.request("/memx/status")["schedulers"][0]["elastic_kv"]
    assert peak["weights"]["decisions"]["remap"] >= 1
    # relief: nothing waits, the lent memory empties, layers come back one by one
    restored = _wait(remap, lambda w: w["lent_layers"] == 0 and w["streamed_layers"] == 0, timeout=120)
    assert restored["decisions"]["restore"] >= 1 and restored["restores"] >= 1
    assert _gen(remap, PROMPTS[0])["output_ids"] == _gen(stock, PROMPTS[0])["output_ids"]


def test_a_tpot_slo_no_step_meets_lends_only_to_a_starved_head(servers):
    """Under the governor's TPOT SLO (no TBT SLO given) the step budget is the TPOT SLO, here set at run
    time (``POST /memx/slo``, tighter than any decode step); on this CPU the copies would add to a
    step already over it, so requests that fit beside the full weights one at a time run that way,
    every layer resident (without the SLO this server lends for such a load). A request that fits
    only with layers lent, with nothing running, would otherwise wait for ever: for it the
    controller lends as without an SLO. Answers are stock's throughout."""
    stock, remap = servers["stock"], servers["remap"]
    before = _wait(remap, lambda w: w["lent_layers"] == 0 and w["streamed_layers"] == 0, timeout=120)
    assert before["tbt_slo_s"] is None  # --memx-governor alone: no step SLO
    assert remap.request("/memx/slo", {"tpot_slo_ms": 0.01}) == {"tpot_slo_ms": 0.01, "source": "POST /memx/slo"}
    small = " ".join(["one two three four five six seven eight"] * 25)  # ~200 tokens + 100 new: one fits
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_gen, remap, small + f" {i}", 100) for i in range(3)]
        outs = [f.result(timeout=600)["output_ids"] for f in futures]
    w = _weights(remap)
    assert (w["tbt_slo_s"], w["tbt_slo_source"], w["copies_share_compute"]) == (1e-5, "POST /memx/slo", True)
    assert w["decode_step_s"] is not None and w["decode_step_s"] > 1e-5  # measured: every step is over it
    assert w["lent_layers"] == 0 and w["streamed_layers"] == 0
    assert w["decisions"]["remap"] == before["decisions"]["remap"]  # no layer released for this load
    assert outs == [_gen(stock, small + f" {i}", 100)["output_ids"] for i in range(3)]
    big = " ".join(["one two three four five six seven eight"] * 60)  # ~480 + 200: needs layers lent
    try:
        got = _gen(remap, big, 200)["output_ids"]
    except TimeoutError:  # the head waited: say why (the controller's last reason and timings)
        raise AssertionError(f"the starved head was not served; weights status: {_weights(remap)}") from None
    assert got == _gen(stock, big, 200)["output_ids"]
    assert _weights(remap)["decisions"]["remap"] > before["decisions"]["remap"]
