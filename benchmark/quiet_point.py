"""Quiet points of a soak or fault run (issue 27, item 3): the router drained, every engine's
prefix cache flushed, idle connections expired; then one snapshot in the pool's own units for
``accounting.leak_check``, and the engines' restart counters for ``accounting.self_deaths``.

An idle engine maps only the KV groups its cached prefixes need (``coordinator/tick.py``: no spare
groups when idle), so with the caches flushed two quiet points must show the same KV groups,
mapped bytes and held chunks per engine: a group more is a leak. A peer donor's donation is the
one cache a flush does not empty (it holds other engines' evicted prefixes): its chunks are
counted apart, and bounded by the donor's cap (``accounting.leak_check``).
"""

from __future__ import annotations

import time

from benchmark.e2e.router_proc import Serve, http_json

ENGINE_HEALTH_FIELDS = ("model", "replica", "pid", "state", "alive", "restarts", "restart_failures", "hangs",
                        "last_exit")  # fmt: skip


def engines(url: str) -> dict[str, dict]:
    """The router's ``/memx/serve`` engines (key -> state, restarts, last_exit, url ...)."""
    return http_json(url + "/memx/serve", timeout=30)["engines"]


def engine_health(url: str) -> dict[str, dict]:
    """What ``self_deaths`` reads of each engine: restarts, failed restarts, hangs, state, last exit."""
    return {k: {f: e.get(f) for f in ENGINE_HEALTH_FIELDS} for k, e in engines(url).items()}


def flush_caches(url: str) -> dict[str, object]:
    """Ask every engine to drop its prefix cache (upstream's ``/flush_cache``); key -> HTTP answer or error."""
    out: dict[str, object] = {}
    for key, e in engines(url).items():
        try:
            http_json(e["url"] + "/flush_cache", {}, timeout=30)
            out[key] = "ok"
        except ValueError:  # upstream answers plain text ("Cache flushed...")
            out[key] = "ok"
        except OSError as exc:
            out[key] = f"failed: {exc!r}"[:160]
    return out


def quiet(serve: Serve, settle_s: float, timeout: float = 300.0, flush: bool = True) -> dict[str, object]:
    """Until the router has nothing queued or in flight; then flush every engine's cache and wait
    ``settle_s`` more: idle keep-alive connections (router -> engine, client -> router) expire after
    5 s on either side (httpx's and uvicorn's defaults), and the engines unmap their emptied groups.
    Returns the flush answers."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        admission = http_json(serve.url + "/memx/serve")["admission"]  # {model: {"queued", "inflight", ...}}
        if all(not m["queued"] and not m["inflight"] for m in admission.values()):
            flushed = flush_caches(serve.url) if flush else {}
            time.sleep(settle_s)
            return flushed
        time.sleep(0.5)
    raise TimeoutError("the router did not drain")


# what the engine asked of the arbiter so far: a failed leak check says whether chunks were on the move
ARBITER_TRAFFIC = ("borrowed_total", "returned_total", "denied_total", "late_grants", "outstanding", "pending_reclaim")


def engine_kv(e: dict, held_by_pid: dict[str, int]) -> dict:
    """One engine's KV in pool units from its ``/memx/status`` (scheduler 0) and the arbiter's books.

    ``owners_chunks`` is the engine's own ledger (chunks per owner). A peer donor's donation
    (``donated_chunks``, ``PEER_DONATION``) is held at the arbiter like KV but is a cache other
    engines' evicted prefixes live in: it grows while the donor idles, shrinks when its requests
    reclaim it, and stays under ``donation_cap_chunks`` (``--memx-peer-donate-max-gb``)."""
    sched = http_json(e["url"] + "/memx/status", timeout=10)["schedulers"][0]
    el = sched.get("elastic_kv") or {}
    lent = el.get("shared_pool") or {}
    chunk = el.get("chunk_bytes") or lent.get("chunk_bytes") or 1  # the pool's chunk, shared or not
    owners = {o: n // chunk for o, n in (el.get("owners_bytes") or {}).items()}
    donor = (sched.get("peer_kv") or {}).get("donor") or {}
    return {"pid": sched.get("pid"), "kv_groups": el.get("groups_mapped", 0), "mapped_bytes": el.get("mapped_bytes", 0),
            "group_bytes": el.get("group_bytes"), "chunks_per_group": el.get("chunks_per_group"),
            "held_chunks": lent.get("held_chunks"), "arbiter_held": held_by_pid.get(str(sched.get("pid"))),
            "owners_chunks": owners, "donated_chunks": owners.get("peer_donation", 0),
            "donation_cap_chunks": donor["cap_bytes"] // chunk if "cap_bytes" in donor else None,
            "arbiter_traffic": {k: lent.get(k) for k in ARBITER_TRAFFIC},
            "cached_tokens": sched.get("kv_pool", {}).get("evictable_tokens")}  # fmt: skip


def snapshot(url: str, pools: list[dict], processes: list[dict]) -> dict:
    """``accounting.leak_check``'s snapshot: per engine KV, per pool held and donated chunks, process totals.
    ``pools`` is ``soak.Checker.conservation()``'s, ``processes`` ``Checker.processes()``'s."""
    held_by_pid: dict[str, int] = {}
    for p in pools:
        for pid, held in p.get("held_by_pid", {}).items():
            held_by_pid[pid] = held_by_pid.get(pid, 0) + held
    out: dict = {"engines": {}, "pool_held": {p["pool"]: p["held"] for p in pools}, "errors": {}}
    for key, e in engines(url).items():
        try:
            out["engines"][key] = engine_kv(e, held_by_pid)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            out["errors"][key] = f"{exc!r}"[:160]
    out["pool_donated"] = {p["pool"]: sum(e.get("donated_chunks", 0) for e in out["engines"].values()
                                          if str(e.get("pid")) in p.get("held_by_pid", {})) for p in pools}  # fmt: skip
    out["processes"] = {k: sum(p.get(k, 0) for p in processes) for k in ("rss_bytes", "fds", "threads", "memfd_fds")}
    return out
