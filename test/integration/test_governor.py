"""The governor (``--memx-tpot-slo-ms`` with ``--memx-elastic-kv``) on a real CPU server, against
stock SGLang on the same prompts, greedy.

Three servers on one tiny Llama (float32, so a random tiny model's flat logits do not flip
between batch shapes): stock; memx with a TPOT SLO no decode step can meet ("tight", 0.01 ms);
memx with ``--memx-governor`` and no SLO ("flag"). The SLO server first decodes one request
alone, so its step-time model has its samples (``StepTimeModel.min_samples``); then the same
burst of prompts arrives at once (one ``/generate`` with a list of texts).

* tight (do no harm): even one request alone is predicted over the SLO, so a cap would only queue
  the burst for a TPOT no batch attains; there is no cap (reason ``slo_infeasible``), no
  ``over_slo`` refusal, the burst runs as a batch and every output equals stock's for the same
  burst. ``/memx/status`` names the SLO in force and its source (the flag), ``/memx/metrics``
  shows the same SLO, the cap and its reason.
* ``--memx-governor`` (no SLO): no cap; every admission of the burst passes the do-no-harm rules
  and is counted by reason; outputs equal stock's.

An SLO that caps the batch, and a loose one that does not, on a model whose decode step grows
with the batch: ``test_governor_cap.py``.
"""

import pytest

from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.governor_status import check_visible, governor, metric
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
    flag = SGLangServer(model, name="gov-flag", max_total_tokens=4096,
                        extra_args=COMMON + ["--memx-elastic-kv", "--memx-governor"])  # fmt: skip
    everyone = [stock, tight, flag]
    start_all(everyone)
    _gen(tight, "warm up the step time model", 24)  # the step-time model's samples: one request alone
    yield {"stock": stock, "tight": tight, "flag": flag}
    release_all(everyone)


def _gen(server, text, n=NEW_TOKENS):
    return server.request(
        "/generate", {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )


def test_an_slo_no_batch_meets_does_not_cap_and_outputs_match_stock(servers):
    before = governor(servers["tight"])
    assert before["model"]["samples"] >= before["model"]["min_samples"]  # the warm-up taught the model
    want = [r["output_ids"] for r in _gen(servers["stock"], BURST)]
    got = [r["output_ids"] for r in _gen(servers["tight"], BURST)]
    assert got == want and all(len(x) == NEW_TOKENS for x in got)  # every request served, batched as stock
    gov = governor(servers["tight"])
    assert gov["tpot_slo_ms"] == 0.01
    assert gov["batch_cap"] is None and gov["batch_cap_reason"] == "slo_infeasible"
    assert gov["decisions"]["over_slo"] == 0 and gov["decisions"]["slo_infeasible"] > 0
    assert gov["max_running_seen"] > 1  # the burst ran as a batch, not one by one
    assert gov["measured_tpot_ms"] > gov["tpot_slo_ms"] and gov["predicted_tpot_ms"] is not None
    text = check_visible(servers["tight"], gov)
    assert metric(text, "memx_governor_measured_tpot_seconds") > 0


def test_the_governor_flag_without_an_slo_passes_admissions_and_outputs_match_stock(servers):
    """``--memx-governor``: no SLO, no cap; every admission of the burst passed its do-no-harm rules
    (counted by reason in the status and in /memx/metrics), none refused with room to spare."""
    want = [r["output_ids"] for r in _gen(servers["stock"], BURST)]
    got = [r["output_ids"] for r in _gen(servers["flag"], BURST)]
    assert got == want
    gov = governor(servers["flag"])
    assert gov["tpot_slo_ms"] is None and gov["slos"]["tpot"] is None
    assert gov["batch_cap"] is None and gov["batch_cap_reason"] == "no_slo" and gov["decisions"]["over_slo"] == 0
    verdicts = gov["admission_verdicts"]
    assert verdicts["mechanism_admits"] + verdicts["no_predicted_gain"] >= len(BURST), verdicts
    assert verdicts["protects_running"] == verdicts["park_protects_running"] == 0, verdicts
    assert gov["max_running_seen"] > 1
    text = servers["flag"].request_text("/memx/metrics")
    assert metric(text, "memx_governor_batch_cap_reason", reason="no_slo") == 1
    assert metric(text, "memx_governor_tpot_slo_seconds") is None
    n = metric(text, "memx_governor_admission_verdicts_total", reason="mechanism_admits")
    assert n == verdicts["mechanism_admits"]
