"""memx features on the sliding-window family (Gemma2) in real SGLang on CPU, against stock (issue 28).

Upstream serves Gemma2 from one full-length ``MHATokenToKVPool`` (its window is a mask in
``torch_native``), the pool elastic KV backs. Two servers of the tiny Gemma2 (``tiny_families``,
float32: a random tiny model's logits are flat enough for bf16 rounding to flip an argmax between
batch shapes): stock, and memx with all three single-server features on at once: elastic KV under a
tight physical budget (4 KiB chunks, a group is 32 tokens), the host buffer, and remappable weights
(``static``, half the decoder layers streamed from the host copy on every forward; Gemma2's layers are
found without ``start_layer`` / ``end_layer``). Greedy outputs must equal stock's through a batch,
prefix-cache hits, chunked prefill, retraction under memory pressure (KV parked on the host and
restored) and prefills offloaded to the host buffer. The memx refusals of the other families
(Mellum's SWAKVPool, tensor parallel) are unit-tested (``test/unit/test_families_refusal.py``) and
their messages on real servers are in ``docs/models.md``.
"""

from __future__ import annotations

import pytest

from sglang_memx.models.tiny_families import TinyFamilySpec, tiny_family_model
from support.greedy import assert_batch_prefix_hits_and_chunked_prefill_match, greedy, output_ids
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SPEC = TinyFamilySpec(family="sliding_window")  # Gemma2ForCausalLM: 2 layers (sliding, full), window 8
COMMON = ["--chunked-prefill-size", "16", "--dtype", "float32"]
# 157 chunks of 4 KiB: the two decoder layers (0.3 MB, one of them streamed through one slot), a
# 16-token prefill's activation and ~17 KV groups of 32 tokens (512 B a token)
BUDGET_GB = "0.0006"
MEMX = ["--memx-elastic-kv", "--memx-chunk-kb", "4", "--memx-pool-budget-gb", BUDGET_GB,
        "--schedule-conservativeness", "0.05", "--memx-host-buffer-gb", "0.01",
        "--memx-weights", "static", "--memx-weights-streamed", "0.5"]  # fmt: skip


@pytest.fixture(scope="module")
def servers(tiny_model_root):
    model = tiny_family_model(SPEC, tiny_model_root)
    stock = SGLangServer(model, name="fam-gemma2-stock", stock=True, max_total_tokens=4096, extra_args=COMMON)
    memx = SGLangServer(model, name="fam-gemma2-memx", max_total_tokens=4096, extra_args=COMMON + MEMX)
    start_all([stock, memx])
    yield {"stock": stock, "memx": memx}
    release_all([stock, memx])


def _status(server) -> dict:
    return server.request("/memx/status")["schedulers"][0]


def test_memx_serves_gemma2_from_its_mha_pool_with_half_the_layers_streamed(servers):
    st = _status(servers["memx"])
    assert st["kv_pool"]["kind"] == "MHATokenToKVPool" and st["kv_pool"]["layers"] == 2
    assert st["features"]["elastic_kv"] and st["features"]["host_buffer"] and st["features"]["weights"]
    w = st["elastic_kv"]["weights"]
    assert (w["resident_layers"], w["streamed_layers"]) == (1, 1)


def test_batch_prefix_hits_and_chunked_prefill_match_stock(servers):
    stock, memx = servers["stock"], servers["memx"]
    # the 40-word shared prefix is longer than the window: the mask matters
    assert_batch_prefix_hits_and_chunked_prefill_match(stock, memx)
    w = _status(memx)["elastic_kv"]["weights"]
    assert w["fetches"] >= w["forwards"] - 1 > 0  # the streamed layer came back for every forward


def test_retraction_under_pressure_parks_kv_on_the_host_and_matches_stock(servers):
    """12 requests arriving together need several times the physical budget: upstream over-admits
    (conservativeness 0.05), runs out of physical KV while decoding and retracts; retracted KV waits
    in the host buffer and comes back through the radix cache. Answers are stock's."""
    stock, memx = servers["stock"], servers["memx"]
    texts = [f"request {i} " + " ".join(f"t{i}_{j}" for j in range(20)) for i in range(12)]
    want = output_ids(greedy(stock, texts, 200, ignore_eos=False))
    before = _status(memx)["elastic_kv"]
    got = greedy(memx, texts, 200, ignore_eos=False)
    assert output_ids(got) == want
    assert sum(r["meta_info"].get("num_retractions", 0) for r in got) > 0
    el = _status(memx)["elastic_kv"]
    # groups went back to the pool and were mapped again, never beyond the physical budget
    assert el["groups_unmapped_total"] > before["groups_unmapped_total"]
    assert el["groups_mapped_total"] > before["groups_mapped_total"]
    assert el["mapped_bytes"] <= el["pool_capacity_bytes"]
    host = el["host_buffer"]
    assert host["parked"] > before["host_buffer"]["parked"] and host["restored"] > 0, host
    assert host["requests"] == host["used_bytes"] == 0, host


def test_prefills_offload_to_the_host_buffer_and_match_stock(servers):
    stock, memx = servers["stock"], servers["memx"]
    texts = [f"offload {i} " + " ".join(f"o{i}_{j}" for j in range(20)) for i in range(8)]
    want = output_ids(greedy(stock, texts, 100))
    before = _status(memx)["elastic_kv"]["host_buffer"]
    assert output_ids(greedy(memx, texts, 100)) == want
    host = _status(memx)["elastic_kv"]["host_buffer"]
    assert host["prefill_offloads"] > before["prefill_offloads"], host
    assert host["requests"] == host["used_bytes"] == host["pinned"] == host["offload_pending"] == 0, host
