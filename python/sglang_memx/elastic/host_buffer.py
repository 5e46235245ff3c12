"""CPU elastic buffer (eLLM E3/E4, ``--memx-host-buffer-gb``): retracted requests' KV waits on the host.

Under memory pressure upstream retracts decoding requests: their KV is freed
and recomputed when they are admitted again. With a host buffer:

* ``park_retracted`` (called as upstream releases a request it retracts):
  the request's committed KV rows (every layer's K and V) are copied to host
  tensors in a ``HostKVBuffer``, if its logical size has room; otherwise the
  request is recomputed as in stock SGLang.
* ``restore_parked`` (once per iteration, before batch selection): for waiting
  requests with parked KV, head first, while the device has room: allocate
  slots, copy the rows back and insert them into the radix cache under the
  request's tokens. Upstream's admission then finds them as a cached prefix
  and computes only what is missing (the last token): fetched before the
  decode resumes, not recomputed. An entry whose request is gone is dropped.
* ``observe_slos``: with ``--memx-ttft-slo-ms``/``--memx-tpot-slo-ms`` the
  logical size follows eLLM Alg. 2 (``LogicalBufferScaler``, unit = one KV
  group's bytes, starting at one unit): TPOT violations shrink it first,
  TTFT violations grow it. TTFT is measured from the first iteration that
  saw the request waiting to the first iteration that sees its first token;
  TPOT is the wall time of the previous iteration when it was a decode step.
  Without SLOs the logical size is the whole buffer.

Needs the radix cache (the restore goes through it).
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Optional

import torch

from memory_ext.policy.ellm import LogicalBufferScaler
from memory_ext.pool.host_kv_buffer import HostKVBuffer

logger = logging.getLogger("sglang_memx")


class HostBufferState:
    def __init__(self, buffer: HostKVBuffer, unit_bytes: int, scaler: Optional[LogicalBufferScaler] = None):
        self.buffer = buffer
        self.unit_bytes = unit_bytes
        self.scaler = scaler
        self.last_tick: Optional[float] = None
        self.events = {"ttft": 0, "tpot": 0}
        if scaler is not None:
            buffer.set_logical_bytes(scaler.logical_chunks * unit_bytes)

    def status(self) -> dict:
        out = self.buffer.status()
        out["slo_scaling"] = None if self.scaler is None else {
            "logical_units": self.scaler.logical_chunks, "unit_bytes": self.unit_bytes,
            "ttft_slo_s": self.scaler.ttft_slo, "tpot_slo_s": self.scaler.tpot_slo,
            "ttft_events": self.events["ttft"], "tpot_events": self.events["tpot"]}
        return out


def build_host_buffer(config, group_bytes: int) -> HostBufferState:
    capacity = int(config.host_buffer_gb * (1 << 30))
    scaler = None
    if config.ttft_slo_ms is not None:
        scaler = LogicalBufferScaler(max_chunks=max(1, capacity // group_bytes), ttft_slo=config.ttft_slo_ms / 1e3,
                                     tpot_slo=config.tpot_slo_ms / 1e3)
    return HostBufferState(HostKVBuffer(capacity), group_bytes, scaler)


def _kv_buffers(allocator):
    pool = allocator.get_kvcache()
    return list(pool.k_buffer) + list(pool.v_buffer)


def park_retracted(kv, req, req_to_token_pool, allocator) -> bool:
    """Copy a request being retracted to the host buffer (before upstream frees its KV)."""
    host = kv.host
    if host is None or req.finished() or getattr(req, "input_embeds", None) is not None:
        return False
    if not req.kv.holds_kv or req.kv.req_pool_idx is None:
        return False
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[:req.owned_kv_len()]
    n = len(tokens) - len(tokens) % allocator.page_size
    if n <= 0:
        return False
    host.buffer.drop(req.rid)  # a stale entry of an earlier retraction
    buffers = _kv_buffers(allocator)
    row_bytes = sum(b[0].numel() * b.element_size() for b in buffers)
    if n * row_bytes > host.buffer.room():
        host.buffer.stats["refused"] += 1
        return False
    idx = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    pin = idx.device.type == "cuda"
    rows = [b[idx].to("cpu", copy=True) for b in buffers]
    if pin:
        rows = [r.pin_memory() for r in rows]
    return host.buffer.park(req.rid, tokens[:n], rows)


def restore_parked(kv, scheduler) -> int:
    """Fetch parked KV back for waiting requests (head first) while the device has room; return how many."""
    host = kv.host
    if host is None or not len(host.buffer):
        return 0
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    waiting = list(getattr(scheduler, "waiting_queue", []))
    live = {r.rid for r in waiting}
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)):
        live.update(r.rid for r in (getattr(batch, "reqs", None) or []))
    for key in host.buffer.keys():
        if key not in live:
            host.buffer.drop(key)  # finished or aborted meanwhile
    allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    restored = 0
    for req in waiting:
        entry = host.buffer.peek(req.rid)
        if entry is None:
            continue
        n = len(entry)
        # the head's prefill activation (held, idle now) is not room for KV
        act = kv.activation.held // kv.buffers.chunks_per_group * kv.buffers.group_rows if kv.activation else 0
        if allocator.available_size() - act < n + allocator.page_size:
            break  # first come, first served: later ones wait behind this one
        idx = allocator.alloc(n)
        if idx is None:
            break
        for buf, rows in zip(_kv_buffers(allocator), entry.rows):
            buf[idx] = rows.to(buf.device, non_blocking=True)
        key = RadixKey(array("q", entry.tokens), req.extra_key, cache_salt=req.cache_salt)
        try:
            tree.insert(InsertParams(key=key, value=idx.to(torch.int64, copy=True)))
        except Exception:  # never lose the request: it is recomputed as in stock SGLang
            logger.exception("memx: could not restore the parked KV of %s; it is recomputed", req.rid)
            allocator.free(idx)
            host.buffer.drop(req.rid)
            continue
        host.buffer.take(req.rid)
        restored += 1
    return restored


def observe_slos(kv, scheduler, now: Optional[float] = None) -> None:
    """One Alg. 2 step from this iteration's measured TTFT (max over first tokens) and TPOT."""
    host = kv.host
    if host is None or host.scaler is None:
        return
    now = time.monotonic() if now is None else now
    for req in list(getattr(scheduler, "waiting_queue", [])):
        if getattr(req, "_memx_seen_at", None) is None:
            req._memx_seen_at = now
    ttft = None
    for batch in (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None)):
        for req in list(getattr(batch, "reqs", None) or []):
            seen = getattr(req, "_memx_seen_at", None)
            if seen is not None and not getattr(req, "_memx_ttft_done", False) and len(req.output_ids) >= 1:
                req._memx_ttft_done = True
                ttft = max(ttft or 0.0, now - seen)
    last = getattr(scheduler, "last_batch", None)
    mode = getattr(last, "forward_mode", None)
    tpot = None
    if host.last_tick is not None and mode is not None and mode.is_decode():
        tpot = now - host.last_tick
    host.last_tick = now
    decision = host.scaler.observe(ttft=ttft, tpot=tpot)
    if decision.event:
        host.events[decision.event] += 1
    host.buffer.set_logical_bytes(decision.logical_chunks * host.unit_bytes)
