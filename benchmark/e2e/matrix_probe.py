"""A diagnostic, not a benchmark: where memx's cost goes in one cell of the no-harm matrix.

One workload of ``benchmark/matrix_workloads.py`` at one SLO scale, on setups started once and
played in interleaved rounds (the order rotating, ``benchmark/pairs.py``'s rule):

* ``stock``: the matrix's stock servers of one candidate split (``--split``, default ``need``);
* one ``sglang-memx serve`` per variant (``--variants``): ``lend`` (the defaults: idle-core
  lending on) and ``nolend`` (``lend_idle_cores: false``), and either with ``-nocap`` (no
  ``tpot_slo_ms``: the governor caps no batch) and then ``-passive``, ``-spin10k`` or ``-spin``
  (the engines' OpenMP wait set in ``serve``'s environment: ``OMP_WAIT_POLICY=PASSIVE``,
  ``GOMP_SPINCOUNT=10000`` or libgomp's default 300000), each with the matrix's ``models.yaml``
  at the scale (``--memx-host-buffer-gb 1``, every model's SLOs); its engines are reached at
  their own ports, and through the router too for the variants in ``--routed``.

Per run it records every model's median TTFT / TPOT and how many requests met each SLO, each memx
engine's counters after the run (``engines``: the governor's decisions by reason, the shared pool's
borrowed / returned / denied / reclaims, totals since the engine started), the CPU
seconds and minor page faults of each process role over the run (scheduler, detokenizer,
tokenizer / HTTP, the router), and, for memx, each engine's ``/memx/status`` polled every
``--poll-s`` (0: not polled; polling costs the engines a little): the running batch, the
governor's cap and reason, its measured decode step, the cores the engine computes on and the
whole-device trial's phase and reason. Prints one line per run; ``--out`` writes the JSON.
Nothing is scored against a claim; memx's serves live across the rounds (the matrix starts a
fresh one per run), so lending's trials and back-offs carry over.

    python benchmark/e2e/matrix_probe.py [--workload bursty2] [--scale 2] [--rounds 4]
        [--variants lend,nolend] [--routed lend] [--poll-s 0.5] [--out PATH]

The JSON goes to ``benchmark/results/e2e/probes/<workload>_x<scale>_<variants>_<code>.json``
unless ``--out`` says otherwise; ``benchmark/probe_table.py`` renders the docs' figures from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

import benchmark.e2e.matrix as M  # noqa: E402
from benchmark.e2e.consolidation import model_specs  # noqa: E402
from benchmark.e2e.router_proc import Serve, http_json  # noqa: E402
from benchmark.matrix_score import score_run  # noqa: E402
from benchmark.matrix_workloads import WORKLOADS, candidate_splits, memory_plan, schedule  # noqa: E402
from benchmark.provenance import code_version  # noqa: E402
from sglang_memx.models.tiny import tiny_model  # noqa: E402

MODELS_ROOT = Path("/tmp/sglang-memx-bench-models")
PROBES = REPO / "benchmark" / "results" / "e2e" / "probes"
WHOLE_FIELDS = ("phase", "reason", "paid", "refused", "trials")
# A variant: ``lend`` or ``nolend``, then optionally ``-nocap`` (the models' TPOT SLOs left out),
# then optionally an OpenMP wait for the engines (the ``serve`` process's environment, which the
# launcher leaves alone when it says how OpenMP threads wait: ``engine_specs``).
OMP_WAITS = {"": {}, "-passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "-spin10k": {"GOMP_SPINCOUNT": "10000"},
             "-spin": {"GOMP_SPINCOUNT": "300000"}}  # fmt: skip
VARIANTS = tuple(f"{lend}{cap}{omp}" for lend in ("lend", "nolend") for cap in ("", "-nocap") for omp in OMP_WAITS)


def role_of(cmdline: str) -> str:
    """A process's role from its command line (upstream's process titles for its children)."""
    if "sglang::scheduler" in cmdline:
        return "scheduler"
    if "sglang::detokenizer" in cmdline:
        return "detokenizer"
    if "sglang_memx.cli serve" in cmdline:
        return "router"
    if "sglang.launch_server" in cmdline:
        return "tokenizer/http"
    return "other"


def usage(root_pids) -> dict[tuple[int, str], tuple[float, int]]:
    """(pid, role) -> (CPU seconds, minor faults) of every process in the trees of ``root_pids``."""
    out = {}
    for pid in root_pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                out[(p.pid, role_of(" ".join(p.cmdline())))] = (t.user + t.system, _minor_faults(p.pid))
            except (psutil.Error, OSError):
                pass
    return out


def _minor_faults(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])  # minflt: the 10th field of /proc/<pid>/stat (the 8th after the name)


def usage_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per role: CPU seconds and minor faults spent between two ``usage`` readings (a process
    that started in between counts from zero)."""
    out: dict[str, dict[str, float]] = {}
    for key, (cpu, faults) in after.items():
        cpu0, faults0 = before.get(key, (0.0, 0))
        role = out.setdefault(key[1], {"cpu_s": 0.0, "minor_faults": 0})
        role["cpu_s"] = round(role["cpu_s"] + cpu - cpu0, 3)
        role["minor_faults"] += faults - faults0
    return dict(sorted(out.items()))


def poll_sample(doc: dict, model: str, now: float) -> dict:
    """The fields of one engine's ``/memx/status`` this probe keeps."""
    sched = doc["schedulers"][0]
    gov = (sched.get("elastic_kv") or {}).get("governor") or {}
    share = sched.get("compute_share") or {}
    whole = share.get("lending_whole_device") or {}
    return {"t": now, "model": model, "running": gov.get("running"), "cap": gov.get("batch_cap"),
            "cap_reason": gov.get("batch_cap_reason"), "decode_step_ms": gov.get("measured_decode_step_ms"),
            "cores": share.get("cores"), "whole_device": {k: whole.get(k) for k in WHOLE_FIELDS}}  # fmt: skip


def engine_counters(doc: dict) -> dict:
    """Counters of one engine's ``/memx/status`` read once after a run (totals since it started):
    the governor's decisions by reason and the shared pool's traffic."""
    kv = doc["schedulers"][0].get("elastic_kv") or {}
    pool = kv.get("shared_pool") or {}
    traffic = ("borrowed_total", "returned_total", "denied_total", "reclaim_requests")
    return {"decisions": (kv.get("governor") or {}).get("decisions"), "pool": {k: pool.get(k) for k in traffic}}


def per_model(requests: list[dict], solo: dict, scale: float) -> dict:
    out = {}
    for m in solo:
        ok = [r for r in requests if r["model"] == m and "error" not in r]
        if not ok:
            out[m] = {"n": 0}
            continue
        out[m] = {"n": len(ok), "ttft_ms": round(statistics.median(r["ttft"] for r in ok) * 1e3, 2),
                  "tpot_ms": round(statistics.median(r["tpot"] for r in ok) * 1e3, 3),
                  "ttft_met": sum(r["ttft"] <= scale * solo[m]["ttft_s"] for r in ok),
                  "tpot_met": sum(r["tpot"] <= scale * solo[m]["tpot_s"] for r in ok)}  # fmt: skip
    return out


def _poll(urls: dict[str, str], every_s: float, stop: threading.Event, out: list) -> None:
    while not stop.wait(every_s):
        for model, url in urls.items():
            try:
                out.append(poll_sample(http_json(url + "/memx/status"), model, time.monotonic()))
            except (OSError, KeyError, IndexError) as e:
                out.append({"t": time.monotonic(), "model": model, "error": str(e)})


def variant_config(doc: dict, variant: str) -> dict:
    """The matrix's ``serve`` config ``doc`` for one of ``VARIANTS`` (edited in place, returned)."""
    doc["devices"][0]["lend_idle_cores"] = variant.split("-")[0] == "lend"
    if "-nocap" in variant:  # no TPOT SLO reaches the engines: the governor caps no batch
        for m in doc["models"]:
            m.pop("tpot_slo_ms", None)
    doc["launch"]["log_dir"] += f"-probe-{variant}"
    return doc


def variant_env(variant: str) -> dict[str, str]:
    """The OpenMP wait variables a variant adds to its ``serve`` process's environment."""
    return next((env for suffix, env in OMP_WAITS.items() if suffix and variant.endswith(suffix)), {})


def _serve(w, paths, plan, solo, scale: float, variant: str, tmp: Path) -> Serve:
    port = M.free_port()
    cfg = M.serve_config(w, paths, plan, solo, scale, ["--memx-host-buffer-gb", "1"], port, tmp)
    doc = variant_config(json.loads(cfg.read_text()), variant)
    cfg = cfg.with_name(f"probe-{variant}.yaml")
    cfg.write_text(json.dumps(doc))
    return Serve(cfg, port, f"matrix-probe-{variant}", env=variant_env(variant))


def run(args) -> dict:
    w = WORKLOADS[args.workload]
    specs = model_specs()
    paths = {n: tiny_model(specs[n], MODELS_ROOT) for n in w.models}
    sched = schedule(w)
    plan = memory_plan(w, M.model_sizes(w, paths, sched))
    split = next(s for s in candidate_splits(w, plan) if s.name == args.split)
    tmp = Path("/tmp/sglang-memx-matrix-probe")
    tmp.mkdir(exist_ok=True)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    stock, serves = M.stock_servers(w, split, paths, plan), {}
    try:
        for s in stock.values():
            s.start()
        for s in stock.values():
            s.wait_ready(900)
        solo = M.measure_solo(stock, w)
        serves = {v: _serve(w, paths, plan, solo, args.scale, v, tmp) for v in args.variants}
        for s in serves.values():
            s.wait_ready()
        setups = {"stock": ({n: s.url for n, s in stock.items()}, {}, [s.proc.pid for s in stock.values()])}
        for v, s in serves.items():
            engines = {n: e["url"] for n, e in http_json(s.url + "/memx/serve")["models"].items()}
            setups[v] = (engines, engines, [s.proc.pid])
            if v in args.routed:
                setups[f"{v}-router"] = ({n: f"{s.url}/models/{n}" for n in w.models}, engines, [s.proc.pid])
        for urls, _, _ in setups.values():
            for url in urls.values():
                M.stream_one(url, "warm up", 4)
        names, runs = list(setups), {k: [] for k in setups}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                urls, status_urls, pids = setups[name]
                M.flush(urls.values())
                samples, stop = [], threading.Event()
                poller = threading.Thread(target=_poll, args=(status_urls, args.poll_s, stop, samples), daemon=True)
                if status_urls and args.poll_s > 0:
                    poller.start()
                before = usage(pids)
                out = M.play_run(urls, sched, w)
                used = usage_delta(before, usage(pids))
                stop.set()
                if poller.is_alive():
                    poller.join()
                att = score_run(out["requests"], solo, args.scale, out["wall_s"])["attainment"]
                counters = {m: engine_counters(http_json(u + "/memx/status")) for m, u in status_urls.items()}
                run_doc = {"attainment": att, "models": per_model(out["requests"], solo, args.scale),
                           "usage": used, "polls": samples, "engines": counters,
                           "requests": out["requests"]}  # fmt: skip
                runs[name].append(run_doc)
                print(r, name, round(att, 3), json.dumps(run_doc["models"]), json.dumps(used), flush=True)
        return {"command": " ".join(sys.argv), "when": when, "code": code_version(),
                "workload": w.name, "scale": args.scale, "split": split.name,
                "solo": solo, "runs": runs,
                "attainment": {k: statistics.median(x["attainment"] for x in v) for k, v in runs.items()}}  # fmt: skip
    finally:
        for s in serves.values():
            s.stop()
        for s in stock.values():
            s.stop()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="bursty2", choices=sorted(WORKLOADS))
    ap.add_argument("--scale", type=float, default=2.0)
    ap.add_argument("--split", default="need")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["lend", "nolend"])
    ap.add_argument("--routed", type=lambda s: [x for x in s.split(",") if x], default=["lend"])
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the JSON (default: benchmark/results/e2e/probes/, named by default_out)",
    )
    args = ap.parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: {bad[0]!r} is not one of {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.scale <= 0 or args.poll_s < 0:
        ap.error("--rounds must be >= 1, --scale > 0 and --poll-s >= 0")
    return args


def default_out(args, code: str) -> Path:
    """``probes/<workload>_x<scale>_<variants>_<code>.json``: where the docs' renderer
    (``benchmark/probe_table.py``) reads a probe, under the name the script gives it."""
    return PROBES / f"{args.workload}_x{args.scale:g}_{'+'.join(args.variants)}_{code}.json"


def main(argv=None) -> int:
    args = parse_args(argv)
    doc = run(args)
    print(json.dumps(doc["attainment"]))
    out = args.out if args.out is not None else default_out(args, doc["code"])
    out.write_text(json.dumps(doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
