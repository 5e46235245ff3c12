"""A TPOT SLO that a small batch meets and the whole burst does not caps the running batch in a
real CPU server; a loose SLO on the same model does not; greedy outputs equal stock's.

On the embedded tiny models the decode step hardly grows with the batch (the noise is larger),
so no fixed SLO caps reliably. This module's model reads a lot of KV per token: a tiny Llama with
``LAYERS`` layers of 8 KV heads x 64, and prompts of ~800 tokens; upstream's
``torch_native`` decode gathers each request's KV per layer, so a decode step of eight such requests
costs several times one request's. The SLO is not a constant either: it is taken from this
machine, now.

* ``loose`` (memx, TPOT SLO 100 s) and stock start together, each on its own core. ``loose``
  decodes one request alone, then a burst (eight long prompts at once): its step-time model
  (``/memx/status``: its predicted TPOT by batch size, prefill stalls counted) is this model's
  on one core.
* ``capped`` (memx) starts next, on the same core as ``loose``, with a TPOT SLO half-way (in
  log) between the predicted TPOT of one request and of the whole burst, so one request is
  comfortably within it and the burst comfortably over it. It learns its own model the same
  way, then takes the burst once more while the test polls its status.
* Asserted: ``capped`` refused to grow (``over_slo`` decisions), the running batch it was seen
  with never reached the burst, its status' cap (idle: for requests holding the recent ones' KV)
  is below the burst, and every request was
  served with stock's greedy output for the same prompt; ``loose`` ran the burst as one batch
  with no ``over_slo`` decision, its measured TPOT within its SLO, and the same outputs. On both,
  ``/memx/status`` names the SLO and its source and ``/memx/metrics`` agrees on SLO, cap, reason.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.governor_status import check_visible, governor
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
_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _prompt(i: int) -> str:
    """A distinct prompt of PROMPT_WORDS words (no shared prefix beyond a word)."""
    return " ".join(f"{_WORDS[(i * 7 + k) % len(_WORDS)]}{i}" for k in range(PROMPT_WORDS))


def _gen(server, texts, n=NEW_TOKENS):
    return server.request(
        "/generate", {"text": texts, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )


def _teach(server, first: int) -> dict:
    """One request alone, then a burst: samples at every batch size the burst passes through.
    Returns the governor's status after."""
    _gen(server, _prompt(first))
    _gen(server, [_prompt(first + 1 + i) for i in range(BURST)])
    return governor(server)


@pytest.fixture(scope="module")
def servers(tiny_model_root):
    model = tiny_model(SPEC, tiny_model_root)
    stock = SGLangServer(model, name="cap-stock", stock=True, max_total_tokens=MAX_TOTAL_TOKENS, extra_args=COMMON)
    loose = SGLangServer(model, name="cap-loose", max_total_tokens=MAX_TOTAL_TOKENS,
                         extra_args=COMMON + ["--memx-elastic-kv", "--memx-tpot-slo-ms", "100000"])  # fmt: skip
    start_all([stock, loose])
    started = [stock, loose]
    try:
        taught = _teach(loose, 1000)
        # the governor's own prediction, for requests holding the KV its recent decode steps held
        curve = taught["predicted_tpot_ms_by_batch"]
        alone, burst = curve["1"] / 1e3, curve[str(BURST)] / 1e3
        slo_s = math.sqrt(alone * burst)
        print(f"loose model {taught['model']}, stalls {taught['prefill_stalls']}: predicted TPOT alone "
              f"{alone * 1e3:.2f} ms, burst {burst * 1e3:.2f} ms -> capped SLO {slo_s * 1e3:.2f} ms")  # fmt: skip
        assert burst > 2 * alone, ("the model's step must grow with the batch for this test", taught["model"])
        same_core = {k: loose.env[k] for k in ("SGLANG_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
        slo_args = ["--memx-elastic-kv", "--memx-tpot-slo-ms", f"{slo_s * 1e3:.3f}"]
        capped = SGLangServer(model, name="cap-tight", max_total_tokens=MAX_TOTAL_TOKENS, env=same_core,
                              extra_args=COMMON + slo_args)  # fmt: skip
        start_all([capped])
        started.append(capped)
        _teach(capped, 2000)
        yield {"stock": stock, "loose": loose, "capped": capped, "slo_s": slo_s}
    finally:
        release_all(started)


def _burst_against_stock(servers, name: str, first: int):
    """A burst of BURST new prompts on stock, then on ``servers[name]`` while polling its running
    batch. Returns the governor's status before and after, the largest running batch seen, and
    whether every output was stock's (all NEW_TOKENS long)."""
    texts = [_prompt(first + i) for i in range(BURST)]
    want = [r["output_ids"] for r in _gen(servers["stock"], texts)]
    server = servers[name]
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


def test_a_tight_tpot_slo_caps_the_batch_and_outputs_match_stock(servers):
    before, after, most, as_stock = _burst_against_stock(servers, "capped", 3000)
    assert as_stock  # every request served, with stock's tokens
    print(f"capped: SLO {after['tpot_slo_ms']} ms, cap {after['batch_cap']} ({after['batch_cap_reason']}), most "
          f"running {most}, model {after['model']}, measured step {after['measured_decode_step_ms']} ms")  # fmt: skip
    assert after["decisions"]["over_slo"] > before["decisions"]["over_slo"]  # growth refused in this burst
    assert 1 <= most < BURST  # the burst never ran as one batch
    # idle, the status' cap is for requests holding the KV the recent ones held: below the burst
    assert after["batch_cap_reason"] == "predicted_tpot_within_slo" and 1 <= after["batch_cap"] < BURST
    assert after["predicted_tpot_ms_by_batch"][str(BURST)] > after["tpot_slo_ms"]
    check_visible(servers["capped"], after)


def test_a_loose_tpot_slo_on_the_same_model_runs_the_burst_as_one_batch(servers):
    before, after, most, as_stock = _burst_against_stock(servers, "loose", 4000)
    assert as_stock
    assert after["decisions"]["over_slo"] == before["decisions"]["over_slo"] == 0
    assert after["decisions"]["within_slo"] > before["decisions"]["within_slo"]
    assert most == BURST  # the burst ran as one batch, as stock's
    assert after["batch_cap"] >= BURST and after["batch_cap_reason"] == "predicted_tpot_within_slo"
    assert after["measured_tpot_ms"] < after["tpot_slo_ms"]
    check_visible(servers["loose"], after)
