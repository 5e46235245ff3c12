"""Discrete-event engine: model instances on the GPUs of one node.

* ``Instance``: one served model (continuous batching, paged KV with prefix
  cache, preemption by recomputation). Its ``Scheduler`` decides each
  iteration; the instance executes it: times it with the roofline, waits for
  the plan's link transfers, then advances tokens and records metrics.
* ``Gpu``: ``time_slice`` mode runs one iteration of one instance at a time,
  round robin between the instances that have work (temporal sharing at
  iteration granularity); ``turns`` mode gives the GPU to one instance for a
  whole turn (temporal sharing at batch granularity: the turn serves the
  requests waiting when it starts, arrivals during it wait for the model's
  next turn, and it ends when none of them is left; then round robin);
  ``spatial`` mode runs instances concurrently, each with the
  compute/bandwidth ``share`` of its roofline (MPS-like).
* ``Simulator``: owns the event loop, links, arrivals and sampling.

Conservation invariants (checked by ``Simulator.check``): every request ends
``finished``, ``rejected`` (cannot fit even alone) or is reported
``unfinished``/``not_arrived`` at the horizon; KV never exceeds capacity; at
the end no running request holds blocks.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .events import EventLoop
from .hardware import GpuSpec
from .kvcache import KVCache
from .links import LinkSet
from .models import ModelSpec
from .plan import BatchPlan, InstanceHook, Scheduler
from .request import FINISHED, RUNNING, WAITING, Request
from .roofline import BatchShape, Roofline

__all__ = ["InstanceConfig", "Instance", "Gpu", "GPU_SHARING", "Simulator"]


@dataclass
class InstanceConfig:
    """Static configuration of one model instance (one model on one GPU)."""

    name: str
    model: ModelSpec
    gpu: int
    kv_blocks: int
    block_size: int = 16
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    max_batched_tokens: int = 2048
    max_running: int = 256
    prefix_caching: bool = True
    overhead_s: float = 5e-4
    share: float = 1.0
    ttft_slo_s: float = float("inf")
    tpot_slo_s: float = float("inf")
    act_blocks: int = 0  # activation reserve expressed in KV blocks (elastic schedulers)

    @property
    def kv_block_bytes(self) -> float:
        return self.block_size * self.model.kv_bytes_per_token(self.kv_dtype)


class Instance:
    """One model instance. Public API for schedulers and hooks:
    ``waiting`` (FIFO deque), ``running`` (admission order), ``kv``,
    ``admit``, ``reserve``, ``preempt``, ``blocks_needed``, ``roofline``,
    ``last_shape``, ``last_duration``."""

    def __init__(
        self,
        idx: int,
        cfg: InstanceConfig,
        gpu_spec: GpuSpec,
        scheduler: Scheduler,
        hooks: list[InstanceHook] | None = None,
    ) -> None:
        self.idx, self.cfg = idx, cfg
        self.kv = KVCache(cfg.kv_blocks, cfg.block_size, cfg.prefix_caching)
        self.roofline = Roofline(cfg.model, gpu_spec, cfg.weight_dtype, cfg.kv_dtype, cfg.overhead_s, cfg.share)
        self.scheduler = scheduler
        self.hooks: list[InstanceHook] = list(hooks or [])
        self.waiting: deque[Request] = deque()
        self.deferred: deque[Request] = deque()  # ``turns`` mode: arrivals during this model's turn
        self.running: list[Request] = []
        self.sim: Simulator = None  # set by Simulator
        self.gpu: Gpu = None
        self.in_iteration = False
        self.queued = False
        self.last_shape = BatchShape()
        self.last_duration = 0.0
        # metrics
        self.iterations = 0
        self.busy_s = 0.0
        self.tokens_out = 0
        self.prefill_tokens = 0
        self.preemptions = 0
        self.gap_vals = array("d")  # TBT gaps (s), weighted by gap_wts
        self.gap_wts = array("l")
        self._last_iter_end = -1.0
        self._plan: BatchPlan | None = None
        self._pending = 0
        self._started = 0.0

    # ---- API for schedulers ------------------------------------------------
    def blocks_needed(self, req: Request, extra_tokens: int) -> int:
        """Blocks to reserve so that ``req.ctx + extra_tokens`` tokens fit."""
        bs = self.kv.block_size
        return -(-(req.ctx + extra_tokens) // bs) - len(req.cached_keys) - req.private_blocks

    def reserve(self, req: Request, extra_tokens: int) -> bool:
        """Reserve KV for ``extra_tokens`` more tokens of ``req`` (all or nothing)."""
        n = self.blocks_needed(req, extra_tokens)
        if n <= 0:
            return True
        if not self.kv.allocate(n):
            return False
        req.private_blocks += n
        return True

    def admit(self, req: Request, now: float) -> None:
        """Move the head-of-queue ``req`` into ``running`` and take its prefix
        cache hit (never the whole target: one token is always computed)."""
        assert req.state == WAITING and req.ctx == 0 and not req.cached_keys
        bs = self.kv.block_size
        max_blocks = (req.target - 1) // bs
        if max_blocks > 0 and self.kv.prefix_caching:
            hit = self.kv.match(req.block_key(j, bs) for j in range(max_blocks))
            if hit:
                req.cached_keys = req.block_keys(0, hit, bs)
                req.ctx = hit * bs
                self.kv.hit_tokens += req.ctx
        if req.first_token_t is None:
            # the admission that produces the first token counts, once: an
            # admission undone by ``unadmit`` or by a preemption before the
            # first token is replaced, and re-admissions after the first token
            # (recomputation re-hitting the request's own published blocks)
            # are not prompt hits -- so prefix_hit_tokens <= prompt_len
            req.prefix_hit_tokens = req.ctx
        req.state = RUNNING
        if req.admitted_t is None:
            req.admitted_t = now
        self.running.append(req)

    def unadmit(self, req: Request) -> None:
        """Undo ``admit`` for a request that got no KV (back to queue head)."""
        self._drop_kv(req)
        self.running.remove(req)
        req.state = WAITING
        self.waiting.appendleft(req)

    def preempt(self, req: Request) -> None:
        """Preemption by recomputation: drop all KV, requeue at the head."""
        self._drop_kv(req)
        self.running.remove(req)
        req.state = WAITING
        req.decoding = False
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _drop_kv(self, req: Request) -> None:
        if req.cached_keys:
            self.kv.release_cached(req.cached_keys)
            req.cached_keys = []
        self.kv.free_private(req.private_blocks)
        req.private_blocks = 0
        req.ctx = 0

    def _publish(self, req: Request) -> None:
        """Full blocks of ``req`` become prefix-cache blocks it references."""
        if not self.kv.prefix_caching:
            return
        bs = self.kv.block_size
        full = req.ctx // bs
        have = len(req.cached_keys)
        if full > have:
            keys = req.block_keys(have, full, bs)
            self.kv.publish(keys)
            req.private_blocks -= len(keys)
            req.cached_keys.extend(keys)

    # ---- execution ----------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kick(self) -> None:
        """Ask the GPU for a turn if there is work and none is scheduled."""
        if not self.in_iteration and not self.queued and (self.waiting or self.running):
            self.gpu.request(self)

    def try_start(self, now: float) -> bool:
        """Plan and start one iteration; False if the plan is empty."""
        plan = self.scheduler.plan(self, now)
        if not plan:
            return False
        for h in self.hooks:
            h.before_iteration(self, plan, now)
        shape = BatchShape()
        decodes = plan.decodes
        if decodes:
            n = len(decodes)
            ctx_sum = 0
            for r in decodes:
                ctx_sum += r.ctx
            shape.tokens = n
            shape.attn_pairs = ctx_sum + n
            shape.kv_tokens = ctx_sum + n
            shape.sampled = n
        for r, chunk in plan.prefills:
            shape.add_prefill(r.ctx, chunk, r.ctx + chunk >= r.target)
        dt = self.roofline.iteration_time(shape) + plan.extra_s
        self.last_shape = shape
        self.in_iteration = True
        self._plan = plan
        self._started = now
        self._pending = 1 + len(plan.transfers)
        loop = self.sim.loop
        loop.at(now + dt, self._part_done)
        links = self.sim.links
        for name, nbytes in plan.transfers:
            links[name].start(nbytes, self._transfer_done)
        return True

    def _transfer_done(self, t: float) -> None:
        self._part_done()

    def _part_done(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._finish_iteration(self.sim.loop.now)

    def _finish_iteration(self, now: float) -> None:
        plan, self._plan = self._plan, None
        dur = now - self._started
        self.last_duration = dur
        self.iterations += 1
        self.busy_s += dur
        prev_end = self._last_iter_end
        regular = 0
        finished: list[Request] = []
        gap_vals = self.gap_vals
        for r in plan.decodes:
            r.ctx += 1
            r.generated += 1
            if r.last_token_t == prev_end:
                regular += 1
            else:
                gap_vals.append(now - r.last_token_t)
                self.gap_wts.append(1)
            r.last_token_t = now
            if r.generated >= r.output_len:
                finished.append(r)
        if regular:
            gap_vals.append(now - prev_end)
            self.gap_wts.append(regular)
        n_tok = len(plan.decodes)
        for r, chunk in plan.prefills:
            r.ctx += chunk
            r.computed_tokens += chunk
            self.prefill_tokens += chunk
            if r.ctx >= r.target:
                r.generated += 1
                n_tok += 1
                if r.first_token_t is None:
                    r.first_token_t = now
                else:  # resumed after preemption: a (long) TBT gap
                    gap_vals.append(now - r.last_token_t)
                    self.gap_wts.append(1)
                r.last_token_t = now
                r.decoding = True
                self._publish(r)
                if r.generated >= r.output_len:
                    finished.append(r)
        self.tokens_out += n_tok
        self._last_iter_end = now
        for r in finished:
            self._finish_request(r, now)
        for h in self.hooks:
            h.after_iteration(self, plan, now, dur)
        self.in_iteration = False
        self.gpu.release(self, now)
        self.kick()

    def _finish_request(self, r: Request, now: float) -> None:
        self._publish(r)
        self._drop_kv(r)
        r.ctx = r.prompt_len + r.generated - 1
        self.running.remove(r)
        r.state = FINISHED
        r.decoding = False
        r.finish_t = now
        self.sim.on_finish(r, now)


GPU_SHARING = ("time_slice", "turns", "spatial")


class Gpu:
    """Serialises (``time_slice``: per iteration; ``turns``: per turn) or
    overlaps (``spatial``) instance iterations. In ``turns`` mode ``current``
    is the instance holding the turn, also between its iterations."""

    def __init__(self, idx: int, spec: GpuSpec, mode: str = "time_slice") -> None:
        if mode not in GPU_SHARING:
            raise ValueError(f"gpu sharing mode must be one of {', '.join(GPU_SHARING)}, got {mode!r}")
        self.idx, self.spec, self.mode = idx, spec, mode
        self.current: Instance | None = None
        self.queue: deque[Instance] = deque()
        self.loop: EventLoop = None

    def request(self, inst: Instance) -> None:
        now = self.loop.now
        if self.mode == "spatial":
            inst.try_start(now)
            return
        if self.current is None:
            if inst.try_start(now):
                self.current = inst
        else:
            inst.queued = True
            self.queue.append(inst)

    def release(self, inst: Instance, now: float) -> None:
        if self.mode == "spatial":
            return
        if self.mode == "turns":
            # the turn goes on while requests of it are left (waiting ones
            # arrived before it started, or were preempted during it)
            if (inst.waiting or inst.running) and inst.try_start(now):
                return
            if inst.deferred:  # they wait for the model's next turn, at the back
                inst.waiting.extend(inst.deferred)
                inst.deferred.clear()
                inst.queued = True
                self.queue.append(inst)
        self.current = None
        while self.queue:
            nxt = self.queue.popleft()
            nxt.queued = False
            if nxt.try_start(now):
                self.current = nxt
                return


@dataclass
class Sample:
    t: float
    kv_used: list[int]
    kv_cached: list[int]
    kv_capacity: list[int]
    waiting: list[int]
    running: list[int]


class Simulator:
    """Runs one workload on a node. ``run()`` returns when no event is left or
    at ``horizon_s`` (arrivals stop at ``duration_s``; the rest drains)."""

    def __init__(
        self,
        gpus: list[Gpu],
        instances: list[Instance],
        requests: list[Request],
        initial: list[int],
        duration_s: float,
        horizon_s: float | None = None,
        sample_period_s: float = 1.0,
        links: LinkSet | None = None,
        periodic: list[tuple] | None = None,
    ) -> None:
        self.loop = EventLoop()
        self.gpus, self.instances, self.requests = gpus, instances, requests
        self.initial = initial
        self.duration_s = duration_s
        self.horizon_s = horizon_s if horizon_s is not None else duration_s * 2 + 60
        self.sample_period_s = sample_period_s
        self.links = links if links is not None else LinkSet(self.loop)
        self.links.loop = self.loop
        for l in self.links.links.values():
            l.loop = self.loop
        for g in gpus:
            g.loop = self.loop
        for inst in instances:
            inst.sim = self
            inst.gpu = gpus[inst.cfg.gpu]
        self.periodic = list(periodic or [])  # (period_s, fn(sim, now))
        self.arbiter = None  # mechanisms.arbiter.SimArbiter when the scenario has ``arbiter``
        self.samples: list[Sample] = []
        self.rejected: list[int] = []
        self.finished = 0
        self.wall_s = 0.0
        self._next_initial = 0
        self._followups = 0  # follow-up turns scheduled but not yet arrived

    # ---- arrivals -------------------------------------------------------------
    def _schedule_next_initial(self) -> None:
        if self._next_initial < len(self.initial):
            r = self.requests[self.initial[self._next_initial]]
            self.loop.at(r.arrival, self._arrive_initial)

    def _arrive_initial(self) -> None:
        r = self.requests[self.initial[self._next_initial]]
        self._next_initial += 1
        self._schedule_next_initial()
        self.arrive(r)

    def arrive(self, r: Request) -> None:
        inst = self.instances[r.model]
        r.arrival = self.loop.now if math.isnan(r.arrival) else r.arrival
        r.last_token_t = r.arrival
        on_arrival = getattr(inst.scheduler, "on_arrival", None)
        if on_arrival is not None:  # e.g. SwiftCache Alg. 1 SCALEUP for the incoming request
            on_arrival(inst, r, self.loop.now)
        need = -(-(r.prompt_len + r.output_len) // inst.kv.block_size)
        if need > inst.kv.capacity:
            self.rejected.append(r.rid)
            r.state = FINISHED
            r.finish_t = None
            return
        r.state = WAITING
        if inst.gpu.mode == "turns" and inst.gpu.current is inst:
            inst.deferred.append(r)  # not part of the turn under way
            return
        inst.waiting.append(r)
        inst.kick()

    def on_finish(self, r: Request, now: float) -> None:
        self.finished += 1
        if r.next_turn >= 0:
            nxt = self.requests[r.next_turn]
            nxt.arrival = now + r.think_s
            self._followups += 1
            self.loop.at(nxt.arrival, self._arrive_followup, nxt)

    def _arrive_followup(self, r: Request) -> None:
        self._followups -= 1
        self.arrive(r)

    def active(self) -> bool:
        """Anything left to happen: arrivals to come or requests in flight."""
        return (
            self._next_initial < len(self.initial)
            or self._followups > 0
            or any(i.waiting or i.running or i.deferred for i in self.instances)
        )

    # ---- sampling -------------------------------------------------------------
    def _sample(self) -> None:
        insts = self.instances
        self.samples.append(
            Sample(
                self.loop.now,
                [i.kv.used for i in insts],
                [i.kv.cached for i in insts],
                [i.kv.capacity for i in insts],
                [len(i.waiting) for i in insts],
                [len(i.running) for i in insts],
            )
        )
        if self.active():
            self.loop.after(self.sample_period_s, self._sample)

    def _periodic(self, period: float, fn: Callable) -> None:
        fn(self, self.loop.now)
        if self.active():
            self.loop.after(period, self._periodic, period, fn)

    def run(self) -> Simulator:
        import time

        t0 = time.perf_counter()
        self._schedule_next_initial()
        self.loop.at(0.0, self._sample)
        for period, fn in self.periodic:
            self.loop.at(0.0, self._periodic, period, fn)
        loop, horizon = self.loop, self.horizon_s
        step = loop.step
        while loop.next_time() <= horizon and step():
            pass
        self.wall_s = time.perf_counter() - t0
        return self

    def check(self) -> None:
        """Assert KV invariants, no leaks when nothing is running, and (with
        the node arbiter) that every GPU's memory accounts add up to its budget."""
        if self.arbiter is not None:
            self.arbiter.verify()
        for inst in self.instances:
            inst.kv.check()
            if not inst.running:
                assert inst.kv.private == 0, f"{inst.cfg.name}: {inst.kv.private} private blocks leaked"
                assert inst.kv.used == 0, f"{inst.cfg.name}: {inst.kv.used} blocks still referenced"
            held = sum(len(r.cached_keys) + r.private_blocks for r in inst.running)
            assert held >= inst.kv.private
