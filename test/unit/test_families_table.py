"""docs/models.md's family table is what ``benchmark/families_table.py`` renders from
``benchmark/results/families/probe.json``; the probe's log parsing finds upstream's refusal and pool."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmark import families_probe as fp  # noqa: E402
from benchmark import families_table as ft  # noqa: E402


def test_docs_block_matches_the_json():
    assert ft.main(["--check"]) == 0, "run: python -m benchmark.families_table"


def _row(key, answered, started=None, refusal=None, pool=None, extra=()):
    model = {"architecture": "XForCausalLM", "layers": 2, "hidden_size": 64, "weights_bytes": 300_000}
    return {"key": key, "family": key, "model": model, "extra_args": list(extra), "answered": answered,
            "started": answered if started is None else started, "startup_s": 80.4 if answered else None,
            "pool_class": pool, "upstream_refusal": refusal}  # fmt: skip


def _doc(rows):
    return {"command": "probe", "time": "t", "sglang": "0.5.23", "machine": {"cpus": 2}, "flags": ["--device", "cpu"],
            "max_new_tokens": 8, "prompt": "p", "probes": rows}  # fmt: skip


def test_each_row_says_what_the_probe_saw_and_nothing_about_memx():
    text = ft.render(_doc([
        _row("a", True, pool="MHATokenToKVPool", extra=("--tp", "2")),
        _row("b", False, refusal="f.py:3 in g: assert x | y -> AssertionError"),
        _row("c", False, started=True),
    ]))  # fmt: skip
    rows = [ln for ln in text.splitlines() if ln.startswith(("| a", "| b", "| c"))]
    assert len(rows) == 3 and all(r.endswith("| not yet tested with memx |") for r in rows)
    assert "**runs**" in rows[0] and "`MHATokenToKVPool`" in rows[0] and "`--tp 2`" in rows[0] and "| 80 |" in rows[0]
    assert "**does not start**" in rows[1] and "`f.py:3 in g: assert x \\| y -> AssertionError`" in rows[1]
    assert "**started, did not answer**" in rows[2] and "0.30 MB" in rows[2]


TRACEBACK = """[t] Scheduler hit an exception: Traceback (most recent call last):
  File "/env/site-packages/sglang/srt/models/x.py", line 10, in build
    layer = make()
            ^^^^^^
  File "/env/site-packages/sglang/srt/layers/rope.py", line 478, in get_rope_cpu
    assert rope_scaling is not None
           ^^^^^^^^^^^^^^^^^^^^^^^^
AssertionError
[t] Received sigquit from a child process. It usually means the child failed.""".splitlines()


def test_refusal_quotes_the_raising_statement_and_exception():
    assert fp.refusal(TRACEBACK) == (
        "sglang/srt/layers/rope.py:478 in get_rope_cpu: assert rope_scaling is not None -> AssertionError"
    )
    below = ["Traceback (most recent call last):",
             '  File "/env/site-packages/sglang/srt/models/m.py", line 252, in __init__',
             "    device=torch.get_device_module().current_device(),",
             '  File "/env/site-packages/torch/cuda/__init__.py", line 591, in _lazy_init',
             "    torch._C._cuda_init()",
             "RuntimeError: Found no NVIDIA driver"]  # fmt: skip
    assert fp.refusal(below) == (
        "sglang/srt/models/m.py:252 in __init__: device=torch.get_device_module().current_device(), "
        "-> torch/cuda/__init__.py:591 in _lazy_init -> RuntimeError: Found no NVIDIA driver"
    )
    assert fp.refusal(["ValueError: bad --tp"]) == "ValueError: bad --tp"
    assert fp.refusal(["[t] all fine"]) is None


def test_pool_class_from_upstreams_allocation_lines():
    mha = ["[t] server_args={'swa_full_tokens_ratio': 0.8}", "[t] KV Cache is allocated. dtype: bf16, #tokens: 8, "
           "K size: 0.00 GB, V size: 0.00 GB"]  # fmt: skip
    assert fp.pool_evidence(mha) == ["KV Cache is allocated. dtype: bf16, #tokens: 8, K size: 0.00 GB, V size: 0.00 GB"]
    assert fp.pool_class(fp.pool_evidence(mha)) == "MHATokenToKVPool"
    assert fp.pool_class(["KV Cache is allocated. dtype: bf16, #tokens: 8, KV size: 0.00 GB"]) == "MLATokenToKVPool"
    assert fp.pool_class(["Mamba Cache is allocated. max_mamba_cache_size: 4"]) == "HybridLinearKVPool + MambaPool"
    swa = ["[t] Full KV Cache is allocated. dtype: bf16, #tokens: 8, K size: 0.00 GB, V size: 0.00 GB",
           "[t] SWA KV Cache is allocated. dtype: bf16, #tokens: 6, K size: 0.00 GB, V size: 0.00 GB",
           "[t] SWAKVPool mem usage: 0.00 GB, swa size: 6, full size: 8"]  # fmt: skip
    assert len(fp.pool_evidence(swa)) == 3 and fp.pool_class(fp.pool_evidence(swa)) == "SWAKVPool"
    assert fp.pool_class([]) is None


def _memx_doc():
    works = {"verdict": "works", "test": "test/integration/test_families.py",
             "evidence": {"retractions": 12, "groups_unmapped_total": 27, "group_bytes": 1}}  # fmt: skip
    refused = {"verdict": "refused", "message": "argument --memx-elastic-kv: M is served from upstream's P | x",
               "stage": "launch (argument parsing)"}  # fmt: skip
    model = {"architecture": "XForCausalLM", "layers": 2, "hidden_size": 64, "weights_bytes": 300_000}
    rows = [{"key": "sliding_window", "family": "g", "model": model, "extra_args": [], "env": {},
             "cells": {"elastic_kv": works, "host_buffer": works, "weights": works, "peer_kv": works}},
            {"key": "swa_mellum", "family": "m", "model": model, "extra_args": [], "env": {},
             "cells": dict.fromkeys(ft.FEATURE_NAMES, refused)},
            {"key": "mla", "family": "d", "model": model, "extra_args": ["--tp", "2"], "env": {},
             "cells": {"all": refused}},
            {"key": "fp8_kv", "family": "f", "model": model, "extra_args": [], "env": {},
             "cells": {"all": {"verdict": "upstream", "note": "memx refuses it too"}}}]  # fmt: skip
    return {"command": "c", "sglang": "0.5.23", "common_args": ["--dtype", "float32"], "rows": rows}


def test_the_memx_table_quotes_verdicts_counters_and_numbered_refusals():
    text = ft.render_memx(_memx_doc())
    rows = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ") and " | " in ln}
    assert rows["g"].count("**works on CPU**, greedy = stock (`test_families.py`") == 4
    assert "retractions 12, groups unmapped total 27)" in rows["g"] and "group bytes" not in rows["g"]
    assert rows["m"].count("**refused** at launch [1]") == 4 and rows["d"].count("[1]") == 4
    assert "`--tp 2`" in rows["d"] and rows["f"].count("upstream does not run it on CPU [2]") == 4
    notes = [ln for ln in text.splitlines() if ln[:3] in ("1. ", "2. ", "3. ")]
    assert notes == ["1. `argument --memx-elastic-kv: M is served from upstream's P \\| x`", "2. `memx refuses it too`"]


def test_the_probe_tables_memx_column_points_to_the_memx_table():
    doc = _doc(
        [_row("sliding_window", True), _row("swa_mellum", True), _row("new_probe", False), _row("fp8_kv", False)]
    )
    text = ft.render(doc, _memx_doc())
    column = {ln.split(" | ")[0][2:]: ln.rsplit(" | ", 1)[1] for ln in text.splitlines() if ln.startswith("| ")}
    assert column["sliding_window"] == "every feature works (table below) |"
    assert column["swa_mellum"] == "refused at launch (table below) |"
    assert column["new_probe"] == "not yet tested with memx |"  # a probe without a memx.json row
    assert column["fp8_kv"] == "see the table below |"


def test_a_pool_level_cell_names_its_test_and_quotes_upstreams_failure_once():
    doc = _memx_doc()
    pool_level = {"verdict": "pool_level", "test": "test/unit/test_mla_elastic_pool.py", "built": "memx: elastic KV",
                  "note": "x.py:1 in f: g() -> RuntimeError: y"}  # fmt: skip
    doc["rows"][2]["cells"] = {"elastic_kv": pool_level, "host_buffer": pool_level,
                               "weights": doc["rows"][1]["cells"]["weights"], "peer_kv": pool_level}  # fmt: skip
    text = ft.render_memx(doc)
    row = next(ln for ln in text.splitlines() if ln.startswith("| d |"))
    assert row.count("**pool level on CPU** (`test_mla_elastic_pool.py`)") == 3 and row.count("stock [2]") == 3
    assert "**refused** at launch [1]" in row and "2. `x.py:1 in f: g() -> RuntimeError: y`" in text
