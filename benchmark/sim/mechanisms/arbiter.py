"""The node-wide memory arbiter in the simulator (scenario key ``arbiter``):
the glue that lets the mechanisms compose (X1, scenario ``combined_x1``).

``attach_arbiter(sim, spec)`` puts one ``memory_ext.policy.arbiter.MemoryArbiter``
in charge of every GPU's memory budget (``memory_fraction x HBM``) and routes
every capacity change of every mechanism through it. Accounts per model:
``weights`` (one layer always stays), ``activation`` (the activation reserve
of the memory plan), ``kv`` (its KV pool, unit = one KV block) and, for a
SwiftCache master, a ``peer`` account on each worker's GPU. Invariant (checked
after every change and by ``Simulator.check``): each instance's
``kv.capacity x block_bytes`` equals its ``kv`` account, and on every GPU the
accounts plus the free budget add up to the budget exactly.

Who calls what (``SimArbiter`` methods):

* every instance, before each plan (``_BalancingScheduler``; ``_ArbiterHook``
  after each iteration re-kicks instances that found nothing to run): when its
  free + evictable KV is below ``low_watermark_frac`` of its planned KV (or
  below what the head of its queue needs: its prompt plus the scheduler's
  admission reserve, if it declares one), ``grow`` asks for enough to reach
  ``high_watermark_frac`` -- from free budget, then borrowed memory that sits
  idle, then (``share_kv``) idle KV of models with no work, then free KV of
  busy models beyond their own high watermark; donors shrink their pools by
  exactly what was taken (never blocks in use). A model below its nominal
  (it lent memory) that stays short files a *claim*: before every plan on
  its GPU, borrowers' idle memory goes back to it as it frees up (so a
  borrower cannot re-admit into it), until it is no longer short or holds
  its nominal again. An instance left with nothing to run is re-kicked after
  the next iteration on its GPU;
* Oneiros (``mechanisms.oneiros``): a shortage is first served by ``grow``; only
  the rest may REMAP (``remap``: one layer of the model the controller names
  into the borrower's KV -- the arbiter refuses it while idle memory remains,
  when the named model has work, or when the borrower's own weights are
  remapped out; a refusal is a HOLD).
  RESTORE (``restore``) takes the layer back from free budget or idle
  borrowed KV: when the controller finds the lent layer empty, all or nothing
  with every model keeping its high watermark free, else deferred; when the
  lender has work again (it pays for streaming; the arbiter's own rule, not
  Oneiros's), by *draining*: idle borrowed memory
  is gathered as it frees up, before every plan on the GPU, so that a
  borrower whose scheduler fills every free block (eLLM) cannot hold the
  layer forever. A controller decision naming the borrower itself is held
  (no self-remap);
* eLLM (``mechanisms.ellm.EllmScheduler``): Alg. 1's idle activation is the
  model's ``activation`` account; inflation and deflation (``inflate`` /
  ``deflate``) move blocks between its own accounts;
* Select-N / FlexGen-like / layer streaming (``offload``): the freed weight
  memory becomes the model's own KV;
* SwiftCache (``lend_peer`` / ``reclaim_peer``): SCALEDOWN moves a worker's
  idle KV into the master's peer account on the worker's GPU, SCALEUP moves
  it back. ``layer_stream`` mode is not supported under the arbiter.

Not routed: FineServe's slab pool (not part of X1).

Link use is arbitrated by the fair-share links: weight streaming (Oneiros /
Select-N) and host-tier traffic share ``h2d``/``d2h``, peer KV traffic uses
NVLink. Without ``arbiter`` the mechanisms resize pools on their own, as in
the single-paper scenarios. ``mechanism_counters(sim)`` reports, per
mechanism, a figure that is > 0 when that mechanism acted in a run (read from
the mechanisms' common ``stats()``; used by the X1 test and the docs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memory_ext.policy.arbiter import DEFAULT_TIERS, AccountKey, Kind, MemoryArbiter, Tier

from ..core.hardware import gpu_spec
from ..core.plan import BatchPlan
from ..core.stats import collect_mechanism_stats, mechanism_stats

if TYPE_CHECKING:  # pragma: no cover
    from ..core.engine import Instance, Simulator
    from ..core.spec import ArbiterSpec, ScenarioSpec

__all__ = ["SimArbiter", "attach_arbiter", "mechanism_counters"]


class _BalancingScheduler:
    """Wraps an instance's scheduler: asks the arbiter for KV before each plan."""

    def __init__(self, inner, arb: SimArbiter) -> None:
        self.inner, self.arb = inner, arb

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def plan(self, inst: Instance, now: float) -> BatchPlan:
        self.arb.before_plan(inst)
        p = self.inner.plan(inst, now)
        if not p and (inst.waiting or inst.running):
            self.arb.starved[inst.cfg.gpu].add(inst)
        return p


class _ArbiterHook:
    """Hook on every instance: after an iteration on a GPU, instances of that
    GPU that found nothing to run (memory held by others) try again. Its
    ``stats`` are the arbiter's dealings with this instance."""

    def __init__(self, arb: SimArbiter, inst: Instance) -> None:
        self.arb, self.inst = arb, inst
        self.kicks = 0

    def before_iteration(self, inst: Instance, plan: BatchPlan, now: float) -> None:
        pass

    def after_iteration(self, inst: Instance, plan: BatchPlan, now: float, duration: float) -> None:
        st = self.arb.starved[inst.cfg.gpu]
        if st:
            for other in list(st):
                if other is not inst:
                    st.discard(other)
                    other.kick()
                    self.kicks += 1

    def stats(self) -> dict:
        arb, i = self.arb, self.inst.idx
        bb = arb.bb[i]
        _, a, k = arb.keys[i]
        return mechanism_stats(
            "arbiter",
            "arbiter",
            self.inst.cfg.name,
            {"grow_calls": arb.grow_calls_by.get(i, 0), "kicks_after_iteration": self.kicks},
            {
                "kv_blocks_planned": self.inst.cfg.kv_blocks,
                "kv_blocks_final": arb.policy.held(k) // bb,
                "activation_blocks_final": arb.policy.held(a) // bb,
                "low_watermark_blocks": arb.low[i],
                "high_watermark_blocks": arb.high[i],
            },
        )


class SimArbiter:
    """Glue between the simulator's instances and ``MemoryArbiter`` (module docstring)."""

    def __init__(self, sim: Simulator, spec: ScenarioSpec, opts: ArbiterSpec) -> None:
        g = gpu_spec(spec.node.gpu)
        budgets = {i: int(g.mem_bytes * spec.node.memory_fraction) for i in range(spec.node.count)}
        tiers = DEFAULT_TIERS if opts.share_kv else (Tier.FREE, Tier.RETURN)
        self.policy = MemoryArbiter(budgets, opts.floor_fraction, tiers)
        self.opts = opts
        self.sim = sim
        self.insts: dict[tuple[int, str], Instance] = {}
        self.by_gpu: dict[int, list[Instance]] = {i: [] for i in budgets}
        self.bb: dict[int, int] = {}
        self.layer: dict[int, int] = {}
        self.keys: dict[int, tuple[AccountKey, AccountKey, AccountKey]] = {}
        self.low: dict[int, int] = {}
        self.high: dict[int, int] = {}
        self.starved: dict[int, set[Instance]] = {i: set() for i in budgets}
        self.restoring: dict[int, set[Instance]] = {i: set() for i in budgets}
        self.gathered: dict[int, int] = {}  # lender idx -> weight bytes gathered towards a layer
        self.drained_bytes = 0
        self.claims: dict[int, set[Instance]] = {i: set() for i in budgets}
        self.claimed_bytes = 0
        self.verifications = 0
        self.grow_calls = 0
        self.grow_calls_by: dict[int, int] = {}
        self.self_remaps_held = 0
        self.remaps_refused = {"lender has work": 0, "own weights out": 0, "idle memory left": 0}
        for inst, m in zip(sim.instances, spec.models):
            cfg = inst.cfg
            bb = int(cfg.kv_block_bytes)
            assert bb == cfg.kv_block_bytes, "KV block bytes must be integral"
            ms = cfg.model
            act_tokens = m.max_batched_tokens if m.activation_tokens is None else m.activation_tokens
            layer = int(ms.layer_weight_bytes(cfg.weight_dtype))
            gpu, name = cfg.gpu, cfg.name
            w = self.policy.open(gpu, name, Kind.WEIGHTS, int(ms.weight_bytes(cfg.weight_dtype)), floor=layer)
            a = self.policy.open(
                gpu, name, Kind.ACTIVATION, int(ms.activation_bytes(act_tokens, cfg.weight_dtype)), unit=bb
            )
            k = self.policy.open(gpu, name, Kind.KV, cfg.kv_blocks * bb, unit=bb)
            self.keys[inst.idx] = (w, a, k)
            self.bb[inst.idx], self.layer[inst.idx] = bb, layer
            self.insts[(gpu, name)] = inst
            self.by_gpu[gpu].append(inst)
            self.low[inst.idx] = max(1, math.ceil(opts.low_watermark_frac * cfg.kv_blocks))
            self.high[inst.idx] = max(self.low[inst.idx], math.ceil(opts.high_watermark_frac * cfg.kv_blocks))
            inst.scheduler = _BalancingScheduler(inst.scheduler, self)
            inst.hooks.append(_ArbiterHook(self, inst))
            for h in inst.hooks:
                if getattr(h, "layer_stream", False):
                    raise ValueError(f"{name}: swiftcache layer_stream is not supported under the node arbiter")
        sim.arbiter = self

    # ---- accounts <-> instances ------------------------------------------------
    def kv_key(self, inst: Instance) -> AccountKey:
        return self.keys[inst.idx][2]

    def _sync(self, gpu: int, keep: Callable[[Instance], int] | None = None) -> None:
        """Report every instance of ``gpu``: its idle KV (free + evictable
        blocks), its headroom (``keep(inst)`` blocks if given, else its high
        watermark plus its scheduler's admission reserve when it has work,
        nothing when idle) and whether it has work."""
        pol = self.policy
        for inst in self.by_gpu[gpu]:
            busy = bool(inst.waiting or inst.running)
            bb = self.bb[inst.idx]
            if keep is not None:
                head = keep(inst)
            else:
                head = self.high[inst.idx] + self._admission_reserve(inst) if busy else 0
            pol.report(self.keys[inst.idx][2], inst.kv.available * bb, max(head, 0) * bb)
            pol.set_busy(gpu, inst.cfg.name, busy)

    def _apply(self, grant) -> None:
        """Shrink the donors' pools by what the grant took from them, grow the requester's."""
        for t in grant.takes:
            if t.source is None or t.source.kind is not Kind.KV:
                continue
            d = self.insts[(t.source.gpu, t.source.owner)]
            blocks, rem = divmod(t.nbytes, self.bb[d.idx])
            assert rem == 0
            cap = d.kv.capacity
            got = d.kv.resize(cap - blocks)
            assert got == cap - blocks, f"{d.cfg.name}: took {blocks} blocks but only {cap - got} were idle"
        k = grant.key
        if k.kind is Kind.KV and grant.granted:
            inst = self.insts[(k.gpu, k.owner)]
            inst.kv.resize(inst.kv.capacity + grant.granted // self.bb[inst.idx])
        self.verify(k.gpu)

    def verify(self, gpu: int | None = None) -> None:
        """Conservation: the policy's invariants, and every pool == its account."""
        self.verifications += 1
        gpus = [gpu] if gpu is not None else list(self.by_gpu)
        for g in gpus:
            self.policy._after(g)
            for inst in self.by_gpu[g]:
                kv = inst.kv
                held = self.policy.held(self.keys[inst.idx][2])
                assert kv.capacity * self.bb[inst.idx] == held, (
                    f"{inst.cfg.name}: KV pool {kv.capacity} blocks != its account {held} bytes"
                )
                assert kv.private + kv.cached <= kv.capacity

    # ---- generic KV balancing ------------------------------------------------------
    def _need(self, inst: Instance) -> int:
        """Free + evictable blocks ``inst`` should have before planning: its
        low watermark, or what the head of its queue needs if it may admit --
        its prompt plus what the scheduler's admission keeps back for running
        requests (``admission_reserve_blocks(inst)``, eLLM's decode reserve)."""
        need = self.low[inst.idx]
        if inst.waiting and len(inst.running) < inst.cfg.max_running:
            head = -(-inst.waiting[0].target // inst.kv.block_size)
            need = max(need, head + self._admission_reserve(inst))
        return need

    @staticmethod
    def _admission_reserve(inst: Instance) -> int:
        sched = inst.scheduler
        while hasattr(sched, "inner"):
            sched = sched.inner
        reserve = getattr(sched, "admission_reserve_blocks", None)
        return reserve(inst) if reserve is not None else 0

    def before_plan(self, inst: Instance) -> None:
        gpu = inst.cfg.gpu
        if self.restoring[gpu]:
            self._gather_restores(gpu)
        if self.claims[gpu]:
            self._serve_claims(gpu)
        if not (inst.waiting or inst.running):
            return
        need = self._need(inst)
        avail = inst.kv.available
        if avail >= need:
            return
        self.grow(inst, need - avail + self.high[inst.idx] - self.low[inst.idx])
        if inst.kv.available < need and self.policy.excess(gpu, inst.cfg.name) < 0:
            self.claims[gpu].add(inst)  # still short, and others hold memory of its own

    def _serve_claims(self, gpu: int) -> None:
        """Memory of a model below its nominal that is still short comes back
        as soon as a borrower frees it -- before every plan on its GPU, so
        the borrower cannot re-admit into it (draining, never blocks in use).
        A claim ends when the model is no longer short or holds its nominal."""
        for c in sorted(self.claims[gpu], key=lambda x: x.idx):
            owed = -self.policy.excess(gpu, c.cfg.name)
            need = self._need(c) if (c.waiting or c.running) else 0
            short = need - c.kv.available
            if owed <= 0 or short <= 0:
                self.claims[gpu].discard(c)
                continue
            bb = self.bb[c.idx]
            want = min(short + self.high[c.idx] - self.low[c.idx], owed // bb)
            if want <= 0:
                self.claims[gpu].discard(c)
                continue
            self._sync(gpu)
            g = self.policy.request(self.kv_key(c), want * bb, tiers=(Tier.FREE, Tier.RETURN), entitled=True)
            if g.granted:
                self._apply(g)
                self.claimed_bytes += g.granted

    def grow(self, inst: Instance, blocks: int) -> int:
        """Ask for ``blocks`` more KV blocks from idle memory (priority rule); returns blocks granted."""
        if blocks <= 0:
            return 0
        self.grow_calls += 1
        self.grow_calls_by[inst.idx] = self.grow_calls_by.get(inst.idx, 0) + 1
        self._sync(inst.cfg.gpu)
        g = self.policy.request(self.kv_key(inst), blocks * self.bb[inst.idx])
        if g.granted:
            self._apply(g)
        return g.granted // self.bb[inst.idx]

    # ---- eLLM --------------------------------------------------------------------------
    def act_idle_blocks(self, inst: Instance) -> int:
        return self.policy.held(self.keys[inst.idx][1]) // self.bb[inst.idx]

    def inflate(self, inst: Instance, blocks: int) -> None:
        _, a, k = self.keys[inst.idx]
        bb = self.bb[inst.idx]
        self.policy.report(a, self.act_idle_blocks(inst) * bb)  # between iterations all activation is idle
        self.policy.move(a, k, blocks * bb, Tier.OWN)
        inst.kv.resize(inst.kv.capacity + blocks)
        self.verify(inst.cfg.gpu)

    def deflate(self, inst: Instance, blocks: int) -> None:
        _, a, k = self.keys[inst.idx]
        self._sync(inst.cfg.gpu)
        self.policy.move(k, a, blocks * self.bb[inst.idx], Tier.OWN)
        cap = inst.kv.capacity
        assert inst.kv.resize(cap - blocks) == cap - blocks
        self.verify(inst.cfg.gpu)

    # ---- Select-N / FlexGen-like / layer streaming -----------------------------------------
    def offload(self, inst: Instance, blocks: int) -> None:
        """Weights moved to host memory become ``blocks`` KV blocks of the same model."""
        if blocks <= 0:
            return
        w, _, k = self.keys[inst.idx]
        self.policy.move(w, k, blocks * self.bb[inst.idx], Tier.OFFLOAD)
        inst.kv.resize(inst.kv.capacity + blocks)
        self.verify(inst.cfg.gpu)

    # ---- Oneiros ----------------------------------------------------------------------------
    def remap(self, lender: Instance, borrower: Instance) -> int:
        """One layer of ``lender``'s weights into ``borrower``'s KV; returns the
        blocks gained, 0 if the arbiter refuses (``remap_refusal``)."""
        self._sync(borrower.cfg.gpu)
        why = self.policy.remap_refusal(self.kv_key(borrower), self.layer[lender.idx], self.keys[lender.idx][0])
        if why:
            self.remaps_refused[
                "lender has work"
                if "has work" in why
                else "own weights out"
                if "own weights" in why
                else "idle memory left"
            ] += 1
            return 0
        g = self.policy.move(self.keys[lender.idx][0], self.kv_key(borrower), self.layer[lender.idx], Tier.REMAP)
        blocks = g.granted // self.bb[borrower.idx]
        borrower.kv.resize(borrower.kv.capacity + blocks)
        self.verify(borrower.cfg.gpu)
        return blocks

    def restore(self, lender: Instance, keep: Callable[[Instance], int] | None = None, drain: bool = False) -> bool:
        """One layer back to ``lender``'s weights from free budget or idle
        borrowed KV; True when the whole layer is back.

        ``drain=False`` (the lent layer is empty): all or nothing now, every
        instance keeping ``keep(inst)`` free blocks. ``drain=True`` (the lender
        has work and pays for streaming): gather idle memory as it frees up --
        also before every plan on this GPU, so borrowers do not refill it --
        until a whole layer is back; ``cancel_restore`` gives it up."""
        gpu, i = lender.cfg.gpu, lender.idx
        if not drain:
            if self.gathered.get(i):
                self.cancel_restore(lender)
            self._sync(gpu, keep or (lambda _: 0))
            g = self.policy.request(
                self.keys[i][0], self.layer[i], partial=False, tiers=(Tier.FREE, Tier.RETURN), entitled=False
            )
            if g.granted:
                self._apply(g)
            return g.granted > 0
        self.restoring[gpu].add(lender)
        self._gather_restores(gpu)
        if self.gathered.get(i, 0) >= self.layer[i]:
            self.gathered[i] -= self.layer[i]
            if not self.gathered[i]:
                self.restoring[gpu].discard(lender)
            return True
        return False

    def _gather_restores(self, gpu: int) -> None:
        for lender in sorted(self.restoring[gpu], key=lambda x: x.idx):
            i = lender.idx
            need = self.layer[i] - self.gathered.get(i, 0)
            if need <= 0:
                continue
            self._sync(gpu)
            g = self.policy.request(self.keys[i][0], need, partial=True, tiers=(Tier.FREE, Tier.RETURN), entitled=True)
            if g.granted:
                self._apply(g)
                self.gathered[i] = self.gathered.get(i, 0) + g.granted
                self.drained_bytes += g.granted

    def cancel_restore(self, lender: Instance) -> None:
        """Give up a draining restore: the bytes gathered go back to free."""
        i = lender.idx
        self.restoring[lender.cfg.gpu].discard(lender)
        n = self.gathered.pop(i, 0)
        if n:
            self.policy.release(self.keys[i][0], n)
            self.verify(lender.cfg.gpu)

    # ---- SwiftCache -----------------------------------------------------------------------------
    def _peer_key(self, worker: Instance, master: Instance) -> AccountKey:
        key = AccountKey(worker.cfg.gpu, master.cfg.name, Kind.PEER)
        if key not in self.policy.accounts:
            self.policy.open(key.gpu, key.owner, Kind.PEER, 0, unit=self.bb[worker.idx])
        return key

    def lend_peer(self, worker: Instance, master: Instance, blocks: int) -> None:
        """SCALEDOWN: ``blocks`` idle worker blocks become the master's peer memory."""
        if blocks <= 0:
            return
        self._sync(worker.cfg.gpu)
        self.policy.move(self.kv_key(worker), self._peer_key(worker, master), blocks * self.bb[worker.idx], Tier.LEND)
        cap = worker.kv.capacity
        assert worker.kv.resize(cap - blocks) == cap - blocks
        self.verify(worker.cfg.gpu)

    def reclaim_peer(self, worker: Instance, master: Instance, blocks: int) -> None:
        """SCALEUP: ``blocks`` of the master's peer memory go back to the worker."""
        if blocks <= 0:
            return
        self.policy.move(
            self._peer_key(worker, master), self.kv_key(worker), blocks * self.bb[worker.idx], Tier.RECLAIM
        )
        worker.kv.resize(worker.kv.capacity + blocks)
        self.verify(worker.cfg.gpu)

    # ---- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """Common shape (``core.stats``), node-wide (``instance`` = ``"node"``):
        ``moved_bytes.<tier>`` / ``events.<tier>`` are the ledger's moves per
        priority tier (``memory_ext.policy.arbiter.Tier``); final accounts,
        budgets and peaks per GPU in ``details``."""
        pol = self.policy.stats()
        counters: dict[str, object] = {
            "requests": pol["requests"],
            "refused": pol["refused"],
            "grow_calls": self.grow_calls,
            "verifications": self.verifications,
            "restore_drained_gb": self.drained_bytes / 1e9,
            "claimed_gb": self.claimed_bytes / 1e9,
            "self_remaps_held": self.self_remaps_held,
        }
        counters.update({f"moved_bytes.{t}": b for t, b in pol["moved_bytes"].items()})
        counters.update({f"events.{t}": n for t, n in pol["events"].items()})
        counters.update({f"remaps_refused.{why}": n for why, n in self.remaps_refused.items()})
        gauges = {"floor_fraction": self.opts.floor_fraction}
        for key in ("budget_bytes", "peak_allocated_bytes", "free_bytes"):
            gauges.update({f"{key}.gpu{g}": b for g, b in pol[key].items()})
        details = {
            "share_kv": self.opts.share_kv,
            "accounts_final_bytes": {
                f"{k.gpu}:{k.owner}:{k.kind.value}": a.held for k, a in self.policy.accounts.items()
            },
        }
        return mechanism_stats("arbiter", "arbiter", "node", counters, gauges, details)


def attach_arbiter(sim: Simulator, spec: ScenarioSpec) -> SimArbiter:
    return SimArbiter(sim, spec, spec.arbiter)


def mechanism_counters(sim) -> dict[str, Any]:
    """How much each mechanism did in a finished run (0 = never acted), from
    every instance's mechanism ``stats()`` and the arbiter's."""
    out: dict[str, Any] = {
        "swiftcache_tier_hit_blocks": 0,
        "swiftcache_lent_blocks_max": 0,
        "oneiros_remaps": 0,
        "select_n_host_layers": 0,
        "ellm_inflation_blocks_max": 0,
        "ellm_decode_reserve_blocks_max": 0,
        "layer_streaming_layers": 0,
        "arbiter_idle_peer_gb": 0.0,
        "arbiter_return_gb": 0.0,
        "arbiter_surplus_gb": 0.0,
    }
    for inst in sim.instances:
        for st in collect_mechanism_stats(inst):
            m, c, g = st["mechanism"], st["counters"], st["gauges"]
            if m == "swiftcache":
                out["swiftcache_tier_hit_blocks"] += c["tier_hit_blocks"]
                out["swiftcache_lent_blocks_max"] += g["lent_blocks_max"]
            elif m == "oneiros":
                out["oneiros_remaps"] = max(out["oneiros_remaps"], c.get("gpu_remaps", 0))
            elif st["kind"] == "select_n":
                out["select_n_host_layers"] += g["offloaded_layers"]
            elif m == "layer_streaming":
                out["layer_streaming_layers"] += g["host_layers"]
            elif m == "ellm":
                out["ellm_inflation_blocks_max"] += max(g["max_lent_blocks"], 0)
                out["ellm_decode_reserve_blocks_max"] += g["max_decode_reserve_blocks"]
    arb = getattr(sim, "arbiter", None)
    if arb is not None:
        moved = arb.policy.moved
        out["arbiter_idle_peer_gb"] = moved[Tier.IDLE_PEER] / 1e9
        out["arbiter_return_gb"] = moved[Tier.RETURN] / 1e9
        out["arbiter_surplus_gb"] = moved[Tier.SURPLUS] / 1e9
    return out
