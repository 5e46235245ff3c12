"""Render the "bench_serving against scripts/serve.sh" blocks from their JSON (written by
``benchmark/e2e/bench_serving.py``): ``docs/router.md``'s from ``bench_serving.json`` (serve.sh's
default features) and ``docs/governor.md``'s from ``bench_serving_governor.json`` (the same with
``--memx-governor``) and ``bench_serving_governor_baseline.json`` (the default features again, run
right after it on the same machine) and ``bench_serving_2026-12-06.json`` (the default features, re-run
two days and many changes later) and ``bench_serving_replan.json`` (the same after d97f72e) and
``bench_serving_default_slo.json`` (``--same-window``: stock, serve.sh's defaults and the same with
``--memx-governor`` holding its measured default TPOT SLO), and
``docs/router.md``'s same-window block from
``bench_serving_same_window.json`` (``--same-window``: stock, serve.sh's defaults and the same with
``--memx-governor``, all up at once), and its step block from ``bench_serving_steps.json`` (the same
window with ``--serve-args "--decode-log-interval 1"``: decode step time by batch size, from the
engines' own logs), and the block after the main one from ``bench_serving_default_spin.json`` (the main
run's setups with ``GOMP_SPINCOUNT=300000``, libgomp's default, in every setup's environment: the
launcher then leaves OpenMP's wait policy alone) and ``bench_serving_spin10k.json`` (the same with
``GOMP_SPINCOUNT=10000``); the figures in the docs are the JSON's, never typed.

    python -m benchmark.bench_serving_table           # rewrite the blocks
    python -m benchmark.bench_serving_table --check   # exit 1 when the docs differ from the JSON

``test/unit/test_bench_serving_table.py`` runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.doc_blocks import check_args, write_or_check
from benchmark.figures import median_range
from benchmark.step_log import BINS, MIN_STEPS, bin_key

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "router.md"
RESULT = REPO / "benchmark" / "results" / "e2e" / "bench_serving.json"
BEGIN = "<!-- generated: python -m benchmark.bench_serving_table -->"
END = "<!-- end generated: bench_serving -->"


def _labelled(doc: Path, result: str, label: str) -> tuple[Path, Path, str, str]:
    """A block after the main one: ``result`` (a JSON beside ``RESULT``) rendered into ``doc``
    between the markers named by ``label``."""
    return (doc, RESULT.with_name(result), f"<!-- generated: python -m benchmark.bench_serving_table ({label}) -->",
            f"<!-- end generated: bench_serving ({label}) -->")  # fmt: skip


GOVERNOR_DOC = REPO / "docs" / "governor.md"
# (doc, result, begin marker, end marker) for each rendered block
BLOCKS = (
    (DOC, RESULT, BEGIN, END),
    _labelled(GOVERNOR_DOC, "bench_serving_governor.json", "governor"),
    _labelled(GOVERNOR_DOC, "bench_serving_governor_baseline.json", "governor baseline"),
    _labelled(GOVERNOR_DOC, "bench_serving_2026-12-06.json", "2026-12-06"),
    _labelled(GOVERNOR_DOC, "bench_serving_replan.json", "replan"),
    _labelled(GOVERNOR_DOC, "bench_serving_default_slo.json", "default SLO"),
    _labelled(DOC, "bench_serving_elastic_only.json", "elastic KV only"),
    _labelled(DOC, "bench_serving_same_window.json", "same window"),
    _labelled(DOC, "bench_serving_steps.json", "steps"),
    _labelled(DOC, "bench_serving_default_spin.json", "default spin"),
    _labelled(DOC, "bench_serving_spin10k.json", "spin 10k"),
    _labelled(DOC, "bench_serving_passive.json", "passive"),
)

_LABELS = {
    "request_throughput": "request throughput (req/s)",
    "output_throughput": "output throughput (tok/s)",
    "median_ttft_ms": "TTFT p50 (ms)",
    "tail_ttft_ms": "TTFT {tail} (ms)",
    "median_tpot_ms": "TPOT p50 (ms)",
}


def _intro(doc: dict, n: int) -> str:
    features = f", memx flags `{doc['memx_features']}`" if "memx_features" in doc else ""
    memx = ("`scripts/serve.sh --single` (one memx server" if doc.get("memx_serve") == "single"
            else "`scripts/serve.sh` (memx: router + two engines, only the bf16 model loaded")  # fmt: skip
    env = " ".join(f"{k}={v}" for k, v in (doc.get("environment") or {}).items())
    env = f", every setup started with `{env}` in its environment" if env else ""
    head = f"`{doc['command']}`, {n} interleaved rounds ({doc['time']}, {doc['machine']['cpus']} CPUs{env}); "
    if doc.get("mode") == "same_window":
        variants = "".join(f"; `{s}`: memx flags `{v['memx_features']}`" for s, v in doc["setups"].items()
                           if s not in ("stock", "memx"))  # fmt: skip
        how = (f"every setup started once with `--sleep-on-idle` and kept up, the rounds alternating between them: "
               f"{memx}{features}){variants}; stock: `scripts/serve.sh --memx-disable`. ")  # fmt: skip
    else:
        how = (f"each run on a freshly started {memx}{features}) or `scripts/serve.sh --memx-disable` "
               "(stock). ")  # fmt: skip
    return head + how + "Per setup: median [min, max] over the runs; ratio to stock: median [min, max] over the rounds."


def render(doc: dict, begin: str = BEGIN, end: str = END) -> str:
    rounds = doc["rounds"]
    setups = list(doc.get("setups", ("stock", "memx")))
    others = [s for s in setups if s != "stock"]
    by_setup = doc.get("ratios_by_setup", {"memx": doc["ratios"]})
    claims = doc.get("claims_by_setup", {"memx": doc["claims"]})
    lines = [
        begin,
        _intro(doc, len(rounds)),
        "",
        "| metric | " + " | ".join(setups) + " | " + " | ".join(f"{s} / stock" for s in others) + " |",
        "|---|" + "---|" * (len(setups) + len(others)),
    ]
    served = [", ".join(str(r[s]["completed"]) for r in rounds) for s in setups]
    lines.append("| requests answered per run | " + " | ".join(served) + " |" + " |" * len(others))
    for key, label in _LABELS.items():
        row = [label.format(tail=doc["tail"])]
        row += [median_range([r[s][key] for r in rounds], ".4g") for s in setups]
        for s in others:
            st = by_setup[s][key]
            row.append(f"{st['median']:.3g} [{st['min']:.3g}, {st['max']:.3g}]")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for s in others:
        prefix = "Claims" if others == ["memx"] else f"Claims ({s})"
        lines.append(prefix + ": " + "; ".join(f"{k} **{'yes' if v else 'no'}**" for k, v in claims[s].items()) + ".")
    if "step_ratios_by_setup" in doc:
        lines += ["", *_step_table(doc, setups, others)]
    lines.append(end)
    return "\n".join(lines)


def _step_table(doc: dict, setups: list[str], others: list[str]) -> list[str]:
    """Decode step time by batch size (``benchmark.step_log``): per setup the median [min, max] over
    the runs that timed >= ``MIN_STEPS`` steps in the bin of each one's median step time (and the
    steps they timed, summed), per other setup its ratio to stock over the rounds where both did;
    then the prefill forwards and the tokens they computed, per run."""
    rounds = doc["rounds"]
    lines = [
        "Decode step time by batch size, from the engines' own per-step log lines (a decode line right after "
        "another: one step). Per setup: each run's median step (ms), median [min, max] over the runs that timed "
        f">= {MIN_STEPS} steps in the bin, and the steps they timed; ratio: per round, setup / stock, where both "
        f"timed >= {MIN_STEPS}.",
        "",
        "| running requests | " + " | ".join(setups) + " | " + " | ".join(f"{s} / stock" for s in others) + " |",
        "|---|" + "---|" * (len(setups) + len(others)),
    ]
    ratios = doc["step_ratios_by_setup"]
    bins = [k for k in (bin_key(lo, hi) for lo, hi in BINS) if any(k in ratios[s] for s in others)]
    for key in bins:
        row = [key]
        for s in setups:
            runs = [x for r in rounds if (x := r[s]["steps"]["by_batch"].get(key)) and x["steps"] >= MIN_STEPS]
            p50s = [x["step_ms_p50"] for x in runs]
            row.append(f"{median_range(p50s, '.4g')} ({sum(x['steps'] for x in runs)} steps)")
        for s in others:
            st = ratios[s].get(key)
            row.append(f"{st['median']:.3g} [{st['min']:.3g}, {st['max']:.3g}] ({len(st['values'])} rounds)"
                       if st else "-")  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    for field, label in (("prefill_batches", "prefill forwards per run"), ("prefill_tokens", "prefill tokens per run")):
        row = [label] + [median_range([r[s]["steps"][field] for r in rounds], ".4g") for s in setups]
        lines.append("| " + " | ".join(row) + " |" + " |" * len(others))
    return lines


def main(argv: list[str] | None = None) -> int:
    check = check_args(argv, __doc__.split("\n\n")[0])
    by_doc: dict[Path, list[tuple[str, str, str]]] = {}
    for doc, result, begin, end in BLOCKS:  # each doc read and written once, with all its blocks
        by_doc.setdefault(doc, []).append((begin, end, render(json.loads(result.read_text()), begin, end)))
    failed = 0
    for doc, blocks in by_doc.items():
        failed |= write_or_check(doc, blocks, check, "python -m benchmark.bench_serving_table")
    return failed


if __name__ == "__main__":
    sys.exit(main())
