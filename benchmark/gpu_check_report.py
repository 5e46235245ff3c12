"""The report of ``scripts/gpu_check.sh``: the GPU tests' outcome and the micro benchmarks' results
against the goals, printed as a table and written as JSON.

Goals (issue 29):
  * map <= 10 us: ``vmm_map_cuda.json`` map + unmap p50 (an upper bound of map alone);
  * restore >= 90 % of pinned H2D: ``weights_restore_cuda.json`` restore_fraction_of_reference;
  * >= 95 % hidden: ``weights_restore_cuda.json`` hidden_fraction;
  * zero driver calls per decode step at steady state: ``pool_decode_host.json``, the
    premapped variant's map calls on the request path per step (the mechanism is backend-free).
A goal whose result file or field is missing is reported as not met ("missing").

    python benchmark/gpu_check_report.py --junit RESULTS/gpu-tests.xml --results DIR --out FILE.json
Exit status 0 when the tests passed and every goal is met, else 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# name, result file, path of keys in it, comparison, threshold, unit
GOALS = (
    ("map latency (map+unmap p50)", "vmm_map_cuda.json", ("map_unmap", "p50_us"), "<=", 10.0, "us"),
    ("restore vs pinned H2D", "weights_restore_cuda.json", ("restore_fraction_of_reference",), ">=", 0.90, ""),
    ("copy hidden behind compute", "weights_restore_cuda.json", ("hidden_fraction",), ">=", 0.95, ""),
    (
        "driver calls per decode step (steady state)",
        "pool_decode_host.json",
        ("variants", "premapped", "request_path_maps_per_step"),
        "<=",
        0.0,
        "",
    ),
)


def _lookup(doc, keys):
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc if isinstance(doc, (int, float)) and not isinstance(doc, bool) else None


def evaluate(results_dir: Path) -> list[dict]:
    """One row per goal: its value (None when missing) and whether it is met."""
    rows = []
    for name, file, keys, op, threshold, unit in GOALS:
        path = results_dir / file
        try:
            value = _lookup(json.loads(path.read_text()), keys)
        except (OSError, ValueError):
            value = None
        met = value is not None and (value <= threshold if op == "<=" else value >= threshold)
        rows.append(dict(goal=name, value=value, want=f"{op} {threshold:g}{unit}", met=met, source=f"{file}"))
    return rows


def junit_counts(junit: Path) -> dict:
    """Totals of a pytest ``--junitxml`` file (all zero when it is missing)."""
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return counts | {"missing": True}
    for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    return counts


def report(junit: Path, results_dir: Path, extra: dict | None = None) -> dict:
    tests = junit_counts(junit)
    goals = evaluate(results_dir)
    ok = not tests.get("missing") and tests["failures"] == 0 and tests["errors"] == 0
    return dict(extra or {}, tests=tests, goals=goals, ok=ok and all(g["met"] for g in goals))


def render(doc: dict) -> str:
    t = doc["tests"]
    lines = [
        f"test/gpu: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped"
        + (" (no result file)" if t.get("missing") else ""),
        f"{'goal':46} {'value':>12} {'want':>10}  met",
    ]
    for g in doc["goals"]:
        value = "missing" if g["value"] is None else f"{g['value']:.4g}"
        lines.append(f"{g['goal']:46} {value:>12} {g['want']:>10}  {'yes' if g['met'] else 'NO'}")
    lines.append("all goals met, tests passed" if doc["ok"] else "NOT all goals met / tests passed")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", default="", help="the GPU's name, recorded in the JSON")
    args = ap.parse_args(argv)
    doc = report(args.junit, args.results, {"gpu": args.gpu})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(render(doc))
    print(f"wrote {args.out}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
