"""Peer KV tier, prefix reuse: stock (recompute) vs upstream HiCache host tier vs the memx peer
tier, measured in repeated interleaved rounds on one machine (issue 16; docs/peer-kv.md).

Every setup is a *pair* of servers of one model in the same total memory:

* a **borrower side** whose KV (``--borrower-tokens`` B) is smaller than the working set of
  several multi-turn conversations, so earlier turns' prefixes get evicted;
* a **donor side** (``--donor-tokens`` D) that is lightly loaded (one short request every
  ``--donor-gap-s``) and can spare ``--lend-tokens`` X of its KV.

Setups:

* ``stock``: two stock SGLang servers, KV B and D (static split: an evicted prefix is recomputed).
* ``hicache``: stock SGLang with upstream's ``--enable-hierarchical-cache``: the borrower side has
  device KV B plus a host pool of X tokens (``--hicache-ratio X/B``), the donor side D - X.
* ``memx``: a ``--memx-peer-kv borrow`` server (B) and a ``--memx-peer-kv donate`` server (D,
  lending at most X: ``--memx-peer-donate-max-gb``) on one ``--memx-pool`` whose budget is
  (B + D) tokens of KV plus both servers' prefill activations (stock keeps activations outside).

Workload (the same token ids for every setup in a round, fresh conversations every round, so a
tier never serves a prefix it kept from an earlier round): ``--convs`` conversations of
``--turns`` turns on the borrower side, one request at a time, conversation-round-robin (turn 1
of every conversation, then turn 2 of every conversation, ...). A turn's prompt is the previous
turn's prompt, the server's own greedy answer (``--new-tokens``) and ``--user-tokens`` new user
tokens; turn 1 is ``--first-tokens`` tokens. When a conversation comes back, the others' turns
have passed through the borrower's KV, so its prefix was evicted (working set > B).

Per setup and round: streaming TTFT P50 / P99 of the returning turns (turn >= 2: the only
requests a prefix tier can help; all turns too), the hit rate (upstream's ``cached_tokens`` of
the returning turns / their prompt tokens; HiCache's host share from ``cached_tokens_details``;
memx's peer share from ``/memx/status`` ``peer_kv.tokens_loaded``), and every turn's greedy
output, compared with the stock setup's of the same round (mismatches are reported, never
dropped). Ratios x/stock are per round (pairs), reported as median and range.

A setup that cannot run (e.g. HiCache on CPU) is recorded with the exact error and left out.

    python benchmark/e2e/peer_kv.py [--rounds 5] [--quick] [--setups stock,hicache,memx]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test"))
sys.path.insert(0, str(REPO))

from benchmark._stats import percentile  # noqa: E402
from benchmark.e2e.load import stream_generate  # noqa: E402
from benchmark.pairs import ratio_stats, run_rounds  # noqa: E402
from support.server import SGLangServer  # noqa: E402

RESULTS = REPO / "benchmark" / "results" / "e2e"
GIB = 1 << 30
CHUNKED_PREFILL = 64
COMMON = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNKED_PREFILL)]
SETUPS = ("stock", "hicache", "memx")
KEYS = ("ttft_p50_s", "ttft_p99_s", "ttft_all_p50_s", "ttft_all_p99_s", "hit_rate")
# peer_kv counters read before and after a run (docs/peer-kv.md "Status")
PEER_COUNTERS = ("spills", "pages_spilled", "hits", "pages_loaded", "tokens_loaded", "lookups_missed",
                 "loads_no_room", "recomputes_after_reclaim")  # fmt: skip
# what a round reports as its own delta (the borrower's ``borrowed_bytes`` is a gauge, kept apart)
PEER_DELTAS = PEER_COUNTERS + ("entries_dropped_reclaim",)


def model_spec():
    """A tiny random Llama with enough compute per token that recomputing a prefix costs
    measurably more than copying its KV (8 layers, hidden 256; float32 KV: 4 KiB a token,
    so a 16-token peer block is one 64 KiB chunk)."""
    from sglang_memx.models.tiny import TinyModelSpec

    return TinyModelSpec(arch="llama", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                         intermediate_size=1024, vocab_size=512, seed=16)  # fmt: skip


def kv_bytes_per_token(spec) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # K and V, float32


def activation_bytes(spec) -> int:
    """One CHUNKED_PREFILL-token prefill's activation in float32 (memx's own profile)."""
    from memory_ext.policy.activation import ActivationProfile

    p = ActivationProfile.from_model_dims(hidden=spec.hidden_size, intermediate=spec.intermediate_size,
                                          num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                          head_dim=spec.head_dim, vocab=spec.vocab_size, itemsize=4)  # fmt: skip
    return p.bytes_for(CHUNKED_PREFILL, 1)


def working_set_tokens(args) -> int:
    """Tokens of every conversation's last turn (prompt + answer): what the borrower would need
    to keep every prefix."""
    last = args.first_tokens + (args.turns - 1) * (args.new_tokens + args.user_tokens) + args.new_tokens
    return args.convs * last


def memory_plan(args, spec) -> dict:
    kv = kv_bytes_per_token(spec)
    act = activation_bytes(spec)
    plan = {
        "kv_bytes_per_token": kv,
        "borrower_tokens": args.borrower_tokens,
        "donor_tokens": args.donor_tokens,
        "lend_tokens": args.lend_tokens,
        "working_set_tokens": working_set_tokens(args),
        "total_kv_bytes": (args.borrower_tokens + args.donor_tokens) * kv,
        "activation_bytes_per_server": act,
        "memx_pool_budget_bytes": (args.borrower_tokens + args.donor_tokens) * kv + 2 * act,
        "memx_donate_max_bytes": args.lend_tokens * kv,
        "hicache_ratio": args.lend_tokens / args.borrower_tokens,
        "hicache_donor_tokens": args.donor_tokens - args.lend_tokens,
    }
    if args.lend_tokens >= args.donor_tokens:
        raise SystemExit(f"--lend-tokens {args.lend_tokens}: must be below --donor-tokens {args.donor_tokens}")
    if plan["working_set_tokens"] <= args.borrower_tokens:
        raise SystemExit(f"working set {plan['working_set_tokens']} tokens fits the borrower's KV "
                         f"({args.borrower_tokens}): nothing would be evicted; raise --convs / --turns")  # fmt: skip
    return plan


# ----------------------------------------------------------------------------- servers
def make_servers(args, model: Path, plan: dict, pool_dir: Path, pool: str) -> dict[str, dict[str, SGLangServer]]:
    """``{setup: {"borrower": server, "donor": server}}``. Borrower sides run on core 0, donor sides on
    core 1 (one OpenMP thread each), so a setup's pair never competes for a core."""
    b_env = {"SGLANG_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    d_env = {"SGLANG_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    out: dict[str, dict[str, SGLangServer]] = {}
    if "stock" in args.setups:
        out["stock"] = {
            "borrower": SGLangServer(model, name="bench-peerkv-stock-b", stock=True,
                                     max_total_tokens=args.borrower_tokens, extra_args=COMMON, env=b_env),
            "donor": SGLangServer(model, name="bench-peerkv-stock-d", stock=True,
                                  max_total_tokens=args.donor_tokens, extra_args=COMMON, env=d_env),
        }  # fmt: skip
    if "hicache" in args.setups:
        hic = ["--enable-hierarchical-cache", "--hicache-ratio", f"{plan['hicache_ratio']:g}"]
        out["hicache"] = {
            "borrower": SGLangServer(model, name="bench-peerkv-hicache-b", stock=True,
                                     max_total_tokens=args.borrower_tokens, extra_args=COMMON + hic, env=b_env),
            "donor": SGLangServer(model, name="bench-peerkv-hicache-d", stock=True,
                                  max_total_tokens=plan["hicache_donor_tokens"], extra_args=COMMON, env=d_env),
        }  # fmt: skip
    if "memx" in args.setups:
        pool_args = ["--memx-elastic-kv", "--memx-pool", pool, "--memx-pool-dir", str(pool_dir),
                     "--memx-pool-budget-gb", repr(plan["memx_pool_budget_bytes"] / GIB)]  # fmt: skip
        env = {}
        donate = ["--memx-peer-kv", "donate", "--memx-peer-donate-max-gb", repr(plan["memx_donate_max_bytes"] / GIB)]
        out["memx"] = {
            "borrower": SGLangServer(model, name="bench-peerkv-memx-b", max_total_tokens=args.borrower_tokens,
                                     extra_args=COMMON + pool_args + ["--memx-peer-kv", "borrow"],
                                     env={**b_env, **env}),
            "donor": SGLangServer(model, name="bench-peerkv-memx-d", max_total_tokens=args.donor_tokens,
                                  extra_args=COMMON + pool_args + donate, env={**d_env, **env}),
        }  # fmt: skip
    return out


def start_setups(setups: dict[str, dict[str, SGLangServer]], timeout: float) -> dict[str, str]:
    """Start the servers; a setup whose servers do not become healthy is stopped and returned as
    ``{setup: error}`` (the last ``...Error: ...`` line of the failing server's log, else its tail).

    The HiCache borrower starts alone, first: upstream refuses a host pool unless the machine's
    available RAM exceeds the pool plus a fixed 10 GiB reserve (``pool_host/base.py``), so it gets
    the machine before the other five servers take their share. The memx donor starts before the
    memx borrower (it creates the shared pool; the borrower joins it)."""
    failed = {}

    def wait(name: str, servers) -> None:
        for server in servers:
            if name in failed:
                return
            try:
                server.wait_ready(timeout)
            except (RuntimeError, TimeoutError) as exc:
                failed[name] = f"{server.name}: {error_line(server) or exc}"
        if name in failed:
            for server in setups[name].values():
                server.stop()

    if "hicache" in setups:
        wait("hicache", [setups["hicache"]["borrower"].start()])
    order = sorted((s for s in setups if s not in failed), key=lambda s: s != "memx")
    for name in order:
        setups[name]["donor"].start()
        if name == "memx":
            time.sleep(3)
        if setups[name]["borrower"].proc is None:
            setups[name]["borrower"].start()
    for name in order:
        wait(name, [setups[name]["donor"], setups[name]["borrower"]])
    return failed


def error_line(server: SGLangServer) -> str | None:
    try:
        lines = server.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    hits = [ln.strip() for ln in lines if re.match(r"^\w*(Error|Exception): ", ln.strip())]
    return hits[-1][:500] if hits else None


# ----------------------------------------------------------------------------- requests
def http_json(url: str, payload: dict | None = None, timeout: float = 300) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def stream_ids(url: str, ids: list[int], new_tokens: int, timeout: float = 600) -> dict:
    """One streaming greedy /generate of token ids: ttft, e2e, output_ids, cached tokens (or error)."""
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    try:
        ttft, e2e, last = stream_generate(url, {"input_ids": ids, "sampling_params": sampling}, timeout)
    except Exception as exc:  # noqa: BLE001 - recorded, counted as a failure
        return {"error": repr(exc)}
    if last is None or "meta_info" not in last:
        return {"error": f"stream ended without a result: {last!r}"}
    meta = last["meta_info"]
    out = list(last.get("output_ids") or [])
    if len(out) != new_tokens:
        return {"error": f"{len(out)} output ids, wanted {new_tokens} (incremental streaming?)"}
    details = meta.get("cached_tokens_details") or {}
    return {"ttft": ttft, "e2e": e2e, "output_ids": out, "prompt_tokens": len(ids),
            "cached_tokens": int(meta.get("cached_tokens", 0)), "cached_host": int(details.get("host", 0))}  # fmt: skip


def conversations(args, round_no: int, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Round ``round_no``'s first prompts and every later turn's user tokens (``user[c][t-1]``),
    the same for every setup; token ids from 3 on (0-2 are the tiny tokenizer's specials)."""
    rng = random.Random(1000 + round_no)
    first = [[rng.randrange(3, vocab) for _ in range(args.first_tokens)] for _ in range(args.convs)]
    user = [[[rng.randrange(3, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns - 1)]
            for _ in range(args.convs)]  # fmt: skip
    return first, user


def peer_counters(server: SGLangServer) -> dict:
    st = http_json(server.url + "/memx/status", timeout=30)["schedulers"][0]["peer_kv"]
    out = {k: int(st.get(k, 0)) for k in PEER_COUNTERS}
    b = st.get("borrower") or {}
    out["borrowed_bytes"] = int(b.get("borrowed_bytes", 0))
    out["entries_dropped_reclaim"] = int(b.get("entries_dropped_reclaim", 0))
    return out


def memory_status(server: SGLangServer) -> dict:
    """A memx server's KV accounting (``kv_pool``) and physical side (``elastic_kv``, without the slab and
    backend details): how much of its KV is mapped and cached after a run."""
    sched = http_json(server.url + "/memx/status", timeout=30)["schedulers"][0]
    elastic = {k: v for k, v in (sched.get("elastic_kv") or {}).items() if k not in ("slab", "backend")}
    return {"kv_pool": sched.get("kv_pool"), "elastic_kv": elastic}


class DonorLoad:
    """The donor side's light load: one short greedy request every ``gap_s`` until stopped."""

    def __init__(self, url: str, gap_s: float, vocab: int, seed: int):
        self.url, self.gap_s, self.errors, self.done = url, gap_s, [], 0
        self._rng = random.Random(seed)
        self._vocab = vocab
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.gap_s):
            ids = [self._rng.randrange(3, self._vocab) for _ in range(32)]
            r = stream_ids(self.url, ids, 8)
            if "error" in r:
                self.errors.append(r["error"][:160])
            else:
                self.done += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"requests": self.done, "errors": self.errors[:3], "failed": len(self.errors)}


def run_once(setup: str, pair: dict[str, SGLangServer], args, round_no: int, vocab: int) -> dict:
    borrower, donor = pair["borrower"], pair["donor"]
    try:
        urllib.request.urlopen(borrower.url + "/flush_cache", timeout=60).read()
    except OSError:
        pass
    before = peer_counters(borrower) if setup == "memx" else None
    first, user = conversations(args, round_no, vocab)
    convs = [list(p) for p in first]
    load = DonorLoad(donor.url, args.donor_gap_s, vocab, seed=round_no)
    results = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for c in range(args.convs):
            r = stream_ids(borrower.url, convs[c], args.new_tokens)
            r.update(conv=c, turn=turn)
            results.append(r)
            if "error" in r:  # the conversation cannot go on without its answer
                continue
            if turn + 1 < args.turns:
                convs[c] = convs[c] + r["output_ids"] + user[c][turn]
    wall = time.perf_counter() - t0
    out = summarize(results, wall)
    out["donor_load"] = load.stop()
    if setup == "memx":
        after = peer_counters(borrower)
        out["peer"] = {k: after[k] - before[k] for k in PEER_DELTAS}
        out["borrowed_bytes_after"] = after["borrowed_bytes"]  # a gauge: held at the round's end
        out["memory_after"] = {role: memory_status(server) for role, server in pair.items()}
        back = [r for r in results if "error" not in r and r["turn"] > 0]
        prompt = sum(r["prompt_tokens"] for r in back)
        # tokens_loaded counts every load, turn 1's too (none expected: fresh prefixes)
        out["peer_hit_rate"] = out["peer"]["tokens_loaded"] / prompt if prompt else float("nan")
    return out


def peer_totals(rounds: list[dict]) -> dict:
    """The memx borrower's peer counters over all rounds (each round's are its own deltas)."""
    return {k: sum(r["memx"]["peer"][k] for r in rounds) for k in PEER_DELTAS}


def borrowed_after_each_round(rounds: list[dict]) -> list[int]:
    """Bytes the memx borrower held from its donor at each round's end: a gauge, never summed."""
    return [r["memx"]["borrowed_bytes_after"] for r in rounds]


def summarize(results: list[dict], wall: float) -> dict:
    nan = float("nan")
    ok = [r for r in results if "error" not in r]
    back = [r for r in ok if r["turn"] > 0]
    ttft_back, ttft_all = [r["ttft"] for r in back], [r["ttft"] for r in ok]
    prompt = sum(r["prompt_tokens"] for r in back)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"][:160] for r in results if "error" in r})[:5],
        "ttft_p50_s": percentile(ttft_back, 0.5) if ttft_back else nan,
        "ttft_p99_s": percentile(ttft_back, 0.99) if ttft_back else nan,
        "ttft_all_p50_s": percentile(ttft_all, 0.5) if ttft_all else nan,
        "ttft_all_p99_s": percentile(ttft_all, 0.99) if ttft_all else nan,
        "hit_rate": sum(r["cached_tokens"] for r in back) / prompt if prompt else nan,
        "host_hit_rate": sum(r["cached_host"] for r in back) / prompt if prompt else nan,
        "prompt_tokens_returning": prompt,
        "wall_s": wall,
        "turns": [{k: r.get(k) for k in ("conv", "turn", "ttft", "prompt_tokens", "cached_tokens", "cached_host",
                                         "output_ids", "error")} for r in results],
    }  # fmt: skip


def mismatches(rounds: list[dict], setup: str, ref: str = "stock") -> dict:
    """Turns whose greedy output differs from the reference setup's in the same round (or failed in one)."""
    diffs, compared = [], 0
    for i, rnd in enumerate(rounds):
        if setup not in rnd or ref not in rnd:
            continue
        want = {(t["conv"], t["turn"]): t.get("output_ids") for t in rnd[ref]["turns"]}
        for t in rnd[setup]["turns"]:
            compared += 1
            w = want.get((t["conv"], t["turn"]))
            if t.get("output_ids") != w:
                diffs.append({"round": i, "conv": t["conv"], "turn": t["turn"], "got": t.get("output_ids"), "want": w})
    return {"compared": compared, "mismatched": len(diffs), "first": diffs[:5]}


def stats(values: list[float]) -> dict:
    finite = [v for v in values if v == v]
    return {"values": values, "median": statistics.median(finite) if finite else float("nan"),
            "min": min(finite, default=float("nan")), "max": max(finite, default=float("nan"))}  # fmt: skip


def plot(doc: dict, path: Path) -> None:
    """One panel per figure: each setup's median as a bar, every round as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(doc["figures"])
    panels = ("ttft_p50_s", "ttft_p99_s", "hit_rate")
    colors = {"stock": "#c44", "hicache": "#48c", "memx": "#2a7"}
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.4))
    for ax, key in zip(axes, panels):
        for x, s in enumerate(setups):
            st = doc["figures"][s][key]
            ax.bar([x], [st["median"]], color=colors.get(s, "#888"), width=0.6)
            ax.scatter([x] * len(st["values"]), st["values"], color="k", s=12, zorder=3)
        ax.set_xticks(range(len(setups)), setups)
        ax.set_title(key.replace("_s", " (s)") + " (returning turns)", fontsize=8)
    p = doc["params"]
    fig.suptitle(f"prefix reuse: {p['convs']} conversations x {p['turns']} turns, borrower KV "
                 f"{p['borrower_tokens']} tok, working set {doc['memory']['working_set_tokens']} tok, "
                 f"lend {p['lend_tokens']} tok; {p['rounds']} rounds", fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1 round, 4 conversations x 3 turns (for development)")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of " + ",".join(SETUPS))
    ap.add_argument("--convs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=192)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--borrower-tokens", type=int, default=1024, help="borrower side's KV (B)")
    ap.add_argument("--donor-tokens", type=int, default=4096, help="donor side's KV (D)")
    ap.add_argument("--lend-tokens", type=int, default=3072, help="what the donor may lend (X): memx cap, HiCache host")
    ap.add_argument("--donor-gap-s", type=float, default=1.0, help="donor side: one short request this often")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--dry-run", action="store_true", help="print the memory plan and exit")
    ap.add_argument("--out", default="peer_kv", help="results name under benchmark/results/e2e/")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.convs, args.turns = 1, 4, 3
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in args.setups if s not in SETUPS]
    if bad or not args.setups:
        ap.error(f"--setups: unknown {bad}, choose from {list(SETUPS)}")
    for field in ("rounds", "convs", "turns", "first_tokens", "user_tokens", "new_tokens"):
        if getattr(args, field) < 1:
            ap.error(f"--{field.replace('_', '-')}: must be >= 1")
    command = "python benchmark/e2e/peer_kv.py " + " ".join(sys.argv[1:])
    print(f"# {command}", flush=True)
    from sglang_memx.models.tiny import tiny_model

    spec = model_spec()
    model = tiny_model(spec, Path(os.environ.get("TMPDIR", "/tmp")) / "sglang-memx-bench-models")
    plan = memory_plan(args, spec)
    print(json.dumps(plan, indent=1), flush=True)
    if args.dry_run:
        return 0
    pool_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-memx-bench-peerkv-{os.getpid()}"
    pool_dir.mkdir(parents=True, exist_ok=True)
    pool = f"pkb{os.getpid()}"
    setups = make_servers(args, model, plan, pool_dir, pool)
    started = time.monotonic()
    t_start = datetime.now(timezone.utc)
    failed: dict[str, str] = {}
    rounds: list[dict] = []
    startup_s = float("nan")
    lent = {}
    try:
        failed = start_setups(setups, args.start_timeout_s)
        for name in failed:
            print(f"setup {name} did not start: {failed[name][:2000]}", flush=True)
            del setups[name]
        if not setups:
            raise SystemExit("no setup started")
        startup_s = time.monotonic() - started
        for pair in setups.values():
            for s in pair.values():
                stream_ids(s.url, [5, 6, 7, 8], 4)  # warm up
        if "memx" in setups:  # the donor lends only after its policy's first window
            b = setups["memx"]["borrower"]
            deadline = time.monotonic() + 180
            while peer_counters(b)["borrowed_bytes"] < plan["memx_donate_max_bytes"] and time.monotonic() < deadline:
                time.sleep(1)
            lent = peer_counters(b)
            print(f"memx borrower borrows {lent['borrowed_bytes']} B before the rounds", flush=True)
        rounds = run_rounds(args.rounds, list(setups),
                            lambda name, r: run_once(name, setups[name], args, r, spec.vocab_size))  # fmt: skip
    finally:
        for pair in setups.values():
            for s in pair.values():
                s.stop()
        if "memx" in args.setups:
            subprocess.run([sys.executable, "-m", "sglang_memx.cli", "pool", "stop", pool, "--pool-dir",
                            str(pool_dir)], check=False, capture_output=True)  # fmt: skip
    names = list(setups)
    doc = {
        "command": command,
        "date_utc": t_start.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "params": dict(vars(args)),
        "model": {k: getattr(spec, k) for k in ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                 "head_dim", "intermediate_size", "vocab_size", "seed")},
        "memory": plan,
        "not_run": failed,
        "startup_s": startup_s,
        "memx_borrowed_bytes_before_rounds": lent.get("borrowed_bytes"),
        "wall_s": time.monotonic() - started,
        "rounds": rounds,
    }  # fmt: skip
    keys = KEYS + ("host_hit_rate", "peer_hit_rate", "wall_s", "failed")
    doc["figures"] = {s: {k: stats([r[s].get(k, float("nan")) for r in rounds]) for k in keys} for s in names}
    doc["ratios"] = {s: {k: ratio_stats(rounds, k, s, "stock") for k in KEYS[:4]} for s in names if s != "stock"}
    doc["mismatches"] = {s: mismatches(rounds, s) for s in names if s != "stock" and "stock" in names}
    if "memx" in names:
        doc["peer_totals"] = peer_totals(rounds)
        doc["memx_borrowed_bytes_after_each_round"] = borrowed_after_each_round(rounds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, RESULTS / f"{args.out}.png")
    brief = {s: {k: {m: round(v, 4) for m, v in st.items() if m != "values"} for k, st in f.items()}
             for s, f in doc["figures"].items()}  # fmt: skip
    print(json.dumps({"figures": brief, "ratios": {s: {k: {m: round(v, 3) for m, v in st.items() if m != "values"}
                                                        for k, st in r.items()} for s, r in doc["ratios"].items()},
                      "mismatches": {s: {k: v for k, v in m.items() if k != "first"}
                                     for s, m in doc["mismatches"].items()},
                      "peer_totals": doc.get("peer_totals"),
                      "memx_borrowed_bytes_after_each_round": doc.get("memx_borrowed_bytes_after_each_round"),
                      "not_run": {k: v[:300] for k, v in failed.items()},
                      "wall_s": doc["wall_s"]}, indent=1))  # fmt: skip
    print(f"wrote {RESULTS / args.out}.json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
