"""docs/elastic-kv.md's map-call figures are what ``benchmark/map_calls_table.py`` renders from
``benchmark/results/e2e/colocated.json`` and ``benchmark/results/micro/pool_decode_host.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import map_calls_table as mt  # noqa: E402


def test_docs_blocks_match_the_json():
    assert mt.main(["--check"]) == 0, "run: python -m benchmark.map_calls_table"


def _server(decode_maps, steps, request, premap):
    return {"decode_map_calls": decode_maps, "decode_steps": steps, "map_calls_request": request,
            "map_calls_premap": premap}  # fmt: skip


def _colocated() -> dict:
    rounds = [
        {"memx": {"elastic_kv": [_server(2, 892, 5, 58), _server(1, 882, 4, 38)], "decode_map_calls_per_step": 0.002}},
        {"memx": {"elastic_kv": [_server(5, 945, 8, 79), _server(3, 900, 6, 40)], "decode_map_calls_per_step": 0.004}},
        {"memx": {"elastic_kv": [_server(3, 900, 6, 50), _server(3, 900, 6, 50)], "decode_map_calls_per_step": 0.003}},
    ]
    return {"rounds": rounds}


def test_colocated_spans_every_server_of_every_run():
    text = mt.render_colocated(_colocated())
    assert "2 memx servers, 3 runs" in text
    assert "1–5 groups mapped on the request path during decode per server and run, in 882–945 decode steps" in text
    assert "(0.0030 [0.0020, 0.0040] per step over the rounds)" in text
    assert "4–8 request-path maps in all (prefill too) and 38–79 premapped off the path" in text


def _variant(maps, premaps, p50, p99):
    return {"request_path_maps_per_step": maps, "premap_calls": premaps, "p50_us": p50, "p99_us": p99}


def _pool_decode(premapped_maps=0.0) -> dict:
    variants = {"on_demand": _variant(0.004, 0, 21.53, 194.85),
                "premapped": _variant(premapped_maps, 81, 21.32, 176.77),
                "stock": _variant(0.0, 0, 19.5, 155.75)}  # fmt: skip
    params = {"requests": 16, "steps": 20000}
    return {"command": "python benchmark/micro/pool_decode.py ", "where": "CPU", "params": params, "variants": variants}


def test_pool_decode_quotes_maps_premaps_and_costs():
    text = mt.render_pool_decode(_pool_decode())
    assert "`python benchmark/micro/pool_decode.py` (" in text and "16 decoding requests, 20,000 steps" in text
    assert "on-demand mapping 0.004 map calls per step on the request path, premapped **0.000** (81 premaps" in text
    assert "p50 21.5 / 21.3 / 19.5 µs" in text and "p99 195 / 177 / 156 µs" in text


def test_a_changed_figure_fails_the_check(tmp_path, monkeypatch):
    result = tmp_path / "pool_decode.json"
    result.write_text(json.dumps(_pool_decode()))
    monkeypatch.setattr(mt, "POOL_DECODE", result)
    doc = tmp_path / "elastic-kv.md"
    doc.write_text(mt.DOC.read_text())
    monkeypatch.setattr(mt, "DOC", doc)
    assert mt.main([]) == 0 and mt.main(["--check"]) == 0
    result.write_text(json.dumps(_pool_decode(premapped_maps=0.001)))
    assert mt.main(["--check"]) == 1
