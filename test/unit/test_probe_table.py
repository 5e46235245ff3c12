"""The probe figures in the docs are what ``benchmark/probe_table.py`` renders from the probes' JSON."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import probe_table as pt  # noqa: E402


def test_docs_blocks_match_the_json():
    assert pt.main(["--check"]) == 0, "run: python -m benchmark.probe_table"


def _run(att, ttft, tpot, met=(10, 9)):
    return {"attainment": att, "models": {"m": {"n": 10, "ttft_ms": ttft, "tpot_ms": tpot, "ttft_met": met[0],
                                                "tpot_met": met[1]}}}  # fmt: skip


def _probe() -> dict:
    return {"command": "benchmark/e2e/matrix_probe.py --workload w --routed  --out /tmp/x.json --poll-s 0",
            "code": "abc1234", "when": "2026-12-05T00:00:00Z", "scale": 2.0,
            "solo": {"m": {"ttft_s": 0.010, "tpot_s": 0.002}},
            "runs": {"stock": [_run(0.9, 20.0, 2.0), _run(0.8, 22.0, 2.1), _run(1.0, 21.0, 2.05)],
                     "lend": [_run(0.45, 25.0, 2.5, (4, 10)), _run(0.8, 24.0, 2.4), _run(0.0, 26.0, 2.6)]}}  # fmt: skip


def test_a_block_quotes_the_command_slos_rows_and_ratios():
    text = pt.render("p", _probe(), (("lend", "stock"),))
    begin, end = pt.markers("p")
    assert text.startswith(begin) and text.endswith(end)
    assert "`benchmark/e2e/matrix_probe.py --workload w --routed '' --poll-s 0`, code abc1234" in text
    assert "/tmp/x.json" not in text and "3 rounds; SLOs `m` TTFT 20.0 ms / TPOT 4.00 ms." in text
    assert "| stock | 0.90 [0.80, 1.00] | 20.0–22.0 | 2.00–2.10 | 10 / 9 of 10 |" in text
    assert "| lend | 0.45 [0.00, 0.80] | 24.0–26.0 | 2.40–2.60 | 4–10 / 9–10 of 10 |" in text
    # per round: 0.45 / 0.9, 0.8 / 0.8, 0 / 1.0
    assert "Attainment lend / stock per round: 0.50 [0.00, 1.00] (3 pairs)." in text


def test_a_round_where_the_denominator_attains_nothing_is_no_pair():
    probe = _probe()
    probe["runs"]["stock"][2]["attainment"] = 0.0
    assert "(2 pairs)" in pt.render("p", probe, (("lend", "stock"),))


def test_no_round_with_an_attaining_denominator_says_so_and_ttfts_are_still_compared():
    probe = _probe()
    for run in probe["runs"]["stock"]:
        run["attainment"] = 0.0
    text = pt.render("p", probe, (("lend", "stock"),))
    assert "Attainment lend / stock per round: no pair (stock met no SLO in any round)." in text
    # TTFT per round: 25 / 20, 24 / 22, 26 / 21
    assert "Median TTFT lend / stock per round: `m` 1.24 [1.09, 1.25], above 1 in 3 of 3." in text


def test_every_named_probe_exists_and_has_its_setups():
    for stem, doc, ratios in pt.BLOCKS:
        assert (pt.PROBES / f"{stem}.json").is_file(), stem
        assert (REPO / "docs" / doc).is_file(), doc
        runs = __import__("json").loads((pt.PROBES / f"{stem}.json").read_text())["runs"]
        assert all(a in runs and b in runs for a, b in ratios), (stem, ratios)


def test_refusals_are_quoted_when_the_runs_kept_their_engines_counters():
    probe = _probe()
    assert "refusals" not in pt.render("p", probe, ())
    probe["runs"]["lend"][-1]["engines"] = {"m": {"decisions": {"over_slo": 3}, "pool": {}}}
    text = pt.render("p", probe, ())
    assert "Batch-cap refusals by the last round (`decisions.over_slo`, each engine's total): lend: `m` 3." in text
