"""docs/router.md's bench_serving block is what ``benchmark/bench_serving_table.py`` renders from
``benchmark/results/e2e/bench_serving.json``, and the renderer says what the JSON says."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import bench_serving_table as bt  # noqa: E402
from benchmark.e2e import bench_serving as bs  # noqa: E402


def test_docs_block_matches_the_json():
    assert bt.main(["--check"]) == 0, "run: python -m benchmark.bench_serving_table"


def _run(thr, ttft, completed=100):
    return {"completed": completed, "request_throughput": thr, "output_throughput": 40 * thr, "median_ttft_ms": 100.0,
            "tail_ttft_ms": ttft, "median_tpot_ms": 50.0}  # fmt: skip


def _doc(pairs):
    rounds = [{"stock": s, "memx": m} for s, m in pairs]
    ratios = {k: bs.ratio_stats(rounds, k, "memx", "stock") for k in bs.KEYS}
    return {"command": "bench", "time": "t", "machine": {"cpus": 2}, "tail": "p99", "rounds": rounds,
            "ratios": ratios, "claims": bs.claims(rounds, ratios, 100)}  # fmt: skip


def test_one_contradicting_pair_breaks_the_claim_and_the_table_shows_it():
    good = _doc([(_run(1.0, 1000.0), _run(1.2, 800.0))] * 5)
    c = good["claims"]
    assert c["throughput_at_least_stock_every_pair"] and c["tail_ttft_at_most_stock_every_pair"]
    mixed = _doc([(_run(1.0, 1000.0), _run(1.2, 800.0))] * 4 + [(_run(1.0, 1000.0), _run(0.9, 1100.0, 99))])
    c = mixed["claims"]
    assert not c["throughput_at_least_stock_every_pair"] and not c["tail_ttft_at_most_stock_every_pair"]
    assert not c["memx_served_every_request"] and c["stock_served_every_request"]
    text = bt.render(mixed)
    assert "| requests answered per run | 100, 100, 100, 100, 100 | 100, 100, 100, 100, 99 |" in text
    assert "TTFT p99 (ms)" in text and "1.2 [0.9, 1.2]" in text and "memx_served_every_request **no**" in text


def test_engine_states_reads_each_engines_status_through_the_router():
    """``engine_states`` lists the engines from the router's ``/memx/serve`` and keeps each one's
    host buffer, compute share, heap trims, requests and governor verdicts, SLO and cap (not its
    model); an engine that does not answer is an error entry, not a lost run."""
    import http.server
    import json

    from support.http_stub import serving

    governor = {"admission_verdicts": {"stock_first": 2}, "max_running_seen": 7, "model": {"samples": 9},
                "tpot_slo_ms": 200.0, "slo_origin": "default", "batch_cap": 12}  # fmt: skip
    status = {"schedulers": [{"elastic_kv": {"host_buffer": {"parked": 3, "recomputed": {"not_fetched": 1}},
                                             "governor": governor},
                              "compute_share": {"cores": [0, 1]}, "heap_trim": {"trims": 2},
                              "requests": {"running": 0, "waiting": 0}, "other": 1}]}  # fmt: skip

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            port = self.server.server_address[1]
            routes = {"/memx/serve": {"engines": {"a": {"url": f"http://127.0.0.1:{port}/a"},
                                                  "b": {"url": "http://127.0.0.1:9/gone"}}},
                      "/a/memx/status": status}  # fmt: skip
            body = json.dumps(routes.get(self.path, {})).encode()
            self.send_response(200 if self.path in routes else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with serving(Handler) as url:
        got = bs.engine_states(url)
        alone = bs.engine_states(url + "/a", single=True)  # --single: the server itself, no router
    assert got["a"] == {"host_buffer": {"parked": 3, "recomputed": {"not_fetched": 1}},
                        "compute_share": {"cores": [0, 1]}, "heap_trim": {"trims": 2},
                        "requests": {"running": 0, "waiting": 0},
                        "governor": {"admission_verdicts": {"stock_first": 2}, "max_running_seen": 7,
                                     "tpot_slo_ms": 200.0, "slo_origin": "default", "batch_cap": 12}}  # fmt: skip
    assert set(got["b"]) == {"error"}
    assert alone == {"single": got["a"]}


def test_same_window_doc_renders_every_setup_against_stock():
    """A ``--same-window`` run with a variant: one column per setup, one ratio column and one
    claims line per memx setup, and the intro says the setups were up together."""
    pairs = [(_run(1.0, 1000.0), _run(1.2, 800.0), _run(0.9, 1200.0))] * 5
    rounds = [{"stock": s, "memx": m, "gov": g} for s, m, g in pairs]
    by = {n: {k: bs.ratio_stats(rounds, k, n, "stock") for k in bs.KEYS} for n in ("memx", "gov")}
    doc = {"command": "bench", "time": "t", "machine": {"cpus": 2}, "tail": "p99", "rounds": rounds,
           "mode": "same_window", "memx_serve": "single", "memx_features": "--memx-elastic-kv",
           "setups": {"stock": {"memx_features": None}, "memx": {"memx_features": None},
                      "gov": {"memx_features": "--memx-elastic-kv --memx-governor"}},
           "ratios": by["memx"], "ratios_by_setup": by, "claims": bs.claims(rounds, by["memx"], 100),
           "claims_by_setup": {n: bs.claims(rounds, by[n], 100, n) for n in by}}  # fmt: skip
    text = bt.render(doc)
    assert "| metric | stock | memx | gov | memx / stock | gov / stock |" in text
    assert (
        "started once with `--sleep-on-idle`" in text
        and "`gov`: memx flags `--memx-elastic-kv --memx-governor`" in text
    )
    assert (
        "| request throughput (req/s) | 1 [1, 1] | 1.2 [1.2, 1.2] | 0.9 [0.9, 0.9] | 1.2 [1.2, 1.2] | 0.9 [0.9, 0.9] |"
        in text
    )
    assert "Claims (memx): memx_served_every_request **yes**; stock_served_every_request **yes**; " \
           "throughput_at_least_stock_every_pair **yes**" in text  # fmt: skip
    assert "Claims (gov): " in text and doc["claims_by_setup"]["gov"]["throughput_at_least_stock_every_pair"] is False


def test_variants_need_a_new_lower_case_name():
    import pytest

    args = bs._args(["--same-window", "--single", "--variant", "gov=--memx-elastic-kv --memx-governor"])
    setups = bs.parse_setups(args)
    assert setups["stock"] == (["--memx-disable", "--sleep-on-idle"], None)
    assert setups["memx"] == (["--single", "--sleep-on-idle"], None)
    assert setups["gov"] == (["--single", "--sleep-on-idle"], "--memx-elastic-kv --memx-governor")
    assert bs.parse_setups(bs._args([]))["memx"] == ([], None)  # fresh starts, the main job
    every = bs.parse_setups(bs._args(["--single", "--serve-args", "--decode-log-interval 1", "--variant", "g=x"]))
    assert {name: serve for name, (serve, _) in every.items()} == {
        "stock": ["--memx-disable", "--decode-log-interval", "1"],
        "memx": ["--single", "--decode-log-interval", "1"],
        "g": ["--single", "--decode-log-interval", "1"],
    }
    for bad in ("gov", "stock=--memx-elastic-kv", "Gov=x"):
        with pytest.raises(SystemExit, match="--variant"):
            bs.parse_setups(bs._args(["--variant", bad]))


def test_step_table_shows_each_bin_and_the_prefill_forwards():
    """With ``steps`` in every run (``--serve-args "--decode-log-interval 1"``): one row per batch-size
    bin with a ratio, each setup's median step over the runs and the steps timed, the ratio over the
    rounds where both timed enough steps; then the prefill forwards and tokens per run."""

    def run(ms, prefills):
        steps = {"by_batch": {"49-64": {"steps": 6, "step_ms_p50": ms, "mean_batch": 60}},
                 "prefill_batches": prefills, "prefill_tokens": 100 * prefills, "decode_steps": 6}  # fmt: skip
        return {**_run(1.0, 1000.0), "steps": steps}

    rounds = [{"stock": run(100.0, 10), "memx": run(ms, 12)} for ms in (95.0, 100.0, 105.0, 110.0, 90.0)]
    by = {"memx": {k: bs.ratio_stats(rounds, k, "memx", "stock") for k in bs.KEYS}}
    doc = {"command": "bench", "time": "t", "machine": {"cpus": 2}, "tail": "p99", "rounds": rounds,
           "ratios": by["memx"], "ratios_by_setup": by, "claims": bs.claims(rounds, by["memx"], 100),
           "step_ratios_by_setup": {"memx": bs.step_ratios(rounds, "memx")}}  # fmt: skip
    text = bt.render(doc)
    assert "| running requests | stock | memx | memx / stock |" in text
    assert "| 49-64 | 100 [100, 100] (30 steps) | 100 [90, 110] (30 steps) | 1 [0.9, 1.1] (5 rounds) |" in text
    assert "| prefill forwards per run | 10 [10, 10] | 12 [12, 12] |" in text
    assert "| prefill tokens per run | 1000 [1000, 1000] | 1200 [1200, 1200] |" in text
    assert "running requests" not in bt.render({k: v for k, v in doc.items() if k != "step_ratios_by_setup"})


def test_the_intro_names_the_openmp_wait_settings_the_setups_inherited():
    doc = _doc([(_run(1.0, 1000.0), _run(1.2, 800.0))] * 5)
    assert "environment" not in bt.render(doc)
    doc["environment"] = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert "(t, 2 CPUs, every setup started with `OMP_WAIT_POLICY=ACTIVE` in its environment)" in bt.render(doc)
