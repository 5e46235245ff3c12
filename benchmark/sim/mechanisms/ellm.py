"""eLLM (E3/E4) in the simulator: ballooning admission (Alg. 1), the CPU
elastic buffer and SLO-aware logical buffer scaling (Alg. 2).

Every decision comes from ``memory_ext.policy.ellm`` -- the same objects the
server uses: ``ElasticAdmissionPolicy.decide`` (Alg. 1, with the running
requests' decode reservation) and ``HostBufferRule`` (Alg. 2).

Scheduler kind ``ellm`` (``EllmScheduler``): Alg. 1 with intra-GPU inflation.

* One eLLM chunk = one KV block of the instance. The instance's activation
  reserve (``act_blocks`` of the memory plan) is the activation pool;
  ``idle_act_chunks`` = reserve - blocks lent to KV; ``free_kv_chunks`` =
  free + evictable KV blocks; activation need of a batch of ``n`` tokens =
  ``ceil(model.activation_bytes(n) / block_bytes)``.
* Decode reservation (``new_token_ratio``, default 0.7): before each
  decision the scheduler reserves, against prefill admission, the running
  requests' future decode growth -- ``reserved_chunks = ceil(sum over
  decoding GPU-resident requests of remaining output tokens x
  new_token_ratio / block tokens)`` -- the way SGLang's admission keeps room
  for them (its initial new-token ratio is 0.7: ``SGLANG_INIT_NEW_TOKEN_RATIO``
  in ``sglang/srt/environ.py`` of the pinned sglang 0.5.23, times
  ``--schedule-conservativeness``, default 1.0). The simulator knows each
  request's exact output length, which stands in for ``max_new_tokens``.
  ``new_token_ratio: 0`` is the paper's literal Alg. 1 (no reserve: whole
  prompts admitted into every free chunk, decodes preempted when they
  outgrow memory).
* Admitted prefills run whole (Alg. 1 admits whole requests, no chunking);
  one iteration is either prefill or decode (R4 fallback); inflation grows
  the KV pool by borrowing activation blocks. Without the node arbiter
  deflation is not applied (lent blocks stay with KV); under it both go
  through ``SimArbiter.inflate`` / ``deflate``.
* If nothing at all fits, the latest request is preempted (the stock escape
  hatch) so the run cannot deadlock. Kind ``ellm`` never offloads.

Scheduler kind ``ellm_elastic`` (``EllmElasticScheduler``) adds the GPU-CPU
elasticity of eLLM §4.3.2 / §4.4.2:

* **Offload.** When Alg. 1 admits a prefill whose KV does not fit on the GPU
  but fits in the available CPU buffer ``P_B``, the prefill runs with no GPU KV
  reserved and its whole KV (``prompt tokens x kv_bytes_per_token``) is moved
  over ``d2h:<gpu>`` during the same iteration (layer-wise pipelining: the
  transfer overlaps the prefill compute, iteration = max(compute, transfer)).
  The request then decodes only after a fetch.
* **Fetch.** In a decode iteration, an offloaded request that Alg. 1 admits
  gets all its KV blocks reserved on the GPU and its KV is moved back over
  ``h2d:<gpu>`` in that iteration; its CPU-buffer chunks are released.
* **Alg. 2.** ``memory_ext.policy.buffer_scaling.HostBufferRule(B_max, ttft_slo,
  tpot_slo, initial_units=1)``, built as the server builds it (α = 2, a
  violation = 3 misses among the last 5 samples of a metric), sets ``P_B =
  logical - used`` each iteration. After every iteration it is fed one TTFT
  sample per request that got its first token in it (that request's TTFT)
  and at most one TPOT sample: the largest *projected* TPOT among requests
  that decoded in the iteration and the request parked longest in the CPU
  buffer, ``(now - first token + remaining tokens x last decode iteration
  time) / (output - 1)`` -- the SLO is on per-request average TPOT (eLLM
  §6.1), so parking time counts in full. A metric whose SLO is not set
  (infinite) is not sampled.
* Decode queue order for Alg. 1: requests whose KV is on the GPU first
  (admission order), then parked requests (admission order). FCFS over the
  raw admission order would let one parked request that does not fit block
  every resident decode behind it (Alg. 1's ``break``).
* The escape hatch when nothing fits preempts the latest request that holds
  GPU KV (a parked request frees no GPU memory).
* Requires ``prefix_caching: false`` when the buffer is on (an offloaded
  request holds no GPU blocks to publish); eLLM is built on vLLM 0.5.5,
  whose prefix caching is off by default.
* With ``cpu_buffer_gb: 0`` it makes the same decisions as ``ellm`` with
  memoised policy inputs (faster).

Host memory capacity is ``cpu_buffer_gb`` (B_max); link latency is not
modelled (``core/links.py``); neither is the host-side copy cost.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from memory_ext.policy.buffer_scaling import HostBufferRule
from memory_ext.policy.ellm import DecodeRequest, ElasticAdmissionPolicy, PrefillRequest

from ..core.plan import BatchPlan
from ..core.request import RUNNING, Request
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance, InstanceConfig

__all__ = ["EllmScheduler", "EllmElasticScheduler", "DEFAULT_NEW_TOKEN_RATIO", "decode_reserve_blocks"]

DEFAULT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO, sglang 0.5.23 (module docstring)


def decode_reserve_blocks(reqs, ratio: float, block_size: int) -> int:
    """Blocks kept for the future decode growth of ``reqs``: ``ceil(sum of their
    remaining output tokens x ratio / block_size)`` (0 when ``ratio`` is 0)."""
    if ratio <= 0:
        return 0
    tokens = 0
    for r in reqs:
        tokens += r.output_len - r.generated
    if tokens <= 0:
        return 0
    return math.ceil(tokens * ratio / block_size - 1e-9)


class EllmScheduler:
    """Scheduler kind ``ellm`` (module docstring). Options: ``threshold_chunks``
    (θ of Alg. 1), ``new_token_ratio`` (decode reservation; 0 = the paper's
    literal Alg. 1), ``cpu_buffer_blocks`` (0: never offloads)."""

    kind = "ellm"

    def __init__(
        self,
        cfg: InstanceConfig,
        threshold_chunks: int = 0,
        cpu_buffer_blocks: int = 0,
        new_token_ratio: float = DEFAULT_NEW_TOKEN_RATIO,
    ) -> None:
        if (
            isinstance(new_token_ratio, bool)
            or not isinstance(new_token_ratio, (int, float))
            or not 0 <= new_token_ratio <= 1
        ):
            raise ValueError(f"new_token_ratio must be a number in [0, 1], got {new_token_ratio!r}")
        self.name = cfg.name
        block_bytes = cfg.kv_block_bytes
        model, dtype = cfg.model, cfg.weight_dtype

        def act_chunks(tokens: int) -> int:
            return int(math.ceil(model.activation_bytes(tokens, dtype) / block_bytes))

        self.act_chunks = act_chunks
        self.threshold_chunks = threshold_chunks
        self.policy = ElasticAdmissionPolicy(act_chunks, threshold_chunks)
        self.new_token_ratio = float(new_token_ratio)
        self.act_total = cfg.act_blocks
        self.lent = 0  # activation blocks currently lent to the KV pool
        self.cpu_buffer_blocks = cpu_buffer_blocks
        self.decisions = 0
        self.max_lent = 0
        self.deflated = 0  # blocks given back to activation (node arbiter only)
        self.max_reserved = 0  # largest decode reservation passed to Alg. 1

    def _resident_decodes(self, inst: Instance) -> list[Request]:
        return [r for r in inst.running if r.decoding]

    def admission_reserve_blocks(self, inst: Instance) -> int:
        """The decode reserve Alg. 1 keeps out of a prefill's reach right now
        (the node arbiter adds it to what a queued request needs)."""
        return decode_reserve_blocks(self._resident_decodes(inst), self.new_token_ratio, inst.kv.block_size)

    def _reserve(self, kv, resident) -> int:
        n = decode_reserve_blocks(resident, self.new_token_ratio, kv.block_size)
        if n > self.max_reserved:
            self.max_reserved = n
        return n

    def _decide_and_inflate(self, kv, p_reqs, d_reqs, cpu_buffer_free_chunks: int, inst=None, reserved: int = 0):
        """Ask Alg. 1 for this iteration's decision and lend it the idle activation blocks it inflates into.

        Under the node arbiter (``inst.sim.arbiter``) the idle activation is
        the model's ``activation`` account and both inflation and deflation
        (Alg. 1's negative ``I``) are applied through the arbiter; without
        it, deflation is not applied (lent blocks stay with KV)."""
        arb = getattr(inst.sim, "arbiter", None) if inst is not None else None
        idle_act = arb.act_idle_blocks(inst) if arb is not None else self.act_total - self.lent
        d = self.policy.decide(
            free_kv_chunks=kv.available,
            idle_act_chunks=idle_act,
            prefills=p_reqs,
            decodes=d_reqs,
            cpu_buffer_free_chunks=cpu_buffer_free_chunks,
            reserved_chunks=reserved,
        )
        self.decisions += 1
        if arb is not None:
            if d.inflation > 0:
                arb.inflate(inst, d.inflation)
            elif d.inflation < 0:
                arb.deflate(inst, -d.inflation)
                self.deflated += -d.inflation
            self.lent = self.act_total - arb.act_idle_blocks(inst)
            self.max_lent = max(self.max_lent, self.lent)
        elif d.inflation > 0:
            before = kv.capacity
            self.lent += kv.resize(before + d.inflation) - before
            self.max_lent = max(self.max_lent, self.lent)
        return d

    def plan(self, inst: Instance, now: float) -> BatchPlan:
        kv = inst.kv
        bs = kv.block_size
        decodes = self._resident_decodes(inst)
        # a request the policy admitted stays at the head of ``waiting`` until planned
        prefills = list(inst.waiting)[:64]
        if not decodes and not prefills:
            return BatchPlan()
        p_reqs = [PrefillRequest(str(r.rid), r.target, -(-r.target // bs)) for r in prefills]
        d_reqs = [DecodeRequest(str(r.rid), 1 if r.ctx % bs == 0 else 0) for r in decodes]
        reserved = self._reserve(kv, decodes)
        d = self._decide_and_inflate(kv, p_reqs, d_reqs, self.cpu_buffer_blocks, inst, reserved)
        plan = BatchPlan()
        admitted = set(d.admitted)
        if d.phase == "prefill":
            for r in prefills:
                if str(r.rid) not in admitted:
                    break
                inst.waiting.popleft()
                inst.admit(r, now)
                chunk = r.target - r.ctx
                if not inst.reserve(r, chunk):  # prefix hit makes this cheaper, never dearer
                    inst.unadmit(r)
                    break
                plan.prefills.append((r, chunk))
        else:
            for r in decodes:
                if str(r.rid) in admitted and inst.reserve(r, 1):
                    plan.decodes.append(r)
            if not plan and decodes and not inst.in_iteration:
                # nothing fits at all: fall back to the stock escape hatch
                inst.preempt(inst.running[-1])
                return self.plan(inst, now)
        return plan

    def _counters(self) -> dict:
        return {"decisions": self.decisions, "deflated_blocks": self.deflated}

    def _gauges(self) -> dict:
        return {
            "max_lent_blocks": self.max_lent,
            "lent_blocks_final": self.lent,
            "max_decode_reserve_blocks": self.max_reserved,
            "new_token_ratio": self.new_token_ratio,
            "threshold_chunks": self.threshold_chunks,
        }

    def stats(self) -> dict:
        return mechanism_stats("ellm", self.kind, self.name, self._counters(), self._gauges())


class EllmElasticScheduler(EllmScheduler):
    """Scheduler kind ``ellm_elastic``: Alg. 1 + CPU elastic buffer + Alg. 2
    (module docstring).

    Options: ``cpu_buffer_gb`` (B_max, 0 = no buffer), ``buffer_scaling``
    (Alg. 2 on; off = the whole physical buffer is always usable),
    ``alpha``, ``window``, ``misses`` (Alg. 2), ``initial_buffer_blocks``
    (paper: 1), ``threshold_chunks`` (θ of Alg. 1), ``new_token_ratio``
    (decode reservation, as for ``ellm``)."""

    kind = "ellm_elastic"

    def __init__(
        self,
        cfg: InstanceConfig,
        threshold_chunks: int = 0,
        cpu_buffer_gb: float = 0.0,
        buffer_scaling: bool = True,
        alpha: float = 2.0,
        window: int = 5,
        misses: int = 3,
        initial_buffer_blocks: int = 1,
        new_token_ratio: float = DEFAULT_NEW_TOKEN_RATIO,
    ) -> None:
        if isinstance(cpu_buffer_gb, bool) or not isinstance(cpu_buffer_gb, (int, float)) or cpu_buffer_gb < 0:
            raise ValueError(f"cpu_buffer_gb must be a number >= 0, got {cpu_buffer_gb!r}")
        if not isinstance(buffer_scaling, bool):
            raise ValueError(f"buffer_scaling must be true or false, got {buffer_scaling!r}")
        b_max = int(cpu_buffer_gb * 1e9 // cfg.kv_block_bytes)
        if b_max > 0 and cfg.prefix_caching:
            raise ValueError("the CPU buffer needs prefix_caching: false (offloaded requests hold no GPU blocks)")
        super().__init__(
            cfg, threshold_chunks=threshold_chunks, cpu_buffer_blocks=b_max, new_token_ratio=new_token_ratio
        )
        # same policy, memoised activation function (pure in the token count)
        self.policy = type(self.policy)(functools.lru_cache(maxsize=None)(self.act_chunks), threshold_chunks)
        self._dreq: dict[int, tuple] = {}  # rid -> (new, parked, DecodeRequest): frozen, reused
        self.b_max = b_max
        self.rule: HostBufferRule | None = None
        self.scaler = None  # the rule's LogicalBufferScaler (its state: logical size, windows)
        self.events = {"ttft": 0, "tpot": 0}
        if b_max > 0 and buffer_scaling:
            self.rule = HostBufferRule(
                b_max,
                cfg.ttft_slo_s if math.isfinite(cfg.ttft_slo_s) else None,
                cfg.tpot_slo_s if math.isfinite(cfg.tpot_slo_s) else None,
                initial_units=int(initial_buffer_blocks),
                alpha=alpha,
                window=window,
                misses_to_violate=misses,
            )
            self.scaler = self.rule.scaler
            self.events = self.rule.events
        self.block_bytes = cfg.kv_block_bytes
        self.token_bytes = cfg.model.kv_bytes_per_token(cfg.kv_dtype)
        self.parked: dict[int, Request] = {}  # rid -> request whose KV is in the CPU buffer
        self.parked_blocks: dict[int, int] = {}
        self.cpu_used = 0
        self._hooked = False
        self._last_decode_s = 0.0
        # statistics
        self.offloads = self.fetches = 0
        self.offload_bytes = self.fetch_bytes = 0.0
        self.max_cpu_used = 0
        self.ttft_samples = self.tpot_samples = 0
        self.logical_trace = []  # (time, logical blocks) after each iteration that changed it
        self.logical_max = self.rule.logical_units if self.rule is not None else b_max

    # ---- bookkeeping --------------------------------------------------------
    def _sync(self) -> None:
        """Release buffer space of parked requests that left (finished at
        prefill with one output token, or were preempted)."""
        for rid in [rid for rid, r in self.parked.items() if r.state != RUNNING or not r.decoding]:
            self.cpu_used -= self.parked_blocks.pop(rid)
            del self.parked[rid]

    def buffer_free(self) -> int:
        """Alg. 1's ``P_B``."""
        if self.b_max <= 0:
            return 0
        if self.rule is not None:
            return self.rule.available(self.cpu_used)
        return max(self.b_max - self.cpu_used, 0)

    def _resident_decodes(self, inst: Instance) -> list[Request]:
        return [r for r in inst.running if r.decoding and r.rid not in self.parked]

    # ---- Alg. 1 with offload / fetch ----------------------------------------
    def plan(self, inst: Instance, now: float) -> BatchPlan:
        if not self._hooked:
            inst.hooks.append(self)  # Alg. 2 observes every iteration
            self._hooked = True
        self._sync()
        kv = inst.kv
        bs = kv.block_size
        gpu = inst.cfg.gpu
        resident = self._resident_decodes(inst)
        # parked requests in admission order; Alg. 1 stops at the first that does not
        # fit, so only those within the GPU budget (plus one) can matter
        room = kv.available + self.act_total - self.lent
        parked = []
        for rid, r in self.parked.items():
            if room < 0:
                break
            if r.decoding:
                parked.append(r)
                room -= self.parked_blocks[rid]
        decodes = resident + parked
        prefills = list(inst.waiting)[:64]
        if not decodes and not prefills:
            return BatchPlan()
        p_reqs = [PrefillRequest(str(r.rid), r.target, -(-r.target // bs)) for r in prefills]
        d_reqs = []
        cache, pb = self._dreq, self.parked_blocks
        for r in decodes:
            new, off = (1 if r.ctx % bs == 0 else 0), pb.get(r.rid, 0)
            c = cache.get(r.rid)
            if c is None or c[0] != new or c[1] != off:
                c = cache[r.rid] = (new, off, DecodeRequest(str(r.rid), new, off))
            d_reqs.append(c[2])
        if len(cache) > 4 * len(inst.running) + 1024:  # forget finished requests
            live = {r.rid for r in inst.running}
            self._dreq = {k: v for k, v in cache.items() if k in live}
        reserved = self._reserve(kv, resident)
        d = self._decide_and_inflate(kv, p_reqs, d_reqs, self.buffer_free(), inst, reserved)
        plan = BatchPlan()
        admitted = set(d.admitted)
        if d.phase == "prefill":
            offloaded = set(d.offloaded)
            for r in prefills:
                rid = str(r.rid)
                if rid not in admitted:
                    break
                inst.waiting.popleft()
                inst.admit(r, now)
                chunk = r.target - r.ctx
                if rid in offloaded:
                    blocks = -(-r.target // bs)
                    self.parked[r.rid] = r
                    self.parked_blocks[r.rid] = blocks
                    self.cpu_used += blocks
                    self.max_cpu_used = max(self.max_cpu_used, self.cpu_used)
                    nbytes = r.target * self.token_bytes
                    plan.transfers.append((f"d2h:{gpu}", nbytes))
                    self.offloads += 1
                    self.offload_bytes += nbytes
                elif not inst.reserve(r, chunk):
                    inst.unadmit(r)
                    break
                plan.prefills.append((r, chunk))
        else:
            for r in decodes:
                if str(r.rid) not in admitted or not inst.reserve(r, 1):
                    continue
                plan.decodes.append(r)
                if r.rid in self.parked:  # fetch back before its first decode
                    del self.parked[r.rid]
                    self.cpu_used -= self.parked_blocks.pop(r.rid)
                    nbytes = r.ctx * self.token_bytes
                    plan.transfers.append((f"h2d:{gpu}", nbytes))
                    self.fetches += 1
                    self.fetch_bytes += nbytes
            if not plan and decodes and not inst.in_iteration:
                holders = [r for r in inst.running if r.private_blocks or r.cached_keys]
                inst.preempt(holders[-1] if holders else inst.running[-1])
                return self.plan(inst, now)
        return plan

    # ---- Alg. 2: observe each iteration (InstanceHook) ------------------------
    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        pass

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        rule = self.rule
        if rule is None:
            return
        ttfts: list[float] = []
        if rule.scaler.ttft_slo is not None:
            for r, _ in plan.prefills:
                if r.first_token_t == now:
                    ttfts.append(now - r.arrival)
        if plan.decodes:
            self._last_decode_s = duration
        tpot: float | None = None
        if rule.scaler.tpot_slo is not None:
            step = self._last_decode_s
            oldest = next(iter(self.parked.values()), None)  # parked longest (insertion order)
            for group in (plan.decodes, (oldest,) if oldest is not None else ()):
                for r in group:
                    if r.output_len <= 1 or r.first_token_t is None or r.state != RUNNING:
                        continue
                    proj = (now - r.first_token_t + (r.output_len - r.generated) * step) / (r.output_len - 1)
                    tpot = proj if tpot is None else max(tpot, proj)
        if not ttfts and tpot is None:
            return
        self.ttft_samples += len(ttfts)
        self.tpot_samples += tpot is not None
        before = rule.logical_units
        after = rule.observe_iteration(ttfts, tpot)
        if after != before:
            self.logical_trace.append((now, after))
            self.logical_max = max(self.logical_max, after)

    def _counters(self) -> dict:
        c = super()._counters()
        c.update(
            {
                "offloads": self.offloads,
                "fetches": self.fetches,
                "offload_gb": self.offload_bytes / 1e9,
                "fetch_gb": self.fetch_bytes / 1e9,
                "buffer_ttft_events": self.events["ttft"],
                "buffer_tpot_events": self.events["tpot"],
                "buffer_ttft_samples": self.ttft_samples,
                "buffer_tpot_samples": self.tpot_samples,
            }
        )
        return c

    def _gauges(self) -> dict:
        g = super()._gauges()
        g.update(
            {
                "cpu_buffer_blocks": self.b_max,
                "max_cpu_buffer_gb": self.max_cpu_used * self.block_bytes / 1e9,
                "logical_blocks_final": self.rule.logical_units if self.rule else self.b_max,
                "logical_blocks_max": self.logical_max,
            }
        )
        return g
