"""Elastic KV at tensor parallel size 2 in real SGLang on CPU, against stock (issue 28 item 4).

Upstream's CPU engine runs ``--tp 2`` with a core per rank and gloo for the all-reduce
(``SGLANG_CPU_OMP_THREADS_BIND=0|1``, and an NCCL library that fails to load so that upstream's
PyNccl stays off: docs/models.md, "Tensor parallel 2 runs, with two settings"). memx gives every
rank its own elastic pool under the same physical budget, KV and activations ballooning in it; the
activation peak measured on a forward is agreed (the largest rank's), so what upstream's schedulers
read is the same on both ranks, and memx checks it every busy iteration (``coordinator.rank_agreement``:
an all-reduce of the available size; a disagreement stops the server instead of hanging it).

The memx server (tiny Llama, float32, budget far below the logical size, the host buffer with both SLOs,
and with them the governor) must give the greedy outputs
of the stock server at ``--tp 1`` that ``test_elastic_kv.py`` uses (the same model and arguments:
shared once a session; on this model the two tensor parallel ranks' partial sums give the same
argmax) through a batch, prefix-cache hits, chunked prefill, retraction under memory pressure (KV
parked on the host and restored) and prefills offloaded to the host buffer, and give its KV memory
back when the cache is flushed. A second memx server (an 8-layer Llama) keeps its decoder layers in a
pool shared through an arbiter and releases and restores them on both ranks in step.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.greedy import (
    PROMPTS,
    assert_batch_prefix_hits_and_chunked_prefill_match,
    elastic_status,
    flush_until_one_group_mapped,
    greedy,
    output_ids,
)
from support.server import TP2_ENV, SGLangServer, release_all, release_with_pool, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
COMMON = ["--chunked-prefill-size", "16", "--dtype", "float32"]  # as test_elastic_kv.py's stock server
# per rank: 104 chunks of 4 KiB: a 16-token prefill's activation (12) and 23 KV groups of 64 tokens
BUDGET_GB = "0.0004"
# the host buffer with eLLM Alg. 2 sizing it (both SLOs): its samples are timed with rank 0's clock
HOST_BUFFER = ["--memx-host-buffer-gb", "0.01", "--memx-ttft-slo-ms", "1000", "--memx-tpot-slo-ms", "1000"]


# test_weights.py's 8-layer Llama and stock server; per rank 9.1 MiB of layers, 256 KiB KV groups of 64 tokens
WEIGHTS_SPEC = TinyModelSpec(arch="llama", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                             intermediate_size=512, seed=7)  # fmt: skip
WEIGHTS_COMMON = ["--chunked-prefill-size", "64", "--dtype", "float32"]
# on a shared pool (every rank a client of its arbiter): per rank the layers and ~11 KV groups (~700 tokens)
WEIGHTS_POOL_BUDGET_GB = "0.0236"
# the governor at --tp 2, with an SLO every step meets: its clock is rank 0's on both ranks, every tick
LOOSE_TPOT_MS = "100000"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_root, shared_servers):
    model, weights_model = tiny_model(SPEC, tiny_model_root), tiny_model(WEIGHTS_SPEC, tiny_model_root)
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-s5-f32", stock=True, max_total_tokens=4096, extra_args=COMMON)
    )
    stock8 = shared_servers.get(SGLangServer(weights_model, name="stock-llama-l8-s7-f32", stock=True,
                                             max_total_tokens=4096, extra_args=WEIGHTS_COMMON))  # fmt: skip
    memx = SGLangServer(
        model, name="ekv-tp2", max_total_tokens=4096, env=TP2_ENV,
        extra_args=COMMON + ["--tp", "2", "--memx-elastic-kv", "--memx-chunk-kb", "4", "--memx-pool-budget-gb",
                             BUDGET_GB, "--schedule-conservativeness", "0.05", *HOST_BUFFER],
    )  # fmt: skip
    pool_dir, pool_name = tmp_path_factory.mktemp("pools"), f"wtp{os.getpid()}"
    remap = SGLangServer(
        weights_model, name="w-remap-tp2", max_total_tokens=4096, env=TP2_ENV,
        extra_args=WEIGHTS_COMMON + ["--tp", "2", "--memx-elastic-kv", "--memx-chunk-kb", "16",
                                     "--memx-pool", pool_name, "--memx-pool-dir", str(pool_dir),
                                     "--memx-pool-budget-gb", WEIGHTS_POOL_BUDGET_GB, "--memx-weights", "remap",
                                     "--memx-weights-idle-after-s", "600", "--memx-tpot-slo-ms", LOOSE_TPOT_MS],
    )  # fmt: skip
    start_all([stock, stock8, memx, remap])
    yield {"stock": stock, "memx": memx, "stock8": stock8, "remap": remap}
    release_all([memx])
    release_with_pool([remap], pool_name, pool_dir)


def test_each_rank_balloons_kv_and_activations_in_its_own_pool_with_agreed_peaks(servers):
    status = servers["memx"].request("/memx/status")["schedulers"][0]
    assert status["kv_pool"]["kind"] == "MHATokenToKVPool" and status["features"]["elastic_kv"]
    el = status["elastic_kv"]
    tp = el["tensor_parallel"]
    assert tp["size"] == 2
    assert el["pool_capacity_bytes"] == 104 * 4096 and el["group_tokens"] == 64  # one KV head a rank
    assert "agree across ranks" in [s["step"] for s in el["coordinator"]["iteration_order"]]
    act = el["activation"]  # measured on the first forwards (the warm-up's among them), agreed by the ranks
    assert act["allocator"]["kind"] == "torch"
    assert act["profile"]["observations"] == len(act["measurements"]) == tp["peaks_agreed"] >= 1


def test_batch_prefix_hits_and_chunked_prefill_match_stock(servers):
    stock, memx = servers["stock"], servers["memx"]
    before = elastic_status(memx)["tensor_parallel"]["checks"]
    assert_batch_prefix_hits_and_chunked_prefill_match(stock, memx)
    assert elastic_status(memx)["tensor_parallel"]["checks"] > before + 24  # every busy iteration was checked


def test_retraction_under_pressure_matches_stock_and_the_ranks_agree(servers):
    """24 requests arriving together need several times each rank's physical budget: upstream
    over-admits (conservativeness 0.05), both ranks run out of physical KV in the same decode step
    and retract the same requests; the answers are stock's."""
    stock, memx = servers["stock"], servers["memx"]
    texts = [f"request {i} " + " ".join(f"t{i}_{j}" for j in range(20)) for i in range(24)]
    want = output_ids(greedy(stock, texts, 200, ignore_eos=False))
    before = elastic_status(memx)
    got = greedy(memx, texts, 200, ignore_eos=False)
    assert output_ids(got) == want
    assert sum(r["meta_info"].get("num_retractions", 0) for r in got) > 0
    el = elastic_status(memx)
    assert el["groups_mapped_total"] > before["groups_mapped_total"]
    assert el["mapped_bytes"] <= el["pool_capacity_bytes"]
    assert el["tensor_parallel"]["checks"] > before["tensor_parallel"]["checks"] + 200
    host = el["host_buffer"]  # retracted KV waited on the host of every rank and came back
    assert host["parked"] > before["host_buffer"]["parked"] and host["restored"] > 0, host
    assert host["requests"] == host["used_bytes"] == 0, host


def test_prefills_offload_to_the_host_buffer_and_match_stock(servers):
    """Prefills offloaded to the host buffer when the decode reservations fill the device (eLLM's
    admission, Alg. 2 sizing the buffer from samples timed with rank 0's clock): stock's answers."""
    stock, memx = servers["stock"], servers["memx"]
    texts = [f"offload {i} " + " ".join(f"o{i}_{j}" for j in range(20)) for i in range(8)]
    want = output_ids(greedy(stock, texts, 100))
    before = elastic_status(memx)
    assert output_ids(greedy(memx, texts, 100)) == want
    el = elastic_status(memx)
    host = el["host_buffer"]
    assert host["prefill_offloads"] > before["host_buffer"]["prefill_offloads"], host
    assert host["requests"] == host["used_bytes"] == host["pinned"] == host["offload_pending"] == 0, host
    # every tick reads rank 0's clock once (for Alg. 2 and the governor's measure); a busy tick checks once
    tp, tp0 = el["tensor_parallel"], before["tensor_parallel"]
    assert tp["broadcasts_from_rank0"] - tp0["broadcasts_from_rank0"] >= tp["checks"] - tp0["checks"] > 0


def test_memory_returns_to_the_pool(servers):
    server = servers["memx"]
    greedy(server, [f"fill {i} " + "x " * 60 for i in range(6)], 40)
    st = flush_until_one_group_mapped(server)
    assert st["groups_mapped"] == 1, st  # only group 0 (the padded page) stays mapped
    greedy(server, PROMPTS[0], 4)  # a busy iteration: the ranks' check reads every rank's mapped groups
    tp = elastic_status(server)["tensor_parallel"]
    assert tp["groups_mapped_min"] >= 1 and tp["groups_mapped_max"] == tp["groups_mapped_min"], tp
    assert st["groups_unmapped_total"] > 0


def _wait_weights(server, predicate, timeout: float) -> dict:
    deadline = time.time() + timeout
    while True:
        w = elastic_status(server)["weights"]
        if predicate(w) or time.time() > deadline:
            return w
        time.sleep(0.3)


def test_remappable_weights_release_and_restore_on_every_rank_in_step(servers):
    """The 8-layer model at --tp 2 with every rank's layers in the device's shared pool (each rank a
    client of its arbiter): 3 requests need about twice the KV room left beside the full layers and
    more than the arbiter can lend both ranks (a refusal on every rank), so the Oneiros controller
    releases layers (on a shared pool only after a refusal; the three ran one by one before); its
    inputs include timings each rank measures alone, so
    every rank applies rank 0's decision (one broadcast a step) and both ranks release and later
    restore the same layers in the same iteration (else the agreement check would stop the server).
    Idle, the ranks give their spare chunks back to the arbiter; a restore then borrows them in the
    ranks' tick ("give back, borrow", evened right after). Answers are stock's at --tp 1 throughout."""
    stock, remap = servers["stock8"], servers["remap"]
    status = elastic_status(remap)
    w = status["weights"]
    assert w["mode"] == "remap" and w["lent_layers"] == 0 and w["streamed_layers"] == 0
    assert status["tensor_parallel_pool"]["evened"] > 0  # the shared pool's agreement runs
    ranks = status["tensor_parallel"]["size"]  # the pool's capacity is the device's budget, for both ranks
    room = (status["pool_capacity_bytes"] - ranks * w["held_bytes"]) // ranks
    kv_room = room // status["group_bytes"] * status["group_tokens"]
    prompt = " ".join(["one two three four five six seven eight"] * 60)  # ~480 tokens
    assert 3 * (480 + 200) > 2 * kv_room
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(greedy, remap, prompt + f" {i}", 200) for i in range(3)]
        lent = _wait_weights(remap, lambda w: w["lent_layers"] > 0, timeout=120)
        outs = [f.result(timeout=600)["output_ids"] for f in futures]
    assert lent["lent_layers"] > 0, lent
    # the arbiter could not fund both ranks' asks: a refusal on every rank, so rank 0 released layers
    assert elastic_status(remap)["tensor_parallel_pool"]["short_ticks"] >= 1
    assert outs == [greedy(stock, prompt + f" {i}", 200)["output_ids"] for i in range(3)]
    restored = _wait_weights(remap, lambda w: w["lent_layers"] == 0 and w["streamed_layers"] == 0, timeout=120)
    assert restored["lent_layers"] == 0 and restored["decisions"]["restore"] >= 1, restored
    assert restored["restore_asks"] >= 1, restored  # a restore waited for the ranks' borrow
    status = elastic_status(remap)
    tp, gov = status["tensor_parallel"], status["governor"]
    # one broadcast a tick for the governor's clock, one an Oneiros step
    assert tp["broadcasts_from_rank0"] > tp["checks"] > 100
    assert restored["decisions"]["remap"] + restored["decisions"]["restore"] > 1
    assert gov["tpot_slo_ms"] == float(LOOSE_TPOT_MS) and gov["decisions"]["over_slo"] == 0
    assert gov["measured_tpot_ms"] is not None and gov["max_running_seen"] >= 2, gov  # steps measured
    assert greedy(remap, PROMPTS[0])["output_ids"] == greedy(stock, PROMPTS[0])["output_ids"]


def test_an_slo_set_at_run_time_reaches_the_ranks_which_go_on_in_step(servers):
    """``POST /memx/slo`` at --tp 2: upstream hands the request to every rank in the same iteration;
    the status names the new SLO and its source, and the ranks keep serving stock's answers in step
    (a rank left on the old SLO would decide another batch: the agreement check would stop the server)."""
    stock, remap = servers["stock8"], servers["remap"]
    before = elastic_status(remap)["tensor_parallel"]["checks"]
    answer = remap.request("/memx/slo", {"tpot_slo_ms": 50000})
    assert answer == {"tpot_slo_ms": 50000.0, "source": "POST /memx/slo"}
    gov = elastic_status(remap)["governor"]
    assert gov["slos"]["tpot"] == {"ms": 50000.0, "source": "POST /memx/slo"}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: greedy(remap, p)["output_ids"], PROMPTS))
    assert outs == [greedy(stock, p)["output_ids"] for p in PROMPTS]
    assert elastic_status(remap)["tensor_parallel"]["checks"] > before
