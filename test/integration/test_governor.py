"""The governor (``--memx-tpot-slo-ms`` with ``--memx-elastic-kv``) on a real CPU server, against
stock SGLang on the same prompts, greedy.

Four servers on one tiny Llama (float32, so a random tiny model's flat logits do not flip
between batch shapes): stock; memx with a TPOT SLO no decode step can meet ("tight", 0.01 ms);
memx with one every step meets ("loose", 100 s); memx with ``--memx-governor`` and no SLO
("flag"). The two SLO servers first decode one request alone, so their step-time model has its
samples (``StepTimeModel.min_samples``); then the same burst of prompts arrives at once (one
``/generate`` with a list of texts).

* tight (do no harm): even one request alone is predicted over the SLO, so a cap would only queue
  the burst for a TPOT no batch attains; there is no cap (reason ``slo_infeasible``), no
  ``over_slo`` refusal, the burst runs as a batch and every output equals stock's for the same
  burst. (A cap on a feasible SLO is covered by ``test_policy_governor``, the admission hook's
  unit tests and ``test_same_decisions``: on this CPU the step time grows with the batch by less
  than its noise, so no fixed SLO here would cap a real server reliably.)
* ``--memx-governor`` (no SLO): no cap; every admission of the burst passes the do-no-harm rules
  and is counted by reason; outputs equal stock's.
* loose: no ``over_slo`` decision, the burst runs as a batch (as stock's), its cap is >= the
  burst; outputs equal stock's for the same burst (equal batching: both admit it at once).

Tight and loose: ``/memx/status`` names the SLO in force and its source (the flag), ``/memx/metrics`` shows
the same SLO, the cap and its reason, and the refusals to grow (``reason="over_slo"``).
"""

import re

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_all, start_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
# test_elastic_kv.py's arguments, so that both modules share one stock server (the prompts here
# are shorter than the 16-token chunk: chunked prefill never splits them)
COMMON = ["--chunked-prefill-size", "16", "--dtype", "float32"]
BURST = [f"Request number {i} asks about {w}" for i, w in enumerate(["Paris", "water", "pages", "chunks", "cores"])]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def servers(tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-s5-f32", stock=True, max_total_tokens=4096, extra_args=COMMON)
    )
    tight = SGLangServer(model, name="gov-tight", max_total_tokens=4096,
                         extra_args=COMMON + ["--memx-elastic-kv", "--memx-tpot-slo-ms", "0.01"])  # fmt: skip
    loose = SGLangServer(model, name="gov-loose", max_total_tokens=4096,
                         extra_args=COMMON + ["--memx-elastic-kv", "--memx-tpot-slo-ms", "100000"])  # fmt: skip
    flag = SGLangServer(model, name="gov-flag", max_total_tokens=4096,
                        extra_args=COMMON + ["--memx-elastic-kv", "--memx-governor"])  # fmt: skip
    everyone = [stock, tight, loose, flag]
    start_all(everyone)
    for server in (tight, loose):  # the step-time model's samples: one request decoding alone
        _gen(server, "warm up the step time model", 24)
    yield {"stock": stock, "tight": tight, "loose": loose, "flag": flag}
    release_all(everyone)


def _gen(server, text, n=NEW_TOKENS):
    return server.request(
        "/generate", {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )


def _governor(server):
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["governor"]


def _metric(text, name, **labels):
    """The value of the one sample of ``name`` whose labels include ``labels`` (None: no such sample)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
             if all(w in m.group(1).split(",") for w in want)]  # fmt: skip
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def _visible(server, gov):
    """The status' SLO and its source, and /memx/metrics agreeing with the status on SLO, cap and refusals."""
    assert gov["slos"]["tpot"] == {"ms": gov["tpot_slo_ms"], "source": "--memx-tpot-slo-ms"}
    text = server.request_text("/memx/metrics")
    slo_s = _metric(text, "memx_governor_tpot_slo_seconds", source="--memx-tpot-slo-ms")
    assert slo_s is not None and abs(slo_s - gov["tpot_slo_ms"] / 1e3) < 1e-12
    assert _metric(text, "memx_governor_batch_cap_reason", reason=gov["batch_cap_reason"]) == 1
    assert _metric(text, "memx_governor_batch_cap_reason", reason="no_slo") == 0
    assert _metric(text, "memx_governor_batch_cap") == gov["batch_cap"]  # None (absent) when there is no cap
    assert _metric(text, "memx_governor_decisions_total", reason="over_slo") >= gov["decisions"]["over_slo"]
    return text


def test_an_slo_no_batch_meets_does_not_cap_and_outputs_match_stock(servers):
    before = _governor(servers["tight"])
    assert before["model"]["samples"] >= before["model"]["min_samples"]  # the warm-up taught the model
    want = [r["output_ids"] for r in _gen(servers["stock"], BURST)]
    got = [r["output_ids"] for r in _gen(servers["tight"], BURST)]
    assert got == want and all(len(x) == NEW_TOKENS for x in got)  # every request served, batched as stock
    gov = _governor(servers["tight"])
    assert gov["tpot_slo_ms"] == 0.01
    assert gov["batch_cap"] is None and gov["batch_cap_reason"] == "slo_infeasible"
    assert gov["decisions"]["over_slo"] == 0 and gov["decisions"]["slo_infeasible"] > 0
    assert gov["max_running_seen"] > 1  # the burst ran as a batch, not one by one
    assert gov["measured_tpot_ms"] > gov["tpot_slo_ms"] and gov["predicted_tpot_ms"] is not None
    text = _visible(servers["tight"], gov)
    assert _metric(text, "memx_governor_measured_tpot_seconds") > 0


def test_a_loose_tpot_slo_does_not_cap_and_outputs_match_stock(servers):
    want = [r["output_ids"] for r in _gen(servers["stock"], BURST)]
    got = [r["output_ids"] for r in _gen(servers["loose"], BURST)]
    assert got == want
    gov = _governor(servers["loose"])
    assert gov["decisions"]["over_slo"] == 0 and gov["decisions"]["within_slo"] > 0
    assert gov["batch_cap"] >= len(BURST) and gov["max_running_seen"] > 1
    assert gov["measured_tpot_ms"] < gov["tpot_slo_ms"]
    text = _visible(servers["loose"], gov)
    assert _metric(text, "memx_governor_batch_cap") >= len(BURST)
    assert _metric(text, "memx_governor_decisions_total", reason="over_slo") == 0
    assert gov["batch_cap_reason"] == "predicted_tpot_within_slo"


def test_the_governor_flag_without_an_slo_passes_admissions_and_outputs_match_stock(servers):
    """``--memx-governor``: no SLO, no cap; every admission of the burst passed its do-no-harm rules
    (counted by reason in the status and in /memx/metrics), none refused with room to spare."""
    want = [r["output_ids"] for r in _gen(servers["stock"], BURST)]
    got = [r["output_ids"] for r in _gen(servers["flag"], BURST)]
    assert got == want
    gov = _governor(servers["flag"])
    assert gov["tpot_slo_ms"] is None and gov["slos"]["tpot"] is None
    assert gov["batch_cap"] is None and gov["batch_cap_reason"] == "no_slo" and gov["decisions"]["over_slo"] == 0
    verdicts = gov["admission_verdicts"]
    assert verdicts["mechanism_admits"] + verdicts["no_predicted_gain"] >= len(BURST), verdicts
    assert verdicts["protects_running"] == verdicts["park_protects_running"] == 0, verdicts
    assert gov["max_running_seen"] > 1
    text = servers["flag"].request_text("/memx/metrics")
    assert _metric(text, "memx_governor_batch_cap_reason", reason="no_slo") == 1
    assert _metric(text, "memx_governor_tpot_slo_seconds") is None
    n = _metric(text, "memx_governor_admission_verdicts_total", reason="mechanism_admits")
    assert n == verdicts["mechanism_admits"]
