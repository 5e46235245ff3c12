"""Elastic KV (--memx-elastic-kv) against stock SGLang on the same prompts, greedy.

Servers on one tiny Llama (GQA): stock; memx elastic KV with a physical
budget far below its logical capacity (page size 1, 4 KiB chunks, so a group
is 32 float32 tokens and the budget holds a 16-token prefill's activations plus 23
groups); memx elastic KV with page size 4 and no budget; the tight server
plus a CPU elastic buffer ("parked"), and that plus Alg. 2 SLOs ("slo").
Outputs must be identical to stock through prefix-cache hits, chunked prefill,
retraction under memory pressure and prefills offloaded to the host buffer,
and the KV memory must go back to the pool when the requests are gone.
"""

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.greedy import flush_until_one_group_mapped
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
# float32: under retraction the batches differ from stock's, and a random tiny model's logits
# are so flat that bf16 rounding differences between batch shapes could flip an argmax.
COMMON = ["--chunked-prefill-size", "16", "--dtype", "float32"]
TIGHT_BUDGET_GB = "0.0004"  # 104 chunks of 4 KiB: a 16-token prefill's activation (12) + 23 KV groups of 32 tokens
SLO_TPOT_MS = 200
PROMPTS = ["The capital of France is", "Pages map to chunks", "one two three four five", "Elastic memory for serving"]


@pytest.fixture(scope="module")
def servers(tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)
    # the same stock server as test_tensor_parallel.py's (same model and arguments): started once a session
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-s5-f32", stock=True, max_total_tokens=4096, extra_args=COMMON)
    )
    tight = SGLangServer(
        model,
        name="ekv-tight",
        max_total_tokens=4096,
        extra_args=COMMON
        + [
            "--memx-elastic-kv",
            "--memx-chunk-kb",
            "4",
            "--memx-pool-budget-gb",
            TIGHT_BUDGET_GB,
            "--schedule-conservativeness",
            "0.05",
        ],
    )
    paged = SGLangServer(
        model,
        name="ekv-paged",
        max_total_tokens=4096,
        extra_args=COMMON + ["--memx-elastic-kv", "--memx-chunk-kb", "4", "--page-size", "4"],
    )
    # the tight server plus a CPU elastic buffer: retracted requests' KV waits on the host
    parked = SGLangServer(
        model,
        name="ekv-parked",
        max_total_tokens=4096,
        extra_args=COMMON
        + [
            "--memx-elastic-kv",
            "--memx-chunk-kb",
            "4",
            "--memx-pool-budget-gb",
            TIGHT_BUDGET_GB,
            "--schedule-conservativeness",
            "0.05",
            "--memx-host-buffer-gb",
            "0.01",
        ],
    )
    # ... with Alg. 2 sizing it: a TTFT SLO every request misses, a TPOT SLO (200 ms) the decode
    # steps meet (a few ms each) and a parked request meets unless it would wait for hundreds of them
    slo = SGLangServer(
        model,
        name="ekv-slo",
        max_total_tokens=4096,
        extra_args=COMMON
        + [
            "--memx-elastic-kv",
            "--memx-chunk-kb",
            "4",
            "--memx-pool-budget-gb",
            TIGHT_BUDGET_GB,
            "--memx-host-buffer-gb",
            "0.01",
            "--memx-ttft-slo-ms",
            "1",
            "--memx-tpot-slo-ms",
            str(SLO_TPOT_MS),
        ],
    )
    everyone = [stock, tight, paged, parked, slo]
    start_all(everyone)
    yield {"stock": stock, "tight": tight, "paged": paged, "parked": parked, "slo": slo}
    release_all(everyone)


def _gen(server, text, n=24, ignore_eos=True):
    return server.request(
        "/generate",
        {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": ignore_eos}},
    )


def _elastic(server):
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]


@pytest.mark.parametrize("name", ["tight", "paged"])
def test_greedy_batch_matches_stock(servers, name):
    want = [r["output_ids"] for r in _gen(servers["stock"], PROMPTS)]
    got = [r["output_ids"] for r in _gen(servers[name], PROMPTS)]
    assert got == want
    assert all(len(x) == 24 for x in got)


@pytest.mark.parametrize("name", ["tight", "paged"])
def test_prefix_cache_hits_match_stock(servers, name):
    prefix = " ".join(f"shared{i}" for i in range(40))
    texts = [prefix + " alpha", prefix + " beta"]
    want = [r["output_ids"] for r in _gen(servers["stock"], texts)]
    first = _gen(servers[name], texts[0])
    second = _gen(servers[name], texts[1])
    assert [first["output_ids"], second["output_ids"]] == want
    assert second["meta_info"]["cached_tokens"] > 0  # the prefix came from the radix cache


@pytest.mark.parametrize("name", ["tight", "paged"])
def test_chunked_prefill_matches_stock(servers, name):
    long_prompt = " ".join(f"w{i % 37}x{i}" for i in range(60))  # many 16-token chunks
    want = _gen(servers["stock"], long_prompt, 16)
    got = _gen(servers[name], long_prompt, 16)
    assert want["meta_info"]["prompt_tokens"] > 128
    assert got["output_ids"] == want["output_ids"]


def test_request_beyond_the_physical_budget_is_refused(servers):
    """A prompt that could never fit the tight server's physical budget gets upstream's length
    error at once instead of waiting forever; the server keeps serving."""
    huge = " ".join(f"w{i % 37}x{i}" for i in range(200))
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as err:
        _gen(servers["tight"], huge, 4)
    assert err.value.code == 400
    body = err.value.read().decode()
    assert "longer than" in body or "exceeds" in body or "too long" in body, body
    assert len(_gen(servers["tight"], PROMPTS[0], 4)["output_ids"]) == 4


@pytest.mark.parametrize("name", ["tight", "parked"])
def test_retraction_under_pressure_matches_stock(servers, name):
    """12 requests arriving together need ~4x the tight server's physical budget. Without ignore_eos
    upstream admits on an estimated output length (x --schedule-conservativeness 0.05) for the
    running requests, so it over-admits, runs out of physical KV while decoding and retracts
    (recomputes) requests; the answers must still be stock's and no request may be lost. (With
    64-token chunks the activation that ballooning gives back to KV after each admission was
    enough headroom that nothing was ever retracted; 16-token chunks keep it small.)"""
    texts = [f"request {i} " + " ".join(f"t{i}_{j}" for j in range(20)) for i in range(12)]
    want = [r["output_ids"] for r in _gen(servers["stock"], texts, 200, ignore_eos=False)]

    got = _gen(servers[name], texts, 200, ignore_eos=False)  # all 12 arrive at once
    assert [r["output_ids"] for r in got] == want
    retractions = sum(r["meta_info"].get("num_retractions", 0) for r in got)
    status = _elastic(servers[name])
    budget_groups = status["pool_capacity_bytes"] // status["group_bytes"]
    assert budget_groups <= 26  # the whole budget (832 tokens, activations included) is below the load
    assert retractions > 0, "the load should have forced retractions"
    assert status["groups_mapped_total"] > budget_groups  # groups were unmapped and mapped again
    host = status["host_buffer"]
    if name == "tight":
        assert host is None
        return
    # parked KV came back through the radix cache instead of being recomputed, nothing leaked
    assert host["parked"] > 0 and host["restored"] > 0, host
    assert host["parked"] == host["restored"] + host["dropped"] + host["requests"], host
    assert host["requests"] == 0 and host["used_bytes"] == 0, host
    assert host["restored_tokens"] > 0 and host["slo_scaling"] is None
    assert "memx_host_buffer_restored_total{" in servers[name].request_text("/memx/metrics")


def test_prefills_offload_to_the_host_buffer_when_decode_reservations_fill_memory(servers):
    """eLLM Alg. 1's CPU-buffer branch. Fixed-length requests (ignore_eos) make upstream reserve
    their whole max_new_tokens, so after ~3 of these 8 the parked server's admission refuses the
    rest (NO_TOKEN) while most of its memory is still physically free. With the host buffer those
    prefill anyway, stream their first token, wait on the host and resume from their fetched KV;
    the answers must be stock's and the buffer must end empty."""
    server = servers["parked"]
    texts = [f"offload {i} " + " ".join(f"o{i}_{j}" for j in range(20)) for i in range(8)]
    want = [r["output_ids"] for r in _gen(servers["stock"], texts, 100)]
    before = _elastic(server)["host_buffer"]
    got = _gen(server, texts, 100)  # all 8 arrive at once
    assert [r["output_ids"] for r in got] == want
    host = _elastic(server)["host_buffer"]
    offloaded = host["prefill_offloads"] - before["prefill_offloads"]
    assert offloaded > 0, host
    assert host["offload_parked"] - before["offload_parked"] == offloaded  # none finished on its first token
    assert host["fetched"] > before["fetched"] or host["restored"] - before["restored"] == offloaded
    # every parked request resumed from its KV, none recomputed: the ones a prefill batch admits together
    # were all fetched back before it (not only the first of them)
    assert host["restored"] - before["restored"] == host["parked"] - before["parked"] >= offloaded, (before, host)
    assert host["dropped"] == before["dropped"], (before, host)
    assert host["requests"] == host["used_bytes"] == host["pinned"] == host["offload_pending"] == 0, host
    assert host["parked"] == host["restored"] + host["dropped"], host
    assert sum(r["meta_info"].get("num_retractions", 0) for r in got) >= offloaded
    assert "memx_host_buffer_prefill_offloads_total{" in server.request_text("/memx/metrics")


def test_slo_rule_grows_the_host_buffer_on_ttft_misses(servers):
    """Alg. 2 in the real server: the buffer starts at one KV group (too small for one prompt's
    KV, so the first prefills cannot be offloaded); every first token misses the 1 ms TTFT SLO, so
    the logical size doubles after each 3 misses until prefills do offload. Same answers as stock."""
    server = servers["slo"]
    start = _elastic(server)["host_buffer"]["slo_scaling"]
    assert start["logical_units"] == 1 and start["ttft_events"] == start["tpot_events"] == 0
    texts = [f"slo {i} " + " ".join(f"s{i}_{j}" for j in range(20)) for i in range(10)]
    want = [r["output_ids"] for r in _gen(servers["stock"], texts, 100)]
    got = _gen(server, texts, 100)
    assert [r["output_ids"] for r in got] == want
    host = _elastic(server)["host_buffer"]
    scaling = host["slo_scaling"]
    assert scaling["ttft_events"] >= 2 and scaling["tpot_events"] == 0, scaling
    assert scaling["logical_units"] >= 4 and host["logical_bytes"] == scaling["logical_units"] * scaling["unit_bytes"]
    assert host["offload_no_room"] > 0  # refused while the buffer was small ...
    assert host["prefill_offloads"] > 0  # ... offloaded once it had grown
    assert host["requests"] == host["used_bytes"] == host["pinned"] == host["offload_pending"] == 0, host


def test_a_parking_that_would_put_its_own_tpot_over_the_slo_waits_instead(servers):
    """The governor's parking rule (``memory_ext.policy.park_tpot``) in the real server. Four long
    requests (300 tokens, reserved whole: ignore_eos) take the tight budget; the fourth and four
    short ones (2 tokens: one after the first) arrive behind them. Parked, a short one's token
    after the first would come only once a long one leaves room, up to ~300 decode steps of a few
    ms later: its predicted TPOT is over the 200 ms SLO, so it is not parked (``park_over_tpot``)
    and stock's admission decides; a long one parked would wait as long over 299 tokens, within
    it. Every answer is stock's and the buffer ends empty."""
    server = servers["slo"]
    for i in range(12):  # the buffer grows on TTFT misses (Alg. 2), the step model learns
        if _elastic(server)["host_buffer"]["slo_scaling"]["logical_units"] >= 4:
            break
        _gen(server, [f"grow {i} {j} " + " ".join(f"g{j}_{k}" for k in range(20)) for j in range(3)], 24)
    host_before = _elastic(server)["host_buffer"]
    assert host_before["slo_scaling"]["logical_units"] >= 4, host_before
    before = _elastic(server)["governor"]
    assert before["model"]["samples"] >= before["model"]["min_samples"], before
    texts = [f"long {i} " + " ".join(f"l{i}_{j}" for j in range(20)) for i in range(4)]
    texts += [f"short {i} " + " ".join(f"t{i}_{j}" for j in range(20)) for i in range(4)]
    lengths = [300] * 4 + [2] * 4
    payload = {"text": texts, "sampling_params": [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                                                  for n in lengths]}  # fmt: skip
    want = [r["output_ids"] for r in servers["stock"].request("/generate", payload)]
    got = [r["output_ids"] for r in server.request("/generate", payload)]
    assert got == want and [len(x) for x in got] == lengths
    gov = _elastic(server)["governor"]
    refused = gov["admission_verdicts"]["park_over_tpot"] - before["admission_verdicts"]["park_over_tpot"]
    print(f"verdicts {before['admission_verdicts']} -> {gov['admission_verdicts']}, "
          f"predicted TPOT {gov['predicted_tpot_ms']} ms, measured {gov['measured_tpot_ms']} ms")  # fmt: skip
    assert refused > 0, (before["admission_verdicts"], gov["admission_verdicts"])
    assert gov["predicted_tpot_ms"] < SLO_TPOT_MS  # a decode step meets the SLO: the rule, not infeasibility
    host = _elastic(server)["host_buffer"]
    assert host["prefill_offloads"] > host_before["prefill_offloads"], host  # a long one within it was parked
    assert host["requests"] == host["used_bytes"] == host["pinned"] == host["offload_pending"] == 0, host


@pytest.mark.parametrize("name", ["tight", "paged"])
def test_memory_returns_to_the_pool(servers, name):
    server = servers[name]
    _gen(server, [f"fill {i} " + "x " * 60 for i in range(6)], 40)
    busy = _elastic(server)
    assert busy["groups_mapped_total"] > 0 and busy["map_seconds"] > 0
    st = flush_until_one_group_mapped(server)
    assert st["groups_mapped"] == 1, st  # only group 0 (the padded page) stays mapped
    assert st["owners_bytes"]["kv"] == st["group_bytes"]
    assert st["groups_unmapped_total"] > 0


def test_activations_balloon_with_kv(servers):
    """The tight server's budget holds KV and activations (eLLM ballooning): prefills took
    activation chunks, KV later mapped into the idle ones, and both never exceeded the budget."""
    server = servers["tight"]
    _gen(server, [f"balloon {i} " + "y " * 50 for i in range(8)], 30)
    el = _elastic(server)
    act = el["activation"]
    # derived from the model's shapes, then measured on the first forwards (raised if they needed more)
    assert act["profile"]["per_token_bytes"] >= 4 * (2 * 64 + (2 * 4 + 2 * 2) * 16 + 3 * 128)
    assert act["profile"]["observations"] == len(act["measurements"]) >= 3
    assert all(0 < m["peak_bytes"] <= m["profile_bytes"] for m in act["measurements"]), act["measurements"]
    assert act["max_batch_tokens"] == 16
    assert act["allocator"] == {"kind": "torch"}  # CPU: accounting only, no arena (CUDA-only)
    assert act["peak_held"] >= act["peak_need"] > 0
    assert act["chunks_from_free"] + act["chunks_from_kv"] >= act["peak_held"]
    assert act["chunks_lent_to_kv"] > 0  # KV inflated into idle activation memory
    assert el["mapped_bytes"] + act["held_bytes"] <= el["pool_capacity_bytes"]
    assert "memx_activation_chunks_lent_to_kv_total{" in server.request_text("/memx/metrics")


def test_status_reports_physical_bytes(servers):
    st = servers["tight"].request("/memx/status")["schedulers"][0]
    pool, el = st["kv_pool"], st["elastic_kv"]
    assert st["features"]["elastic_kv"] is True
    assert pool["bytes"] == el["mapped_bytes"] <= el["pool_capacity_bytes"] < el["logical_bytes"]
    assert el["chunk_bytes"] == 4096 and el["group_tokens"] == 32
