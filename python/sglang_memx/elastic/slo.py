"""eLLM Alg. 2 in the server: measured TTFT / TPOT samples feed the host buffer's rule.

The rule is ``memory_ext.policy.buffer_scaling.HostBufferRule`` (the simulator applies the same one
to modelled samples). Samples, once per scheduler iteration:

* TTFT: one per request that got its first token since the last iteration: the time from
  the first iteration that saw it waiting to the first that sees its first token;
* TPOT: the mean, over running requests that produced tokens since the last iteration, of
  (time since their previous token) / (tokens produced), so the wait of an offloaded
  request between its first and second token counts.
"""

from __future__ import annotations

import time

from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched


def tpot_sample(scheduler, now: float) -> float | None:
    samples = []
    for req in up_sched.running_reqs(scheduler):
        state = up_req.memx_state(req)
        count, prev = up_req.output_len(req), state.last_out
        state.last_out = (count, now) if prev is None or count != prev[0] else prev
        if prev is not None and count > prev[0] >= 1:
            samples.append((now - prev[1]) / (count - prev[0]))
    return sum(samples) / len(samples) if samples else None


def ttft_samples(scheduler, limbo, now: float) -> list[float]:
    waiting = up_sched.waiting(scheduler)
    for req in waiting:
        state = up_req.memx_state(req)
        if state.seen_at is None:
            state.seen_at = now
    samples, seen = [], set()
    prefilled = up_sched.batch_reqs(up_sched.unmerged_prefill_batch(scheduler))
    candidates = up_sched.running_reqs(scheduler) + list(prefilled)
    # offloaded prefills get their first token out of every batch (limbo, then back in the queue)
    candidates += list(limbo) + list(waiting)
    for req in candidates:
        state = up_req.memx_state(req)
        if id(req) in seen or state.seen_at is None or state.ttft_done:
            continue
        seen.add(id(req))
        if up_req.output_len(req) >= 1:
            state.ttft_done = True
            samples.append(now - state.seen_at)
    return samples


def observe(host: HostBufferState, scheduler, now: float | None = None) -> None:
    """One Alg. 2 step from this iteration's samples; the buffer's logical size follows."""
    if host.rule is None:
        return
    now = time.monotonic() if now is None else now
    units = host.rule.observe_iteration(ttft_samples(scheduler, host.limbo, now), tpot_sample(scheduler, now))
    host.set_logical_units(units)
