"""The layer stream cache (SwiftCache W2, docs/peer-kv.md) in real SGLang servers on CPU: a donor, a
borrower with ``--memx-peer-layer-stream`` and the same ``--max-total-tokens`` (local KV budget) a
stock server would run with, and a stock server with enough memory as the reference.

Checked: the borrower's pool holds several times the stock token count for the same local budget
(``max_total_num_tokens``, status ``layer_stream``); a prompt 2.5x longer than that budget runs and its
greedy output equals the big stock server's; after a SIGKILL of the donor, a request gets the named
error (never a wrong answer), the borrower stays up, and the pool's books balance.
"""

import json
import os
import random
import signal
import time
import urllib.error

import pytest

from memory_ext.pool.arbiter_client import query_arbiter_status
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_with_pool, start_all

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1200),
]

# 8 layers: the layer split can reach L / (resident + staging) = 8x the stock tokens
SPEC = TinyModelSpec(arch="llama", num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=16384, seed=5)  # fmt: skip
COMMON = ["--dtype", "float32", "--chunked-prefill-size", "256"]
LOCAL_TOKENS = 1024  # the borrower's (and a same-memory stock server's) --max-total-tokens
PROMPT = 2560  # 2.5x the local budget: no stock server with that budget can hold it
NEW = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_root):
    model = tiny_model(SPEC, tiny_model_root)
    pool_dir = tmp_path_factory.mktemp("pools")
    name = f"lsc{os.getpid()}"
    pool = ["--memx-elastic-kv", "--memx-pool", name, "--memx-pool-budget-gb", "0.08", "--memx-pool-dir",
            str(pool_dir)]  # fmt: skip
    donate = ["--memx-peer-kv", "donate", "--memx-peer-donate-max-gb", "0.02"]
    stream = ["--memx-peer-kv", "borrow", "--memx-peer-layer-stream"]
    donor = SGLangServer(model, name="lsc-donor", max_total_tokens=16384, extra_args=COMMON + pool + donate)
    borrower = SGLangServer(model, name="lsc-borrower", max_total_tokens=LOCAL_TOKENS,
                            extra_args=COMMON + pool + stream)  # fmt: skip
    stock = SGLangServer(model, name="lsc-stock", stock=True, max_total_tokens=8192, extra_args=COMMON)
    try:
        start_all([donor, borrower, stock])
        yield {"donor": donor, "borrower": borrower, "stock": stock, "sock": pool_dir / f"{name}.sock"}
    finally:
        release_with_pool((donor, borrower, stock), name, pool_dir)


def _gen(server, ids, n=NEW):
    out = server.request(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )
    return out["output_ids"]


def _stream(server):
    return server.request("/memx/status")["schedulers"][0]["peer_kv"]["layer_stream"]


rng = random.Random(3)
LONG = [rng.randrange(3, SPEC.vocab_size) for _ in range(PROMPT)]
SHORT = [rng.randrange(3, SPEC.vocab_size) for _ in range(200)]


def test_long_prompt_beyond_the_local_budget_equals_stock(servers):
    borrower, stock = servers["borrower"], servers["stock"]
    st = _stream(borrower)
    print("layer_stream:", st)
    assert st["stock_tokens"] == LOCAL_TOKENS
    assert st["streamed_layers"] >= 1 and st["capacity_tokens"] >= 4 * LOCAL_TOKENS
    assert st["local_kv_bytes_planned"] <= LOCAL_TOKENS * SPEC.num_layers * 2 * 2 * 16 * 4
    info = borrower.request("/get_server_info")
    assert info["max_total_num_tokens"] == st["capacity_tokens"]
    assert _gen(borrower, SHORT) == _gen(stock, SHORT)
    assert _gen(borrower, LONG) == _gen(stock, LONG)
    st = _stream(borrower)
    assert st["forwards"] > 0 and st["lsc_bytes_loaded"] > 0 and st["lsc_bytes_stored"] > 0
    assert st["lsc_broken"] is None


def test_donor_killed_requests_get_the_named_error(servers):
    borrower, donor = servers["borrower"], servers["donor"]
    pid = donor.request("/memx/status")["schedulers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 30
    while _stream(borrower)["lsc_broken"] is None:
        assert time.monotonic() < end, "the borrower never saw the donor go"
        time.sleep(0.2)
    try:  # an aborted request: an HTTP error, or a response whose finish reason is the abort
        out = borrower.request("/generate", {"input_ids": SHORT, "sampling_params": {"max_new_tokens": NEW,
                                                                                   "temperature": 0}})  # fmt: skip
        body = json.dumps(out["meta_info"]["finish_reason"])
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
    print("after the donor's death:", body[:300])
    assert "layer stream cache" in body
    assert borrower.request("/memx/status")["schedulers"]  # still serving its endpoints

    def balanced():
        st = query_arbiter_status(servers["sock"])
        return pid not in {c["pid"] for c in st["clients"]} and st

    end = time.monotonic() + 30
    while not balanced():
        assert time.monotonic() < end, "the arbiter never took the dead donor's chunks back"
        time.sleep(0.2)
    st = query_arbiter_status(servers["sock"])
    held = sum(c["held"] for c in st["clients"])
    assert held + st["free"] + (st["budget"] - st["created"]) == st["budget"], st
