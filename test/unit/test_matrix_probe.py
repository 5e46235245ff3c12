"""``benchmark/e2e/matrix_probe.py``, the matrix-cell diagnostic: its bookkeeping, without servers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmark.e2e import matrix_probe as P  # noqa: E402
from benchmark.provenance import code_version  # noqa: E402


@pytest.mark.parametrize(
    "cmdline,role",
    [
        ("sglang::scheduler", "scheduler"),
        ("sglang::detokenizer", "detokenizer"),
        ("/x/python -m sglang_memx.cli serve --config a.yaml", "router"),
        ("/x/python -m sglang.launch_server --model-path m", "tokenizer/http"),
        ("python other.py", "other"),
    ],
)
def test_role_of(cmdline, role):
    assert P.role_of(cmdline) == role


def test_usage_delta_sums_roles_and_counts_new_processes_from_zero():
    before = {(1, "scheduler"): (2.0, 100), (2, "scheduler"): (1.0, 10)}
    after = {(1, "scheduler"): (3.5, 150), (2, "scheduler"): (1.25, 10), (3, "router"): (0.5, 7)}
    assert P.usage_delta(before, after) == {"router": {"cpu_s": 0.5, "minor_faults": 7},
                                            "scheduler": {"cpu_s": 1.75, "minor_faults": 50}}  # fmt: skip


def test_usage_reads_this_process():
    got = P.usage([os.getpid()])
    ((cpu, faults),) = [v for (pid, _), v in got.items() if pid == os.getpid()]
    assert cpu > 0 and faults > 0


def test_poll_sample_keeps_the_governor_and_the_lender_fields():
    governor = {"running": 3, "batch_cap": 5, "batch_cap_reason": "x", "measured_decode_step_ms": 4.2}
    share = {"cores": [0, 1], "lending_whole_device": {"phase": "own", "paid": 0}}
    doc = {"schedulers": [{"elastic_kv": {"governor": governor}, "compute_share": share}]}
    s = P.poll_sample(doc, "tiny-a", 1.0)
    assert (s["running"], s["cap"], s["decode_step_ms"], s["cores"]) == (3, 5, 4.2, [0, 1])
    assert s["whole_device"]["phase"] == "own" and s["whole_device"]["reason"] is None
    bare = P.poll_sample({"schedulers": [{}]}, "tiny-a", 1.0)  # no governor, no board: fields are None
    assert bare["running"] is None and bare["cores"] is None


def test_per_model_counts_what_met_each_slo():
    solo = {"a": {"ttft_s": 0.010, "tpot_s": 0.002}, "b": {"ttft_s": 0.010, "tpot_s": 0.002}}
    reqs = [{"model": "a", "ttft": 0.015, "tpot": 0.003}, {"model": "a", "ttft": 0.025, "tpot": 0.005},
            {"model": "a", "error": "HTTP 500"}]  # fmt: skip
    got = P.per_model(reqs, solo, 2.0)
    assert got["a"]["n"] == 2 and got["a"]["ttft_met"] == 1 and got["a"]["tpot_met"] == 1
    assert got["b"] == {"n": 0}


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit):
        P.parse_args(["--variants", "lend,fast"])
    assert P.parse_args(["--routed", ""]).routed == []


def test_variants_set_lending_and_drop_the_tpot_slo_for_nocap():
    def doc():
        return {"devices": [{"name": "cpu0"}], "launch": {"log_dir": "/l"},
                "models": [{"name": "a", "ttft_slo_ms": 20.0, "tpot_slo_ms": 3.0}]}  # fmt: skip

    lend, nocap = P.variant_config(doc(), "lend"), P.variant_config(doc(), "nolend-nocap")
    assert lend["devices"][0]["lend_idle_cores"] is True and lend["models"][0]["tpot_slo_ms"] == 3.0
    assert nocap["devices"][0]["lend_idle_cores"] is False and "tpot_slo_ms" not in nocap["models"][0]
    assert nocap["models"][0]["ttft_slo_ms"] == 20.0 and nocap["launch"]["log_dir"] == "/l-probe-nolend-nocap"
    assert P.parse_args(["--variants", "lend-nocap,nolend"]).variants == ["lend-nocap", "nolend"]


def test_omp_wait_suffixes_go_to_the_serve_environment_and_keep_the_config():
    assert P.variant_env("lend") == {} and P.variant_env("nolend-nocap") == {}
    assert P.variant_env("lend-spin10k") == {"GOMP_SPINCOUNT": "10000"}
    assert P.variant_env("lend-nocap-passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert P.variant_env("lend-spin") == {"GOMP_SPINCOUNT": "300000"}
    doc = {"devices": [{"name": "cpu0"}], "launch": {"log_dir": "/l"}, "models": [{"name": "a", "tpot_slo_ms": 3.0}]}
    got = P.variant_config(doc, "nolend-nocap-spin10k")
    assert got["devices"][0]["lend_idle_cores"] is False and "tpot_slo_ms" not in got["models"][0]
    assert P.parse_args(["--variants", "lend,lend-spin10k"]).variants == ["lend", "lend-spin10k"]
    with pytest.raises(SystemExit):
        P.parse_args(["--variants", "lend-spin10k-nocap"])  # the cap's suffix comes first


def test_the_probe_records_the_code_it_ran(tmp_path):
    assert code_version() != "" and code_version() != "unknown"  # this checkout
    assert code_version(tmp_path) == "unknown"  # not a repository (feature_floor's --base is read so)


def test_the_json_goes_under_probes_named_by_the_script():
    args = P.parse_args(["--workload", "steady2", "--scale", "2", "--variants", "lend,lend-nocap"])
    out = P.default_out(args, "abc1234")
    assert out == P.REPO / "benchmark/results/e2e/probes/steady2_x2_lend+lend-nocap_abc1234.json"


def test_engine_counters_keep_the_governors_decisions_and_the_pools_traffic():
    status = {"schedulers": [{"elastic_kv": {
        "governor": {"decisions": {"over_slo": 2, "within_slo": 5}},
        "shared_pool": {"borrowed_total": 21, "returned_total": 9, "denied_total": 0, "reclaim_requests": 1,
                        "held_chunks": 12}}}]}  # fmt: skip
    assert P.engine_counters(status) == {"decisions": {"over_slo": 2, "within_slo": 5},
                                         "pool": {"borrowed_total": 21, "returned_total": 9, "denied_total": 0,
                                                  "reclaim_requests": 1}}  # fmt: skip
    assert P.engine_counters({"schedulers": [{}]}) == {"decisions": None, "pool": dict.fromkeys(
        ("borrowed_total", "returned_total", "denied_total", "reclaim_requests"))}  # fmt: skip
