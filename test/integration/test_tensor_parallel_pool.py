"""A tensor parallel server on a shared pool (``--tp 2 --memx-pool``) beside another server, in real
SGLang on CPU, against stock (issue 28 item 4: the arbiter accounting per rank).

Each rank of the ``--tp 2`` server is a client of the pool's arbiter with its own pool
(``LockstepLentPool``): the arbiter books every rank's chunks. The ranks borrow only in the tick's
"give back, borrow" step and then agree (``coordinator.rank_pools``: one all-reduce of FREE and of
the pending reclaim a tick; every rank sheds what the smallest lacks; every rank frees the largest
ask), so what upstream's schedulers read stays equal (checked every busy iteration).

The second server (``--tp 1``) shares the budget. Memory must move both ways: the tensor parallel
server's burst borrows well beyond its first group; idle, its cached prefixes are reclaimed for the
other server's burst (the ranks free the same prefixes, or their next prefix match would differ and
the check would stop the server); then it serves again. Every answer is stock's (``--tp 1``, the
shared "stock-llama-s5-f32" server: on this float32 model the ranks' partial sums give its argmax).
"""

from __future__ import annotations

import os

import pytest

from memory_ext.pool.arbiter_client import query_arbiter_status
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.greedy import (
    assert_batch_prefix_hits_and_chunked_prefill_match,
    elastic_status,
    flush_until_one_group_mapped,
    greedy,
    output_ids,
)
from support.server import TP2_ENV, SGLangServer, release_with_pool, start_all
from support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
COMMON = ["--chunked-prefill-size", "16", "--dtype", "float32"]  # as the shared stock server's
# 858993 B -> 209 chunks of 4 KiB for the device: per rank of the --tp 2 server a 64-token KV group is
# 4 chunks (one KV head), a 16-token prefill's activation 12; the --tp 1 server's group is 8 chunks
BUDGET_GB = "0.0008"
BUDGET_CHUNKS = 209


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)
    pool_dir = tmp_path_factory.mktemp("pools")
    name = f"tp{os.getpid()}"
    args = COMMON + ["--memx-elastic-kv", "--memx-pool", name, "--memx-pool-budget-gb", BUDGET_GB,
                     "--memx-pool-dir", str(pool_dir), "--memx-chunk-kb", "4"]  # fmt: skip
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-s5-f32", stock=True, max_total_tokens=4096, extra_args=COMMON)
    )
    tp2 = SGLangServer(model, name="pool-tp2", max_total_tokens=4096, env=TP2_ENV, extra_args=args + ["--tp", "2"])
    tp1 = SGLangServer(model, name="pool-tp1", max_total_tokens=4096, extra_args=args)
    start_all([stock, tp2, tp1])
    yield {"stock": stock, "tp2": tp2, "tp1": tp1, "sock": pool_dir / f"{name}.sock"}
    release_with_pool([tp2, tp1], name, pool_dir)


def _pid(server) -> int:
    return server.request("/memx/status")["schedulers"][0]["pid"]


def _held(pool) -> dict[str, object]:
    """Chunks the arbiter books: the --tp 1 server's, rank 0's and rank 1's of the --tp 2 server."""
    st = query_arbiter_status(pool["sock"])
    clients = {c["pid"]: c["held"] for c in st["clients"] if c["name"].startswith("sglang-")}
    tp1, rank0 = clients.pop(_pid(pool["tp1"])), clients.pop(_pid(pool["tp2"]))
    (rank1,) = clients.values()  # the one other client: the --tp 2 server's second rank
    return {"tp1": tp1, "rank0": rank0, "rank1": rank1, "total": sum(c["held"] for c in st["clients"]), "st": st}


def test_every_rank_is_a_client_of_the_arbiter_and_the_ranks_even_their_pools(pool):
    held = _held(pool)
    assert held["st"]["budget"] == BUDGET_CHUNKS and held["total"] <= BUDGET_CHUNKS
    el = elastic_status(pool["tp2"])
    assert "even the ranks' pools" in [s["step"] for s in el["coordinator"]["iteration_order"]]
    # a lockstep pool borrows in the tick only: no urgent borrow where upstream allocates
    assert "borrow from the shared pool" not in [s["source"] for s in el["coordinator"]["short_allocation_order"]]
    assert el["tensor_parallel_pool"]["evened"] > 0 and el["tensor_parallel"]["size"] == 2


def test_batch_prefix_hits_and_chunked_prefill_match_stock(pool):
    before = elastic_status(pool["tp2"])
    assert_batch_prefix_hits_and_chunked_prefill_match(pool["stock"], pool["tp2"])
    el = elastic_status(pool["tp2"])
    assert el["tensor_parallel"]["checks"] > before["tensor_parallel"]["checks"] + 24
    assert el["shared_pool"]["borrowed_total"] > before["shared_pool"]["borrowed_total"]


def test_memory_flows_between_the_tensor_parallel_server_and_its_neighbour(pool):
    stock, tp2, tp1 = pool["stock"], pool["tp2"], pool["tp1"]
    texts = [f"load {i} " + " ".join(f"q{i}_{j}" for j in range(30)) for i in range(6)]
    want = output_ids(greedy(stock, texts, 80))
    assert output_ids(greedy(tp2, texts, 80)) == want  # 6 x ~115 tokens: beyond the first groups
    held = _held(pool)
    assert min(held["rank0"], held["rank1"]) > 4 * 4, held  # both ranks borrowed well beyond their group 0
    before = elastic_status(tp2)
    # the --tp 2 server idles with its KV in its prefix cache; the neighbour needs most of the budget
    assert output_ids(greedy(tp1, texts, 80)) == want
    el = elastic_status(tp2)
    pools = el["tensor_parallel_pool"]
    assert pools["reclaims_agreed"] > before["tensor_parallel_pool"]["reclaims_agreed"], pools
    assert el["tensor_parallel"]["checks"] == before["tensor_parallel"]["checks"]  # idle: nothing to check
    # the ranks freed the same prefixes: serving again, their batches agree and the answers are stock's
    assert output_ids(greedy(tp2, texts, 80)) == want
    assert elastic_status(tp2)["tensor_parallel"]["checks"] > el["tensor_parallel"]["checks"]
    assert _held(pool)["total"] <= BUDGET_CHUNKS


def test_the_arbiter_books_the_same_chunks_for_both_ranks_once_idle(pool):
    """Flushed and idle, the ranks give back what they do not use (group 0 stays), and each keeps what
    the other keeps: a surplus one rank shed waits warm and goes back when its hold ends."""
    pool["tp1"].flush_cache()
    el = flush_until_one_group_mapped(pool["tp2"])
    assert el["groups_mapped"] == 1  # rank 0's; rank 1's shows in what the arbiter books for it, below

    def even_and_small() -> bool:
        h = _held(pool)
        return h["rank0"] == h["rank1"] <= 4 + 12  # group 0 and at most a prefill's activation

    wait_until(even_and_small, timeout=30.0, what=f"both ranks back to group 0: {_held(pool)}", interval=0.3)
    assert _held(pool)["total"] <= BUDGET_CHUNKS
