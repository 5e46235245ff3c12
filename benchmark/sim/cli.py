"""Command line: ``python -m benchmark.sim {run,speed,hardware,models,placement}``.

Every run prints the command that produced it and writes JSON + PNG under
``benchmark/results/sim/``. A malformed scenario file prints the
``ScenarioError`` (file and field) and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .core.hardware import GPUS, calibration_rows
from .core.models import MODELS
from .mechanisms import fineserve
from .runner import RESULTS, command_line, run_scenario
from .scenario import YAML_AVAILABLE, ScenarioError, load_scenario


def _table(rows) -> str:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.sim", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a scenario file (.json" + (", .yaml" if YAML_AVAILABLE else "") + ")")
    r.add_argument("scenario")
    r.add_argument("--out", help="output path without extension (default benchmark/results/sim/<name>)")
    r.add_argument("--seed", type=int)
    r.add_argument("--duration", type=float, help="override duration_s (quick looks)")
    s = sub.add_parser("speed", help="one simulated hour, 3 models, 10 req/s; wall time vs 60 s")
    s.add_argument("--duration", type=float, help="simulate this many seconds instead of 3600")
    s.add_argument("--out", help="output path without extension")
    sub.add_parser("hardware", help="print the GPU calibration table with sources")
    sub.add_parser("models", help="print the model table with derived sizes")
    pl = sub.add_parser("placement", help="FineServe placement (Alg. 1) vs the Prism-like heuristic for a scenario")
    pl.add_argument("scenario")
    pl.add_argument("--rate-scale", type=float, default=1.0)
    args = ap.parse_args(argv)
    cmd = command_line() if argv is None else "python -m benchmark.sim " + " ".join(argv)
    if args.cmd == "hardware":
        print(_table(calibration_rows()))
        print("\nsources:")
        for g in GPUS.values():
            print(f"  {g.name}: {g.source}")
        return 0
    if args.cmd == "models":
        rows = [
            ["model", "layers", "hidden", "heads", "kv heads", "inter", "vocab", "params (B)", "KV KiB/token (bf16)"]
        ]
        for m in MODELS.values():
            rows.append(
                [
                    m.name,
                    m.layers,
                    m.hidden,
                    m.heads,
                    m.kv_heads,
                    m.intermediate,
                    m.vocab,
                    f"{m.params / 1e9:.2f}",
                    f"{m.kv_bytes_per_token() / 1024:g}",
                ]
            )
        print(_table(rows))
        return 0
    if args.cmd == "placement":
        try:
            sc = load_scenario(args.scenario)
        except ScenarioError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for d in fineserve.model_demands(sc.base, args.rate_scale):
            print(
                f"{d.name:>10}: F_M {d.footprint / 1e9:6.2f} GB (weights {d.weights / 1e9:.2f}, act "
                f"{d.activations / 1e9:.2f}, kv {d.kv_base / 1e9:.2f} at batch {d.batch}"
                f"{'' if d.rate_met else ', rate not met'}), mu {d.mu * 1e9:.0f} tok/GB, "
                f"rate/slo {d.slo_rate:.2f}"
            )
        print("fineserve:", fineserve.fineserve_placement(sc.base, args.rate_scale))
        print("prism:    ", fineserve.prism_placement(sc.base, args.rate_scale))
        return 0
    print(f"command: {cmd}")
    if args.cmd == "speed":
        from .speed import run_speed

        out = Path(args.out) if args.out else RESULTS / "speed"
        o = run_speed(args.duration, out, cmd)
        print(
            f"simulated {o['simulated_s']:.0f} s, {o['requests']} requests, {o['iterations']} iterations: "
            f"wall {o['wall_s']:.1f} s = {o['ratio_to_target']:.2f} x the {o['target_s']:.0f} s target"
        )
        print(f"wrote {out.with_suffix('.json')} and .png")
        return 0
    try:
        sc = load_scenario(args.scenario)
        out = Path(args.out) if args.out else RESULTS / sc.base.name
        run_scenario(sc, out, cmd, args.seed, args.duration)
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out.with_suffix('.json')} and .png")
    return 0
