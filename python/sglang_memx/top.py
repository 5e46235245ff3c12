"""``sglang-memx top``: a live terminal view of every memx pool and server on this machine.

Pools are found as ``<pool dir>/*.sock`` (one arbiter each, asked for STATUS
without borrowing anything); servers as the ``<pool>.server.<pid>.json``
files that servers joining a pool leave there, plus any ``--url`` given.
Each frame shows, per pool, the budget split between its clients, and per
server its KV (mapped vs logical bytes, tokens used / capacity), requests,
map / unmap counts and its KV slab (cell size, slab format, FREE / PARTIAL /
FULL slabs); a pool whose servers have different slab formats also shows the
one uniform slab FineServe would cut. A server with elastic KV also shows its
governor: the SLOs in force and where each came from, the batch cap and why,
predicted vs measured TPOT and the refusals to grow (or ``off`` without a TPOT
SLO: the batch grows as stock's). ``--once`` prints one frame (for scripts and
tests).

``--router URL`` (repeatable) adds an ``sglang-memx serve`` router: its
``/memx/serve`` gives the served models, their device, engine state (awake /
starting / restarting / dead; sleeping / waking once sleep / wake lands),
restarts, router queue / in flight and TTFT; its engines are shown as servers.
``--api-key`` (or ``SGLANG_MEMX_API_KEY``) is sent as a bearer token to routers
and servers started with one.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from memory_ext.proc import pid_alive

BAR = 24


def _gib(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _bar(part: float, whole: float, width: int = BAR) -> str:
    filled = 0 if whole <= 0 else min(width, round(width * part / whole))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _get_json(url: str, timeout: float, api_key: str | None = None) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def dead_arbiter_pid(sock: Path) -> int | None:
    """The pid an arbiter wrote beside ``sock`` (``<pool>.pid``, removed on a clean exit) when that
    process is gone: the socket is a dead arbiter's leftover. None when unknown or still alive."""
    try:
        pid = int(sock.with_suffix(".pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if pid <= 0 or pid_alive(pid) else pid


def collect(
    pool_dir: Path,
    urls: list[str],
    timeout: float = 2.0,
    routers: list[str] | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """One snapshot: ``{"pools": [...], "servers": [...], "routers": [...]}``; unreachable things
    carry ``error``."""
    from memory_ext.pool.arbiter_client import ArbiterError, query_arbiter_status

    pools, servers, routed = [], [], []
    known = {u.rstrip("/"): None for u in urls}
    for rurl in routers or []:
        rurl = rurl.rstrip("/")
        entry = {"url": rurl}
        try:
            entry["serve"] = _get_json(rurl + "/memx/serve", timeout, api_key)
            for m in entry["serve"].get("models", {}).values():
                if m.get("url"):
                    known.setdefault(str(m["url"]).rstrip("/"), None)
        except (OSError, ValueError) as exc:
            entry["error"] = str(exc)
        routed.append(entry)
    if pool_dir.is_dir():
        for sock in sorted(pool_dir.glob("*.sock")):
            entry: dict[str, Any] = {"name": sock.stem, "socket": str(sock)}
            try:
                entry.update(query_arbiter_status(sock, timeout=timeout, name="sglang-memx-top"))
            except ArbiterError as exc:
                entry["error"] = str(exc)
                gone = dead_arbiter_pid(sock)
                if gone is not None:
                    entry["stale"] = (f"its arbiter (pid {gone}) is gone, killed without removing its socket; the "
                                      "next server started with this pool's budget replaces it")  # fmt: skip
            pools.append(entry)
        for reg in sorted(pool_dir.glob("*.server.*.json")):
            try:
                info = json.loads(reg.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(info, dict) and pid_alive(int(info.get("pid", 0))) and info.get("url"):
                known.setdefault(str(info["url"]).rstrip("/"), info.get("pool"))
    for url, pool in known.items():
        entry = {"url": url, "pool": pool}
        try:
            entry["status"] = _get_json(url + "/memx/status", timeout, api_key)
        except (OSError, ValueError) as exc:
            entry["error"] = str(exc)
        servers.append(entry)
    return {"time": time.time(), "pools": pools, "servers": servers, "routers": routed}


def _fmt_s(v) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def _router_lines(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [f"  {r['url']:<28} unreachable: {r['error']}"]
    doc = r["serve"]
    models, engines = doc.get("models", {}), doc.get("engines", {})
    adm, measured = doc.get("admission", {}), doc.get("router", {})
    lines = [f"  {r['url']}  {len(models)} model(s)"]
    lines.append(f"    {'MODEL':<20} {'DEVICE':<8} {'STATE':<11} {'PID':<8} {'QUEUE':>5} {'RUN':>4} {'RESTARTS':>8}"
                 f"  {'TTFT':>8} {'SLO':>5}  ENGINE")  # fmt: skip
    for name, m in models.items():
        e, a, me = engines.get(name, {}), adm.get(name, {}), measured.get(name, {})
        state = m.get("state") or e.get("state") or ("awake" if e.get("alive") else "dead")
        att = me.get("ttft_slo_attainment")
        reps = m.get("replicas") or []
        many = len(reps) > 1  # the model line sums up; one line per replica engine below it
        pid = f"{len(reps)} repl" if many else str(e.get("pid") or "-")
        restarts = sum(x.get("restarts") or 0 for x in reps) if many else e.get("restarts", 0)
        where = f"{len(reps)} replicas" if many else m.get("url", "")
        line = (f"    {name:<20} {str(m.get('device') or '-'):<8} {state:<11} {pid:<8} "
                f"{a.get('queued', 0):>5} {a.get('inflight', 0):>4} {restarts:>8}  {_fmt_s(me.get('ttft_mean_s')):>8} "
                f"{'-' if att is None else f'{att:.0%}':>5}  {where}")  # fmt: skip
        if many:
            pass  # each replica's exit / restart is on its own line
        elif e.get("last_exit") and state != "awake":
            line += f"  ({e['last_exit']})"
        elif e.get("last_restart_s") is not None:
            line += f"  (last restart {e['last_restart_s']:.1f} s)"
        lines.append(line)
        if many:
            lines += [_replica_line(x) for x in reps]
    return lines


def _replica_line(x: dict[str, Any]) -> str:
    state = str(x.get("state") or "-")
    line = (f"      #{x.get('replica', '?'):<17} {str(x.get('device') or '-'):<8} {state:<11} "
            f"{str(x.get('pid') or '-'):<8} {'':>5} {x.get('router_inflight', 0):>4} {x.get('restarts') or 0:>8}  "
            f"{'':>8} {'':>5}  {x.get('url', '')}")  # fmt: skip
    if x.get("last_exit") and state != "awake":
        line += f"  ({x['last_exit']})"
    return line


def render(snap: dict[str, Any]) -> str:
    lines = [
        f"sglang-memx top   {time.strftime('%H:%M:%S', time.localtime(snap['time']))}   "
        f"{len(snap['pools'])} pool(s), {len(snap['servers'])} server(s)",
        "",
    ]
    if snap.get("routers"):
        lines.append("MODELS (sglang-memx serve)")
        for r in snap["routers"]:
            lines += _router_lines(r)
        lines.append("")
    lines.append("POOLS")
    if not snap["pools"]:
        lines.append("  (none)")
    for p in snap["pools"]:
        if "error" in p:
            why = f"stale: {p['stale']}" if "stale" in p else f"unreachable: {p['error']}"
            lines.append(f"  {p['name']:<16} {why}")
            continue
        g = p["granularity"]
        held = sum(c["held"] for c in p["clients"])
        lines.append(
            f"  {p['name']:<16} {_bar(held, p['budget'])} {_gib(held * g)} lent of {_gib(p['budget'] * g)}"
            f"  free {_gib(p['free'] * g)}  waiting {p['pending']}"
        )
        for c in p["clients"]:
            if c["name"] == "sglang-memx-top":
                continue
            lines.append(
                f"    {c['name']:<22} pid {c['pid']:<8} {_bar(c['held'], p['budget'], 16)} "
                f"{_gib(c['held'] * g)}  reclaim asked {c['asked']}"
            )
        lines += _pool_slab_lines(snap, p["name"])
    lines += ["", "SERVERS"]
    if not snap["servers"]:
        lines.append("  (none; servers that join a pool are found automatically, others with --url)")
    for s in snap["servers"]:
        if "error" in s:
            lines.append(f"  {s['url']:<28} unreachable: {s['error']}")
            continue
        for rank in s["status"].get("schedulers", []):
            kv, req, el = rank["kv_pool"], rank["requests"], rank.get("elastic_kv")
            head = f"  {s['url']:<28} {kv['used_tokens']:>7}/{kv['capacity_tokens']:<7} tok"
            head += f"  run {req['running']:>3} wait {req['waiting']:>3}"
            if el:
                head += (
                    f"  KV {_bar(el['mapped_bytes'], el['logical_bytes'], 16)} {_gib(el['mapped_bytes'])}"
                    f" / {_gib(el['logical_bytes'])}  map {el['groups_mapped_total']} unmap "
                    f"{el['groups_unmapped_total']}"
                )
                w = el.get("weights")
                if w:
                    head += (
                        f"  layers {w['resident_layers']}/{w['layers']} resident, lent {_gib(w['lent_bytes'])},"
                        f" copy {_gib(w['copy_bytes_per_s'] or 0)}/s, stall {w['stall_seconds']:.2f} s"
                    )
            else:
                head += f"  KV static {_gib(kv['bytes'])}"
            lines.append(head + (f"  pool {rank['pool_name']}" if rank.get("pool_name") else ""))
            if el and el.get("slab"):
                lines.append(_slab_line(el["slab"]))
            if el:
                lines.append(_governor_line(el.get("governor")))
            if rank.get("peer_kv"):
                lines.append(_peer_line(rank["peer_kv"]))
    return "\n".join(lines)


def _ms(v) -> str:
    """Milliseconds: one decimal, or 3 significant digits below 1 ms (a 0.01 ms SLO stays readable)."""
    return "-" if v is None else f"{v:.1f} ms" if v >= 1 else f"{v:.3g} ms"


def _governor_line(g: dict[str, Any] | None) -> str:
    """The governor: SLOs in force (source), batch cap and why, predicted vs measured TPOT, refusals."""
    if g is None:
        return "    governor off: no TPOT SLO (the batch grows as stock's)"
    slos = g.get("slos") or {}
    held = [f"{kind.upper()} {_ms(s['ms'])} ({s['source']})" for kind, s in sorted(slos.items()) if s]
    default = g.get("default_slo")  # none given and the default still measuring: say so
    if slos.get("tpot") is None and default and default["scale"] and default["tpot_slo_ms"] is None:
        held.insert(0, f"TPOT - (default {default['scale']:g} x the solo step: measuring, "
                       f"{default['solo_samples']}/{default['samples_needed']})")  # fmt: skip
    cap = "-" if g["batch_cap"] is None else g["batch_cap"]
    verdicts = ", ".join(f"{r} {n}" for r, n in sorted((g.get("admission_verdicts") or {}).items()) if n)
    return (f"    governor SLO {', '.join(held) or '-'}  cap {cap} ({g['batch_cap_reason']}), run {g['running']}"
            f"  TPOT predicted {_ms(g['predicted_tpot_ms'])} / measured {_ms(g['measured_tpot_ms'])}"
            f" (prefill stalls {_ms((g.get('prefill_stalls') or {}).get('ms_per_token'))}/token)"
            f"  refused {g['decisions'].get('over_slo', 0)}"
            f"  admission {verdicts or '-'}")  # fmt: skip


def _peer_line(p: dict[str, Any]) -> str:
    """One line per server: what it lends (donor) and what it borrows and moves (borrower)."""
    out = f"    peer KV {p['mode']:<6}"
    d = p.get("donor")
    if d:
        out += f"  lends {_gib(d['donated_bytes'])} to {len(d['leases'])} (cap {_gib(d['cap_bytes'])}),"
        out += f" reclaims {p.get('reclaims', 0)}"
    b = p.get("borrower")
    if b:
        out += f"  borrows {_gib(b['borrowed_bytes'])} from {len(b['peers'])}, spills {p.get('spills', 0)},"
        out += f" hits {p.get('hits', 0)} ({p.get('pages_loaded', 0)} pages), moved {_gib(b['bytes_stored'])} out"
        out += f" / {_gib(b['bytes_loaded'])} in, recomputed after reclaim {p.get('recomputes_after_reclaim', 0)}"
    return out


def _slab_line(sl: dict[str, Any]) -> str:
    """A server's KV slab: its cell, the slab format and the slab counts."""
    n = sl["slabs"]
    return (
        f"    slab {sl['format']}: {sl['bytes_per_token']} B/token, {sl['tokens_per_slab']} tokens"
        f" = {sl['slab_units']} chunk(s) ({_gib(sl['slab_bytes'])}), waste {sl['waste_bytes']} B;"
        f" FULL {n['FULL']} PARTIAL {n['PARTIAL']} FREE {n['FREE']}, stranded {sl['stranded_tokens']} tok"
    )


def _pool_slab_lines(snap: dict[str, Any], pool: str) -> list[str]:
    """The slab formats of the servers on ``pool`` and the one uniform slab FineServe would cut."""
    from memory_ext.policy.kv_format import uniform_slab_units

    formats: dict[str, int] = {}
    for s in snap["servers"]:
        for rank in s.get("status", {}).get("schedulers", []):
            sl = (rank.get("elastic_kv") or {}).get("slab")
            if sl and rank.get("pool_name") == pool:
                formats[sl["format"]] = sl["slab_units"]
    if len(formats) < 2:
        return []
    listed = ", ".join(f"{k} {u}" for k, u in sorted(formats.items()))
    return [f"    slab formats (chunks per slab): {listed}; one uniform slab for all would be "
            f"{uniform_slab_units(formats.values())}"]  # fmt: skip


def run(
    pool_dir: Path,
    urls: list[str],
    interval: float,
    once: bool,
    frames: int | None = None,
    routers: list[str] | None = None,
    api_key: str | None = None,
) -> int:
    shown = 0
    while True:
        frame = render(collect(pool_dir, urls, routers=routers, api_key=api_key))
        if once:
            print(frame)
            return 0
        print("\x1b[H\x1b[2J" + frame, flush=True)
        shown += 1
        if frames is not None and shown >= frames:
            return 0
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return 0
