"""SwiftCache in the simulator (W1-W4): a hierarchical prefix cache whose
spill tier is idle KV memory of peer GPUs (over NVLink) instead of, or before,
host memory (over PCIe).

Hook kind ``swiftcache`` (attach to the *master*, the model with high KV
demand). Options:

* ``tiers``: ordered spill tiers, each ``"peer"`` or ``"host"``. ``["host"]``
  is the HiCache-like baseline, ``["peer"]`` is SwiftCache, ``["peer",
  "host"]`` spills to peers first and demotes their LRU blocks to host.
* ``workers``: names of the co-located models that lend idle KV (other GPUs).
* ``host_gb`` (96): host tier capacity (SwiftCache §5.1 gives baselines 96 GB).
* ``host_link_gbps``: if set, a node-wide host link pair of this bandwidth per
  direction shared by *all* GPUs (the paper's testbed: PCIe 4.0, 32 GB/s
  shared by four GPUs); otherwise the per-GPU ``h2d:g`` / ``d2h:g`` links.
* ``nvlink_gbps``: if set, per-GPU NVLink egress links of this bandwidth
  (the paper's testbed: 400 GB/s bidirectional = 200 per direction);
  otherwise the calibration table's ``nvlink:g``.
* ``layer_stream`` (false): W2. Peer memory backs the master's layer stream
  cache instead of a spill tier: the master's context capacity becomes
  ``N_LSC + N_RC`` blocks (Eq. 1-5), and each iteration streams the KV of
  the blocks beyond the regular cache from the peers over NVLink.
* ``window_s`` (60), ``tick_s`` (5): Alg. 1 SCALEDOWN window and period.
* ``worker_reserve_tokens`` (0): the worker never lends below this many
  tokens of its own KV (``min_blocks`` of the policy). The paper has no such
  floor (Alg. 1 SCALEDOWN keeps only the window's longest request), so the
  default is 0; ``combined_x1`` pins the 16384 it was measured with.
* ``peer_access`` (``move``): how the master uses a block a peer holds.
  ``move`` -- loaded back once per request over the peer's NVLink egress
  into a GPU block and removed from the peer (exclusive: the master's RC and
  the peers' offloaded prefix cache hold different blocks, so lent memory
  *adds* prefix capacity, §3.2, §5.2 "utilizes idle GPU memory on worker GPUs
  to expand the capacity of the prefix cache"; per-request loads as in
  Fig. 10-11). ``copy`` -- as ``move`` but the peer keeps its copy
  (inclusive, like the host tier; the pre-issue-16 model). ``stream`` -- the
  block stays on the peer and every iteration of every request using it
  streams it layer by layer into the layer stream cache (§3.2-3.3); the LSC
  buffer (Eq. 4) is carved out of the master's KV, RC gets the rest (Eq. 5).

Mechanism and mapping to ``memory_ext.policy.swiftcache``:

* The master's ``inst.kv`` is replaced by ``TieredKVCache``: blocks the
  radix cache evicts (LRU, deepest first) are *spilled* -- copied to the
  first tier with room (async store transfer on the master's egress link,
  not waited for). A lookup that misses on the GPU continues in the tiers;
  a tier hit takes a GPU block and *loads* the block over the tier's link
  (peer: ``nvlink:<peer>``; host: ``h2d``); the iteration that first uses it
  waits for the load (overlapping compute, like a layer-wise pipelined load).
  The host tier is inclusive (HiCache write-through: a loaded block keeps its
  host copy, so evicting it again costs no store); the peer tier follows
  ``peer_access``. A lookup first finds the whole hit and makes its tier
  blocks MRU, so the spills that loading it causes never evict the rest of
  the same chain.
* Each worker runs ``ElasticWorkerPolicy`` with the MEU of ``min_elastic_unit``
  (Eq. 6-9). Its demand is the aggregate need of its running and waiting
  requests (R4: aggregate token count). SCALEUP runs before each worker
  scheduling decision, SCALEDOWN every ``tick_s`` over the last
  ``window_s``. Released worker blocks leave the worker's pool
  (``kv.resize``); only blocks actually freed are lent, in whole MEUs, so
  lent memory never exceeds the worker's idle blocks. The master's peer tier
  for that worker holds ``units * MEU_m`` master blocks; on SCALEUP the
  master's blocks beyond the new capacity are dropped (or demoted to the
  next tier).
* In ``layer_stream`` mode lending is decided once at start (SCALEDOWN with
  an empty window) and stays static; ``plan_lsc`` sizes LSC and RC.

Under the node arbiter (scenario key ``arbiter``) lending and reclaiming go
through ``mechanisms.arbiter.SimArbiter`` (``lend_peer`` / ``reclaim_peer``): the
lent blocks become the master's ``peer`` account on the worker's GPU, and the
policy's ``current_blocks`` is re-read from the worker's pool before each
decision, since Select-N and the arbiter also resize it.

Not modelled: block-table sync latency (ZeroMQ), the cost of remapping
(O(1) in the block-major layout), per-layer pipeline bubbles beyond the
first layer's load; the KV store of newly computed tokens in layer-stream
mode and in ``peer_access: stream`` (new tokens stay in RC); a peer block
being streamed is never reclaimed or dropped (reclaim waits for its readers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from memory_ext.policy.swiftcache import ElasticWorkerPolicy, KVGeometry, min_elastic_unit, plan_lsc

from ..core.kvcache import KVCache
from ..core.plan import BatchPlan
from ..core.stats import mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance

__all__ = ["TieredKVCache", "SwiftCacheHook", "Tier", "kv_geometry"]

_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


def kv_geometry(inst: Instance) -> KVGeometry:
    m = inst.cfg.model
    return KVGeometry(m.layers, inst.cfg.block_size, m.kv_heads, m.head_dim, _BYTES[inst.cfg.kv_dtype])


class Tier:
    """One spill tier: capacity in master blocks, LRU of stored keys."""

    def __init__(
        self, name: str, capacity: int, load_link: str, store_link: str, demote_link: str | None = None
    ) -> None:
        self.name, self.capacity = name, int(capacity)
        self.load_link, self.store_link, self.demote_link = load_link, store_link, demote_link
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.is_peer = name.startswith("peer")
        self.stored = self.loaded = self.dropped = self.demoted = self.streamed = 0
        self.max_used = 0

    def summary(self) -> dict:
        return {
            "capacity_blocks": self.capacity,
            "used_blocks": len(self.keys),
            "max_used_blocks": self.max_used,
            "stored_blocks": self.stored,
            "loaded_blocks": self.loaded,
            "dropped_blocks": self.dropped,
            "demoted_blocks": self.demoted,
            "streamed_hit_blocks": self.streamed,
            "load_link": self.load_link,
            "store_link": self.store_link,
        }


class TieredKVCache(KVCache):
    """``KVCache`` whose evictions spill into ``hook``'s tiers and whose
    lookups continue into them. ``capacity`` is a property so that the hook
    can bind to the simulator (find its workers) on first use."""

    def __init__(self, base: KVCache, hook: SwiftCacheHook) -> None:
        self._hook = hook
        self._bound = False
        # peer-held blocks read in place through the layer stream cache (not
        # copied into a GPU block): key -> number of running requests using it
        self.streamed: dict[Hashable, int] = {}
        super().__init__(base.capacity, base.block_size, base.prefix_caching)

    @property
    def capacity(self) -> int:  # type: ignore[override]
        if not self._bound and self._hook.inst.sim is not None:
            self._bound = True
            self._hook.bind()
        return self._cap

    @capacity.setter
    def capacity(self, v: int) -> None:
        self._cap = int(v)

    def release_cached(self, keys: list[Hashable]) -> None:
        streamed = self.streamed
        if not streamed:
            super().release_cached(keys)
            return
        gpu = []
        for k in keys:
            r = streamed.get(k)
            if r is None:
                gpu.append(k)
            elif r == 1:
                del streamed[k]
            else:
                streamed[k] = r - 1
        super().release_cached(gpu)

    def check(self) -> None:
        super().check()
        assert all(r > 0 for r in self.streamed.values()), "a streamed peer block without a reader"
        assert all(self._hook.where.get(k) is not None for k in self.streamed), "a streamed block left its tier"

    def _evict(self, n: int) -> None:
        lru, refs = self.lru, self.refs
        keys = []
        for _ in range(n):
            k, _ = lru.popitem(last=False)
            del refs[k]
            keys.append(k)
        self.evicted += n
        self._hook.spill(keys)

    def match(self, keys: Iterable[Hashable]) -> int:
        if not self.prefix_caching:
            return 0
        n = 0
        refs, lru, hook = self.refs, self.lru, self._hook
        streamed, stream_peer = self.streamed, hook.peer_access == "stream"
        keys = list(keys)
        where = hook.where
        # the whole hit is found first and its tier blocks become MRU, so the
        # spills that loading it causes evict other blocks, never the rest of
        # this chain (a radix lookup, then a load-back of the matched nodes)
        for k in keys:
            if k in refs:
                continue
            t = where.get(k)
            if t is None:
                break
            t.keys.move_to_end(k)
        for k in keys:
            r = refs.get(k)
            if r is None:
                tier = hook.where.get(k)
                if tier is None:
                    break
                if stream_peer and tier.is_peer:  # §3.2: used in place, streamed per layer into the LSC
                    streamed[k] = streamed.get(k, 0) + 1
                    tier.keys.move_to_end(k)
                    tier.streamed += 1
                    hook.tier_hit_blocks += 1
                    n += 1
                    continue
                if self.free <= 0 and not self.lru:
                    break
                self.allocate(1)  # may evict (and spill) an unreferenced block
                self.private -= 1
                tier = hook.where.get(k)
                if tier is None:  # the spill just pushed it out of the last tier
                    break
                refs[k] = 1
                hook.loaded(k, tier)
                n += 1
                continue
            if r == 0:
                del lru[k]
            refs[k] = r + 1
            n += 1
        return n


class _WorkerState:
    def __init__(self, inst: Instance, policy: ElasticWorkerPolicy, meu_m: int, tier: Tier | None) -> None:
        self.inst, self.policy, self.meu_m, self.tier = inst, policy, meu_m, tier
        self.original_blocks = inst.kv.capacity
        self.last_demand = -1
        self.scale_ups = self.scale_downs = 0
        self.max_donated = 0

    @property
    def donated_units(self) -> int:
        return self.policy.donated_blocks // self.policy.meu_worker


class _ScaleUpScheduler:
    """Wraps a worker's scheduler: runs Alg. 1 SCALEUP before each decision."""

    def __init__(self, inner, hook: SwiftCacheHook, w: _WorkerState) -> None:
        self.inner, self.hook, self.w = inner, hook, w

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def on_arrival(self, inst: Instance, req, now: float) -> None:
        """Alg. 1 SCALEUP is triggered by the incoming request (§3.5), before
        the engine decides whether it can ever fit; like the paper's trigger, only
        when the current allocation cannot hold the request."""
        tokens = req.prompt_len + req.output_len
        if -(-tokens // inst.kv.block_size) > inst.kv.capacity:
            self.hook.worker_demand(self.w, now, tokens)

    def plan(self, inst: Instance, now: float) -> BatchPlan:
        self.hook.worker_demand(self.w, now)
        self.hook.maybe_tick(now)
        return self.inner.plan(inst, now)


class SwiftCacheHook:
    """See the module docstring."""

    def __init__(
        self,
        inst: Instance,
        tiers: list[str] | None = None,
        workers: list[str] | None = None,
        host_gb: float = 96.0,
        host_link_gbps: float | None = None,
        nvlink_gbps: float | None = None,
        layer_stream: bool = False,
        window_s: float = 60.0,
        tick_s: float = 5.0,
        worker_reserve_tokens: int = 0,
        warm_prefixes: bool = False,
        peer_access: str = "move",
    ) -> None:
        tiers = list(tiers if tiers is not None else ["peer"])
        for t in tiers:
            if t not in ("peer", "host"):
                raise ValueError(f"tiers: expected 'peer' or 'host', got {t!r}")
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"tiers: each tier at most once, got {tiers}")
        if ("peer" in tiers or layer_stream) and not workers:
            raise ValueError("workers: a non-empty list of model names is needed for peer memory")
        if peer_access not in ("move", "copy", "stream"):
            raise ValueError(f"peer_access: expected 'move', 'copy' or 'stream', got {peer_access!r}")
        if host_gb < 0 or tick_s <= 0 or window_s <= 0 or worker_reserve_tokens < 0:
            raise ValueError("host_gb, worker_reserve_tokens must be >= 0; tick_s, window_s > 0")
        self.inst = inst
        self.tier_kinds = tiers
        self.worker_names = list(workers or [])
        self.host_gb, self.host_link_gbps, self.nvlink_gbps = host_gb, host_link_gbps, nvlink_gbps
        self.layer_stream = layer_stream
        self.window_s, self.tick_s = window_s, tick_s
        self.worker_reserve_tokens = worker_reserve_tokens
        self.warm_prefixes = warm_prefixes
        self.peer_access = peer_access
        self.warm_blocks = 0
        self.lsc_prefix = None  # LSC plan of the latency mode (peer_access stream)
        self._req_stream: dict[int, tuple[int, dict[str, float]]] = {}
        self.stream_prefix_bytes = 0.0
        self.stream_exposed_s = 0.0
        self.block_bytes = inst.cfg.kv_block_bytes
        self.where: dict[Hashable, Tier] = {}
        self.tiers: list[Tier] = []
        self.workers: list[_WorkerState] = []
        self.pending: dict[str, float] = {}
        self.tier_hit_blocks = 0
        self.last_tick = 0.0
        self.lsc = None
        self.stream_bytes = 0.0
        self.stream_iterations = 0
        self.base_capacity = inst.kv.capacity
        inst.kv = TieredKVCache(inst.kv, self)

    # ---- binding (first use after the Simulator exists) --------------------
    def _link(self, kind: str, gpu: int) -> str:
        links = self.inst.sim.links
        if kind in ("h2d", "d2h") and self.host_link_gbps:
            name = f"host_shared_{kind}"
            if name not in links:
                links.add(name, self.host_link_gbps * 1e9)
            return name
        if kind == "nvlink" and self.nvlink_gbps:
            name = f"nvlink_sc:{gpu}"
            if name not in links:
                links.add(name, self.nvlink_gbps * 1e9)
            return name
        name = f"{kind}:{gpu}"
        if name not in links:
            raise ValueError(f"link {name} does not exist on this node (set nvlink_gbps / host_link_gbps)")
        return name

    def bind(self) -> None:
        sim, me = self.inst.sim, self.inst
        by_name = {i.cfg.name: i for i in sim.instances}
        g_master = kv_geometry(me)
        peer_tiers = []
        for name in self.worker_names:
            if name not in by_name or by_name[name] is me:
                raise ValueError(f"swiftcache: worker {name!r} is not another model of this scenario")
            w = by_name[name]
            if w.cfg.gpu == me.cfg.gpu:
                raise ValueError(f"swiftcache: worker {name!r} must be on another GPU than the master")
            unit = min_elastic_unit(g_master, kv_geometry(w))
            bs = w.kv.block_size
            pol = ElasticWorkerPolicy.from_unit(
                unit,
                block_size=bs,
                current_blocks=w.kv.capacity,
                window_s=self.window_s,
                min_blocks=min(w.kv.capacity, -(-self.worker_reserve_tokens // bs)),
            )
            tier = None
            if "peer" in self.tier_kinds and not self.layer_stream:
                tier = Tier(
                    f"peer:{name}",
                    0,
                    self._link("nvlink", w.cfg.gpu),
                    self._link("nvlink", me.cfg.gpu),
                    self._link("d2h", w.cfg.gpu),
                )
                peer_tiers.append(tier)
            ws = _WorkerState(w, pol, unit.meu_master, tier)
            self.workers.append(ws)
            if not self.layer_stream:
                w.scheduler = _ScaleUpScheduler(w.scheduler, self, ws)
            self._scale_down(ws, 0.0)
        for kind in self.tier_kinds:
            if kind == "peer" and not self.layer_stream:
                self.tiers.extend(peer_tiers)
            elif kind == "host":
                cap = int(self.host_gb * 1e9 // self.block_bytes)
                self.tiers.append(Tier("host", cap, self._link("h2d", me.cfg.gpu), self._link("d2h", me.cfg.gpu)))
        if not self.layer_stream and self.peer_access == "stream" and peer_tiers:
            # §3.2 Eq. 4-5: the LSC buffer (one layer of every block the peers
            # can hold) is carved out of the master's local KV; RC keeps the rest
            lent = [int(ws.policy.donated_blocks * ws.inst.cfg.kv_block_bytes) for ws in self.workers]
            self.lsc_prefix = plan_lsc(g_master, int(self.base_capacity * self.block_bytes), lent)
            me.kv.resize(self.lsc_prefix.n_rc)
        if self.layer_stream:
            lent = [int(ws.policy.donated_blocks * ws.inst.cfg.kv_block_bytes) for ws in self.workers]
            self.lsc = plan_lsc(g_master, int(self.base_capacity * self.block_bytes), lent)
            self.stream_links = [
                (self._link("nvlink", ws.inst.cfg.gpu), k) for ws, k in zip(self.workers, self.lsc.k_workers)
            ]
            me.kv._cap = self.lsc.max_context_blocks
        if self.warm_prefixes:
            self._warm()

    def _warm(self) -> None:
        """The paper's warm-up (§5.1): every shared system prompt / document
        of this model is already cached before the run -- on the GPU while it
        has free blocks, then in the tiers in order (no transfer charged)."""
        kv, me = self.inst.kv, self.inst
        bs, seen = kv.block_size, set()
        for r in me.sim.requests:
            if r.model != me.idx or r.sys_key is None or r.sys_key in seen:
                continue
            seen.add(r.sys_key)
            for j in range(r.sys_len // bs):
                k = (r.sys_key, j)
                if kv.free > 0:
                    kv.refs[k] = 0
                    kv.lru[k] = None
                else:
                    t = next((t for t in self.tiers if t.capacity > len(t.keys)), None)
                    if t is None:
                        break
                    t.keys[k] = None
                    self.where[k] = t
                self.warm_blocks += 1

    # ---- worker elasticity (Alg. 1) ------------------------------------------
    @staticmethod
    def _demand_tokens(w: Instance) -> int:
        bs = w.kv.block_size
        n = 0
        for r in w.running:
            n += -(-(r.prompt_len + r.output_len) // bs)
        for i, r in enumerate(w.waiting):
            if i >= w.cfg.max_running:
                break
            n += -(-(r.prompt_len + r.output_len) // bs)
        return n * bs

    def worker_demand(self, ws: _WorkerState, now: float, extra_tokens: int = 0) -> None:
        bs = ws.inst.kv.block_size
        d = self._demand_tokens(ws.inst) + -(-extra_tokens // bs) * bs
        if d == ws.last_demand:
            return
        ws.last_demand = d
        arb = self.inst.sim.arbiter
        if arb is not None:  # other mechanisms (Select-N, the arbiter) also resize the worker's pool
            ws.policy.current_blocks = ws.inst.kv.capacity
        dec = ws.policy.on_request(now, d)
        if dec.changed:
            ws.scale_ups += 1
            if arb is not None:
                arb.reclaim_peer(ws.inst, self.inst, dec.worker_blocks)
            else:
                ws.inst.kv.resize(ws.inst.kv.capacity + dec.worker_blocks)
            if ws.tier is not None:
                ws.tier.capacity = ws.donated_units * ws.meu_m
                self._shrink(ws.tier)

    def maybe_tick(self, now: float) -> None:
        if now - self.last_tick < self.tick_s or self.layer_stream:
            return
        self.last_tick = now
        for ws in self.workers:
            ws.policy.on_request(now, max(self._demand_tokens(ws.inst), 0))  # keeps the window current
            self._scale_down(ws, now)

    def _scale_down(self, ws: _WorkerState, now: float) -> None:
        pol, kv = ws.policy, ws.inst.kv
        arb = self.inst.sim.arbiter
        if arb is not None:
            pol.current_blocks = kv.capacity
        before_cur, before_don = pol.current_blocks, pol.donated_blocks
        dec = pol.on_tick(now)
        if not dec.changed:
            return
        if arb is not None:
            # lend only idle blocks, in whole MEUs, through the node arbiter
            lent = min(dec.worker_blocks, kv.available) // pol.meu_worker * pol.meu_worker
            arb.lend_peer(ws.inst, self.inst, lent)
            pol.current_blocks = kv.capacity
            pol.donated_blocks = before_don + lent
            if lent:
                ws.scale_downs += 1
            ws.max_donated = max(ws.max_donated, pol.donated_blocks)
            if ws.tier is not None:
                ws.tier.capacity = ws.donated_units * ws.meu_m
            return
        target = kv.capacity - dec.worker_blocks
        got = kv.resize(target)  # never takes blocks in use
        freed = before_cur - got
        units = max(0, freed) // pol.meu_worker
        lent = units * pol.meu_worker
        if got != before_cur - lent:  # give back the part that is not a whole MEU
            kv.resize(before_cur - lent)
        pol.current_blocks = before_cur - lent
        pol.donated_blocks = before_don + lent
        if lent:
            ws.scale_downs += 1
        ws.max_donated = max(ws.max_donated, pol.donated_blocks)
        if ws.tier is not None:
            ws.tier.capacity = ws.donated_units * ws.meu_m

    # ---- tiers -----------------------------------------------------------------
    def _start(self, link: str, nbytes: float) -> None:
        self.inst.sim.links[link].start(nbytes)

    def _insert(self, ti: int, key: Hashable) -> None:
        """Put ``key`` into tier ``ti`` or a later one with room; a full tier
        demotes its LRU block to the next tier (or drops it)."""
        while ti < len(self.tiers):
            t = self.tiers[ti]
            if t.capacity <= 0:
                ti += 1
                continue
            if len(t.keys) >= t.capacity:
                old = self._victim(t)
                if old is None:  # every block of the tier is being streamed: the new one is dropped
                    t.dropped += 1
                    return
                del t.keys[old]
                del self.where[old]
                host = self._host_after(ti)
                if host is not None and t.demote_link:  # peer -> host demotion
                    t.demoted += 1
                    self._start(t.demote_link, self.block_bytes)
                    self._insert(host, old)
                else:
                    t.dropped += 1
            t.keys[key] = None
            self.where[key] = t
            t.max_used = max(t.max_used, len(t.keys))
            return

    def _victim(self, t: Tier) -> Hashable | None:
        """The tier's LRU block that no running request is streaming."""
        streamed = self.inst.kv.streamed
        if not streamed:
            return next(iter(t.keys), None)
        for k in t.keys:
            if k not in streamed:
                return k
        return None

    def _host_after(self, ti: int) -> int | None:
        for j in range(ti + 1, len(self.tiers)):
            if self.tiers[j].name == "host":
                return j
        return None

    def _shrink(self, t: Tier) -> None:
        """SCALEUP took peer memory back: blocks beyond the tier's new
        capacity are demoted to the host tier (if any) or dropped."""
        host = self._host_after(self.tiers.index(t))
        while len(t.keys) > max(t.capacity, 0):
            old = self._victim(t)
            if old is None:  # the rest is being streamed by running requests: freed when they finish
                break
            del t.keys[old]
            del self.where[old]
            if host is not None and t.demote_link:
                t.demoted += 1
                self._start(t.demote_link, self.block_bytes)
                self._insert(host, old)
            else:
                t.dropped += 1

    def spill(self, keys: list[Hashable]) -> None:
        if not self.tiers:
            return
        for k in keys:
            t = self.where.get(k)
            if t is not None:  # inclusive hierarchy: the copy is still there
                t.keys.move_to_end(k)
                continue
            # first tier with room (peers: the emptiest one)
            cands = [x for x in self.tiers if x.capacity > len(x.keys)]
            if cands:
                peers = [x for x in cands if x.name.startswith("peer")]
                first = cands[0]
                tgt = (
                    max(peers, key=lambda x: x.capacity - len(x.keys))
                    if (peers and first.name.startswith("peer"))
                    else first
                )
                tgt.keys[k] = None
                self.where[k] = tgt
                tgt.max_used = max(tgt.max_used, len(tgt.keys))
                tgt.stored += 1
                self._start(tgt.store_link, self.block_bytes)
            else:
                first = next((i for i, x in enumerate(self.tiers) if x.capacity > 0), None)
                if first is None:
                    continue
                self.tiers[first].stored += 1
                self._start(self.tiers[first].store_link, self.block_bytes)
                self._insert(first, k)

    def loaded(self, key: Hashable, tier: Tier) -> None:
        tier.loaded += 1
        if self.peer_access == "move" and tier.is_peer:  # exclusive: the block moves back to the master
            del tier.keys[key]
            del self.where[key]
        else:
            tier.keys.move_to_end(key)
        self.tier_hit_blocks += 1
        self.pending[tier.load_link] = self.pending.get(tier.load_link, 0.0) + self.block_bytes

    # ---- per iteration -----------------------------------------------------------
    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        if not inst.kv._bound:
            inst.kv.capacity  # bind  # noqa: B018
        self.maybe_tick(now)
        if self.pending:
            for link, nbytes in self.pending.items():
                plan.transfers.append((link, nbytes))
            self.pending = {}
        if inst.kv.streamed:
            self._stream_prefixes(inst, plan)
        if self.lsc is not None:
            bs = inst.kv.block_size
            blocks = 0
            for r in plan.decodes:
                blocks += -(-(r.ctx + 1) // bs)
            for r, chunk in plan.prefills:
                blocks += -(-(r.ctx + chunk) // bs)
            streamed = blocks - self.lsc.n_rc
            if streamed > 0:
                total_k = sum(k for _, k in self.stream_links) or 1
                for link, k in self.stream_links:
                    share = streamed * k / total_k * self.block_bytes
                    if share > 0:
                        plan.transfers.append((link, share))
                        self.stream_bytes += share
                self.stream_iterations += 1

    def _request_stream(self, r) -> dict[str, float]:
        """Bytes of ``r``'s peer-held prefix per worker link (fixed from admission:
        later blocks of the request are computed into RC)."""
        keys = r.cached_keys
        memo = self._req_stream.get(id(r))
        if memo is not None and memo[0] == id(keys):
            return memo[1]
        streamed, where, per = self.inst.kv.streamed, self.where, {}
        if streamed:
            for k in keys:
                if k in streamed:
                    link = where[k].load_link
                    per[link] = per.get(link, 0.0) + self.block_bytes
        self._req_stream[id(r)] = (id(keys), per)
        return per

    def _stream_prefixes(self, inst: Instance, plan: BatchPlan) -> None:
        """§3.2-3.3: every iteration that runs a request whose prefix is held
        by a peer loads that prefix layer by layer into the LSC over the
        peer's NVLink egress, overlapped with compute (the iteration lasts
        max(compute, transfer)); only layer 1's load precedes the first
        attention, so 1/L of the largest per-link load is added un-overlapped."""
        total: dict[str, float] = {}
        for r in plan.decodes:
            for link, b in self._request_stream(r).items():
                total[link] = total.get(link, 0.0) + b
        for r, _chunk in plan.prefills:
            for link, b in self._request_stream(r).items():
                total[link] = total.get(link, 0.0) + b
        if not total:
            return
        links, layers = inst.sim.links, inst.cfg.model.layers
        first = 0.0
        for link, b in total.items():
            plan.transfers.append((link, b))
            self.stream_prefix_bytes += b
            first = max(first, b / layers / links[link].bandwidth)
        plan.extra_s += first
        self.stream_exposed_s += first

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        if len(self._req_stream) > 4 * (len(inst.running) + 64):  # forget finished requests
            live = {id(r) for r in inst.running}
            self._req_stream = {k: v for k, v in self._req_stream.items() if k in live}

    # ---- reporting -------------------------------------------------------------------
    def stats(self) -> dict:
        """Common shape (``core.stats``); per-tier and per-worker breakdowns in ``details``."""
        tiers = {t.name: t.summary() for t in self.tiers}
        workers = {
            ws.inst.cfg.name: {
                "original_blocks": ws.original_blocks,
                "current_blocks": ws.policy.current_blocks,
                "donated_blocks": ws.policy.donated_blocks,
                "max_donated_blocks": ws.max_donated,
                "meu_worker": ws.policy.meu_worker,
                "meu_master": ws.meu_m,
                "scale_ups": ws.scale_ups,
                "scale_downs": ws.scale_downs,
            }
            for ws in self.workers
        }
        counters = {
            "tier_hit_blocks": self.tier_hit_blocks,
            "stored_blocks": sum(t.stored for t in self.tiers),
            "loaded_blocks": sum(t.loaded for t in self.tiers),
            "dropped_blocks": sum(t.dropped for t in self.tiers),
            "demoted_blocks": sum(t.demoted for t in self.tiers),
            "worker_scale_ups": sum(ws.scale_ups for ws in self.workers),
            "worker_scale_downs": sum(ws.scale_downs for ws in self.workers),
            "stream_iterations": self.stream_iterations,
            "stream_gb": self.stream_bytes / 1e9,
            "streamed_hit_blocks": sum(t.streamed for t in self.tiers),
            "prefix_stream_gb": self.stream_prefix_bytes / 1e9,
            "prefix_stream_exposed_s": self.stream_exposed_s,
        }
        gauges = {
            "warm_blocks": self.warm_blocks,
            "lent_blocks_max": sum(ws.max_donated for ws in self.workers),
            "lent_blocks_final": sum(ws.policy.donated_blocks for ws in self.workers),
            "tier_capacity_blocks": sum(t.capacity for t in self.tiers),
        }
        details: dict = {"tiers": tiers, "workers": workers, "peer_access": self.peer_access}
        if self.lsc_prefix is not None:
            details["lsc_prefix"] = {
                "n_lsc": self.lsc_prefix.n_lsc,
                "n_rc": self.lsc_prefix.n_rc,
                "k_master": self.lsc_prefix.k_master,
                "k_workers": list(self.lsc_prefix.k_workers),
            }
        if self.lsc is not None:
            gauges["max_context_tokens"] = self.lsc.max_context_tokens
            gauges["baseline_context_tokens"] = self.base_capacity * self.inst.kv.block_size
            gauges["max_context_ratio"] = self.lsc.max_context_tokens / max(gauges["baseline_context_tokens"], 1)
            details["lsc"] = {
                "n_lsc": self.lsc.n_lsc,
                "n_rc": self.lsc.n_rc,
                "k_master": self.lsc.k_master,
                "k_workers": list(self.lsc.k_workers),
                "max_context_tokens": self.lsc.max_context_tokens,
                "baseline_context_tokens": self.base_capacity * self.inst.kv.block_size,
                "stream_bytes": self.stream_bytes,
                "stream_iterations": self.stream_iterations,
            }
        return mechanism_stats("swiftcache", "swiftcache", self.inst.cfg.name, counters, gauges, details)
