"""The governor (``--memx-tpot-slo-ms`` with ``--memx-elastic-kv``) on a real CPU server against
stock SGLang on the same prompts, greedy, and its SLO changed at run time (``POST /memx/slo``).

On the embedded tiny models the decode step hardly grows with the batch (the noise is larger),
so no fixed SLO caps reliably. This module's model reads a lot of KV per token: a tiny Llama with
``LAYERS`` layers of 8 KV heads x 64, and prompts of ~800 tokens; upstream's
``torch_native`` decode gathers each request's KV per layer, so a decode step of eight such requests
costs several times one request's. The tight SLO is not a constant either: it is taken from this
machine, now.

Two servers, each on its own core: stock, and memx started with a loose TPOT SLO (100 s, its
source the flag). The memx server decodes one request alone, then a burst (eight long prompts at
once): its step-time model (``/memx/status``: its predicted TPOT by batch size, prefill stalls
counted) is this model's on one core. Then, one SLO per test, each set with ``POST /memx/slo``:

* loose (the flag's): the burst runs as one batch, no ``over_slo`` decision, the measured TPOT
  within the SLO;
* tight, half-way (in log) between the predicted TPOT of one request and of the whole burst: the
  server refuses to grow (``over_slo`` decisions), the running batch never reaches the burst, the
  status' cap (idle: for requests holding the recent ones' KV) is below it;
* one no batch meets (0.01 ms; do no harm): even one request alone is predicted over it, so a cap
  would only queue the burst for a TPOT no batch attains; no cap (``slo_infeasible``), no
  ``over_slo`` refusal, the burst runs as a batch;
* null (no SLO given, as ``--memx-governor`` alone): the measured default is in force (20 x the
  solo decode step of the start-up warm-up, ``--memx-tpot-slo-scale``), named as the source; every
  admission of the burst passes the do-no-harm rules and is counted by reason.

Every burst's outputs equal stock's for the same prompts (every request served). ``/memx/status``
names the SLO and its source, ``/memx/metrics`` agrees on SLO, cap and reason. A bad body is a 400
naming the field and changes nothing.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.governor_status import check_visible, governor, metric
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LAYERS = 4
SPEC = TinyModelSpec(arch="llama", num_layers=LAYERS, hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64,
                     intermediate_size=256, seed=11)  # fmt: skip
PROMPT_WORDS = 110  # ~800 tokens with the tiny models' byte-level tokenizer
BURST = 8
NEW_TOKENS = 16
# a chunk holds about one prompt: the burst is admitted within a few iterations, not spread
# over dozens of 256-token chunks while the first requests already finish
COMMON = ["--chunked-prefill-size", "1024", "--dtype", "float32"]
MAX_TOTAL_TOKENS = 16384
LOOSE_MS = 100000.0
POSTED = "POST /memx/slo"
_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _prompt(i: int) -> str:
    """A distinct prompt of PROMPT_WORDS words (no shared prefix beyond a word)."""
    return " ".join(f"{_WORDS[(i * 7 + k) % len(_WORDS)]}{i}" for k in range(PROMPT_WORDS))


def _gen(server, texts, n=NEW_TOKENS):
    return server.request(
        "/generate", {"text": texts, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )


def _set_slo(server, body) -> tuple[int, dict]:
    """``POST /memx/slo`` with ``body``: (HTTP status, JSON answer)."""
    req = urllib.request.Request(server.url + "/memx/slo", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _use_slo(server, ms: float | None) -> None:
    """Set the TPOT SLO; null: the measured default is in force again (the warm-up measured it)."""
    assert _set_slo(server, {"tpot_slo_ms": ms}) == (200, {"tpot_slo_ms": ms, "source": POSTED})
    held = governor(server)  # every scheduler holds it once the answer is back
    if ms is None:
        assert held["slo_origin"] == "default"
        assert held["tpot_slo_ms"] == pytest.approx(held["default_slo"]["tpot_slo_ms"], rel=1e-4)
    else:
        assert held["slo_origin"] == "given" and held["tpot_slo_ms"] == pytest.approx(ms)  # converted from seconds


@pytest.fixture(scope="module")
def servers(tiny_model_root):
    model = tiny_model(SPEC, tiny_model_root)
    stock = SGLangServer(model, name="gov-stock", stock=True, max_total_tokens=MAX_TOTAL_TOKENS, extra_args=COMMON)
    memx = SGLangServer(model, name="gov-memx", max_total_tokens=MAX_TOTAL_TOKENS,
                        extra_args=COMMON + ["--memx-elastic-kv", "--memx-tpot-slo-ms", str(LOOSE_MS)])  # fmt: skip
    start_all([stock, memx])
    try:
        # one request alone, then a burst: samples at every batch size the burst passes through
        _gen(memx, _prompt(1000))
        _gen(memx, [_prompt(1001 + i) for i in range(BURST)])
        taught = governor(memx)
        assert taught["slos"]["tpot"] == {"ms": LOOSE_MS, "source": "--memx-tpot-slo-ms"}
        # the governor's own prediction, for requests holding the KV its recent decode steps held
        curve = taught["predicted_tpot_ms_by_batch"]
        alone, burst = curve["1"] / 1e3, curve[str(BURST)] / 1e3
        tight_s = math.sqrt(alone * burst)
        print(f"model {taught['model']}, stalls {taught['prefill_stalls']}: predicted TPOT alone "
              f"{alone * 1e3:.2f} ms, burst {burst * 1e3:.2f} ms -> tight SLO {tight_s * 1e3:.2f} ms")  # fmt: skip
        assert burst > 2 * alone, ("the model's step must grow with the batch for this test", taught["model"])
        yield {"stock": stock, "memx": memx, "tight_ms": round(tight_s * 1e3, 3)}
    finally:
        release_all([stock, memx])


def _burst_against_stock(servers, first: int):
    """A burst of BURST new prompts on stock, then on the memx server while polling its running
    batch. Returns the governor's status before and after, the largest running batch seen, and
    whether every output was stock's (all NEW_TOKENS long)."""
    texts = [_prompt(first + i) for i in range(BURST)]
    want = [r["output_ids"] for r in _gen(servers["stock"], texts)]
    server = servers["memx"]
    before = governor(server)
    seen = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            seen.append(governor(server)["running"])
            time.sleep(0.02)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        got = [r["output_ids"] for r in _gen(server, texts)]
    finally:
        done.set()
        watcher.join()
    as_stock = got == want and all(len(x) == NEW_TOKENS for x in got)
    return before, governor(server), max(seen, default=0), as_stock


def _new(after: dict, before: dict, kind: str, reason: str) -> int:
    return after[kind][reason] - before[kind][reason]


def test_a_loose_tpot_slo_runs_the_burst_as_one_batch(servers):
    _use_slo(servers["memx"], LOOSE_MS)
    before, after, most, as_stock = _burst_against_stock(servers, 4000)
    assert as_stock
    assert after["decisions"]["over_slo"] == before["decisions"]["over_slo"] == 0
    assert _new(after, before, "decisions", "within_slo") > 0
    assert most == BURST  # the burst ran as one batch, as stock's
    assert after["batch_cap"] >= BURST and after["batch_cap_reason"] == "predicted_tpot_within_slo"
    assert after["measured_tpot_ms"] < after["tpot_slo_ms"]
    check_visible(servers["memx"], after, POSTED)


def test_a_tight_tpot_slo_set_at_run_time_caps_the_batch_and_outputs_match_stock(servers):
    server = servers["memx"]
    for body, field in (({"tpot_slo_ms": 0}, "tpot_slo_ms"), ({"ttft_slo_ms": 5}, "ttft_slo_ms"), ([], "body")):
        status, answer = _set_slo(server, body)
        assert status == 400 and answer["error"]["field"] == field, (body, status, answer)
    _use_slo(server, servers["tight_ms"])
    before, after, most, as_stock = _burst_against_stock(servers, 3000)
    assert as_stock  # every request served, with stock's tokens
    print(f"capped: SLO {after['tpot_slo_ms']} ms, cap {after['batch_cap']} ({after['batch_cap_reason']}), most "
          f"running {most}, model {after['model']}, measured step {after['measured_decode_step_ms']} ms")  # fmt: skip
    assert _new(after, before, "decisions", "over_slo") > 0  # growth refused in this burst
    assert 1 <= most < BURST  # the burst never ran as one batch
    # idle, the status' cap is for requests holding the KV the recent ones held: below the burst
    assert after["batch_cap_reason"] == "predicted_tpot_within_slo" and 1 <= after["batch_cap"] < BURST
    assert after["predicted_tpot_ms_by_batch"][str(BURST)] > after["tpot_slo_ms"]
    check_visible(server, after, POSTED)


def test_an_slo_no_batch_meets_does_not_cap_and_outputs_match_stock(servers):
    _use_slo(servers["memx"], 0.01)
    before, after, most, as_stock = _burst_against_stock(servers, 5000)
    assert as_stock  # every request served, batched as stock
    assert after["batch_cap"] is None and after["batch_cap_reason"] == "slo_infeasible"
    assert _new(after, before, "decisions", "over_slo") == 0 and _new(after, before, "decisions", "slo_infeasible") > 0
    assert most > 1  # the burst ran as a batch, not one by one
    assert after["measured_tpot_ms"] > after["tpot_slo_ms"] and after["predicted_tpot_ms"] is not None
    text = check_visible(servers["memx"], after, POSTED)
    assert metric(text, "memx_governor_measured_tpot_seconds") > 0


def test_without_a_given_slo_the_governor_holds_its_measured_default_and_outputs_match_stock(servers):
    """``tpot_slo_ms: null``: the governor of ``--memx-governor`` alone: the SLO in force is its
    default, 20 x the solo decode step it measured at start (upstream's warm-up request decodes
    alone), the status names it as the source; every admission of the burst passed its do-no-harm
    rules (counted by reason in the status and in /memx/metrics), none refused with room to spare."""
    server = servers["memx"]
    _use_slo(server, None)
    before, after, most, as_stock = _burst_against_stock(servers, 6000)
    assert as_stock
    d = after["default_slo"]
    assert (d["scale"], d["solo_samples"], d["samples_needed"]) == (20.0, 5, 5) and d["solo_step_ms"] > 0
    assert after["slo_origin"] == "default" and after["tpot_slo_ms"] == pytest.approx(20 * d["solo_step_ms"], rel=1e-3)
    source = after["slos"]["tpot"]["source"]
    assert (
        source.startswith("default: 20 x the solo decode step measured at start (")
        and "--memx-tpot-slo-scale" in source
    )
    print(
        f"default SLO {after['tpot_slo_ms']} ms (solo step {d['solo_step_ms']} ms), cap {after['batch_cap']} "
        f"({after['batch_cap_reason']}), most running {most}, refused {_new(after, before, 'decisions', 'over_slo')}"
    )
    # a cap at the default keeps >= 95 % of the throughput the step model predicts any batch reaches
    assert after["batch_cap_reason"] in ("predicted_tpot_within_slo", "slo_infeasible")
    passed = [_new(after, before, "admission_verdicts", r) for r in ("mechanism_admits", "no_predicted_gain")]
    assert sum(passed) >= BURST, after["admission_verdicts"]
    for reason in ("protects_running", "park_protects_running"):
        assert _new(after, before, "admission_verdicts", reason) == 0, after["admission_verdicts"]
    assert most > 1
    text = check_visible(server, after, source)
    n = metric(text, "memx_governor_admission_verdicts_total", reason="mechanism_admits")
    assert n == after["admission_verdicts"]["mechanism_admits"]
