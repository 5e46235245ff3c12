"""Two servers with remappable weights under one shared pool (--memx-pool): the idle one's
layers are lent to the busy one's KV through the arbiter and come back when it gets
traffic; SIGKILL of the lender mid-stream spares the borrower; a lender that sleeps
(--memx-sleep-after-s) wakes with all its layers after the borrower is SIGKILLed, and no
chunk leaks. With a TBT SLO the busy server's demand
on the shared host link is decided by the arbiter (Select-N's LinkCoordinator).

Tiny 8-layer Llama, float32, 16 KiB chunks: a layer is 145 chunks, a KV group of 32 tokens
16. The budget (0.045 GB = 2880 chunks) holds both models' weights (2320 chunks) and ~35
KV groups beside them, so a load of ~2000 tokens on one server needs the other's layers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import pytest

from memory_ext.pool.arbiter_client import query_arbiter_status
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_with_pool, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SPEC = TinyModelSpec(arch="llama", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                     intermediate_size=512, seed=7)  # fmt: skip
COMMON = ["--chunked-prefill-size", "64", "--dtype", "float32"]
PROMPT = " ".join(["one two three four five six seven eight"] * 60)  # ~480 tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)
    pool_dir = tmp_path_factory.mktemp("wpools")
    name = f"w{os.getpid()}"
    args = COMMON + ["--memx-elastic-kv", "--memx-chunk-kb", "16", "--memx-pool", name, "--memx-pool-budget-gb",
                     "0.045", "--memx-pool-dir", str(pool_dir), "--memx-weights", "remap",
                     "--memx-weights-idle-after-s", "3", "--memx-tbt-slo-ms", "5000"]  # fmt: skip
    a = SGLangServer(model, name="wcolo-a", max_total_tokens=4096, extra_args=args)
    b = SGLangServer(model, name="wcolo-b", max_total_tokens=4096, extra_args=args)
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-l8-s7-f32", stock=True, max_total_tokens=4096, extra_args=COMMON)
    )
    start_all([a, b, stock])
    yield {"a": a, "b": b, "stock": stock, "sock": pool_dir / f"{name}.sock", "model": model, "args": args}
    release_with_pool((a, b, stock), name, pool_dir)


def _gen(server, text, n, timeout=180):
    payload = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    return server.request("/generate", payload, timeout=timeout)


def _weights(server):
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["weights"]


def _wait(predicate, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def _explain(pair) -> str:
    """Everything that decides lending, for a failure message: both servers' weights and
    shared-pool status and the arbiter's view."""
    out = {}
    for key in ("a", "b"):
        try:
            sched = pair[key].request("/memx/status")["schedulers"][0]["elastic_kv"]
            out[key] = {"weights": sched["weights"], "shared_pool": sched.get("shared_pool")}
        except Exception as exc:  # noqa: BLE001 - a dead server is part of the explanation
            out[key] = repr(exc)
    try:
        out["arbiter"] = query_arbiter_status(pair["sock"])
    except Exception as exc:  # noqa: BLE001
        out["arbiter"] = repr(exc)
    return json.dumps(out, indent=1, default=str)


def test_idle_servers_layers_go_to_the_busy_ones_kv_and_come_back_with_traffic(pair):
    a, b, stock = pair["a"], pair["b"], pair["stock"]
    time.sleep(4)  # b has had no request for longer than --memx-weights-idle-after-s
    lent_seen, links_seen = [], []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_gen, a, PROMPT + f" {i}", 200) for i in range(4)]
        while not all(f.done() for f in futures):
            lent_seen.append(_weights(b)["lent_layers"])
            links_seen.append(_weights(a)["link"])
            time.sleep(0.5)
        outs = [f.result()["output_ids"] for f in futures]
    assert outs == [_gen(stock, PROMPT + f" {i}", 200)["output_ids"] for i in range(4)]
    wb = _weights(b)
    assert max(lent_seen) > 0 and wb["released_for_peers"] > 0, (lent_seen, wb)  # b lent layers to a's KV
    assert _weights(a)["released_for_peers"] == 0  # a was active: nobody took its layers
    # while busy, a's demand on the shared host link went through the arbiter (LINK); idle, it withdrew
    assert any(x is not None and x["interval"] is not None and x["sharing"] >= 1 for x in links_seen), links_seen
    # b gets traffic: it answers as stock while streaming, and its layers come back
    try:
        got = _gen(b, PROMPT, 40)["output_ids"]
    except Exception as exc:
        raise AssertionError(f"b did not answer: {exc}; b: {_weights(b)}; a: {_weights(a)}") from exc
    assert got == _gen(stock, PROMPT, 40)["output_ids"]
    for _ in range(20):
        _gen(b, "hello world", 8)
        if _weights(b)["lent_layers"] == 0:
            break
    wb = _weights(b)
    assert wb["lent_layers"] == 0 and wb["restores"] > 0, wb


def test_killing_the_lender_mid_stream_spares_the_borrower_and_leaks_nothing(pair):
    a, b = pair["a"], pair["b"]
    b_pid = b.request("/memx/status")["schedulers"][0]["pid"]
    time.sleep(4)
    errors, outs = [], []

    def load():
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                outs.extend(pool.map(lambda i: len(_gen(a, PROMPT + f" k{i}", 200)["output_ids"]), range(4)))
        except Exception as exc:  # noqa: BLE001 - any failure on the survivor is the bug
            errors.append(repr(exc))

    t = threading.Thread(target=load)
    t.start()
    assert _wait(lambda: _weights(b)["lent_layers"] > 0, 120), _explain(pair)
    os.killpg(b.proc.pid, signal.SIGKILL)  # the lender dies while a decodes in its memory
    t.join(600)
    assert errors == [] and outs == [200] * 4, (errors, outs)
    st = query_arbiter_status(pair["sock"])
    assert _wait(lambda: all(c["pid"] != b_pid for c in query_arbiter_status(pair["sock"])["clients"]))
    st = query_arbiter_status(pair["sock"])
    held = sum(c["held"] for c in st["clients"])
    assert held + st["free"] + (st["budget"] - st["created"]) == st["budget"], st  # every chunk accounted for
    assert _gen(a, "one two three", 8)["meta_info"]["completion_tokens"] == 8  # a keeps serving


def test_a_sleeping_lender_wakes_and_answers_as_stock_after_the_borrower_is_killed(pair):
    """A fresh server c with --memx-sleep-after-s falls asleep (every layer but one staging slot
    and its KV back to the pool); a borrows that memory and is SIGKILLed mid-stream; c's first
    request wakes it (every layer restored, wake time in status), it answers as stock does, and
    every chunk is accounted for."""
    a, stock = pair["a"], pair["stock"]
    c = SGLangServer(pair["model"], name="wcolo-c", max_total_tokens=4096,
                     extra_args=pair["args"] + ["--memx-sleep-after-s", "5"])  # fmt: skip
    start_all([c])

    def doomed_load(tag):
        try:
            for i in range(2):
                _gen(a, PROMPT + f" {tag}{i}", 200)
        except Exception:  # noqa: BLE001 - a is killed under this load on purpose
            pass

    try:
        a_pid = a.request("/memx/status")["schedulers"][0]["pid"]
        assert _wait(lambda: _weights(c)["sleep"]["state"] == "sleeping", 60), _weights(c)
        asleep = _weights(c)
        assert asleep["lent_layers"] == 7 and asleep["sleep"]["sleeps"] == 1, asleep  # 8 layers, 1 slot
        for tag in "zy":
            threading.Thread(target=doomed_load, args=(tag,), daemon=True).start()
        time.sleep(3)  # a decodes, partly in the memory c gave back
        os.killpg(a.proc.pid, signal.SIGKILL)  # the borrower dies mid-stream
        assert _wait(lambda: all(x["pid"] != a_pid for x in query_arbiter_status(pair["sock"])["clients"]))
        assert _gen(c, PROMPT, 40)["output_ids"] == _gen(stock, PROMPT, 40)["output_ids"]  # wakes c
        woke = _weights(c)
        assert woke["sleep"]["wakes"] >= 1 and woke["sleep"]["last_wake_s"] is not None, woke
        assert woke["sleep"]["last_wake_full"] is True, woke  # a's memory was free again: a full wake
        st = query_arbiter_status(pair["sock"])
        held = sum(x["held"] for x in st["clients"])
        assert held + st["free"] + (st["budget"] - st["created"]) == st["budget"], st
    finally:
        c.stop()
