"""The peer KV tier inside one SGLang scheduler (``--memx-peer-kv``; docs/peer-kv.md).

``PeerKVServer`` is built at the scheduler's first iteration (``tick``), once the KV pool, the
prefix cache and the shared pool exist, and hangs on the prefix cache
(``upstream.peer_radix.attach_peer``). Two roles, either or both:

* **donor** (``donate`` / ``both``): a ``PeerDonor`` listening on
  ``discovery.donor_socket(<pool dir>, <pool>, <name>)``, its regions made of chunks of this
  server's own ``ChunkPool`` (borrowed from the pool's arbiter, held as ``PEER_DONATION``), driven
  by ``DonorController`` / ``DonationPolicy`` from this server's own demand: reclaim at once when
  its requests need the memory (every iteration), donate what the last window did not need (at
  most every ``DONATE_INTERVAL_S``), never more than ``--memx-peer-donate-max-gb``.
* **borrower** (``borrow`` / ``both``): a ``PeerKVTier`` connected to every donor of the pool it
  finds (re-scanned every ``DISCOVER_INTERVAL_S``; a donor that refuses our layout is logged
  and skipped for good), and a ``PeerKVIO`` over the scheduler's K/V buffers. The hooks call
  ``spill`` before the prefix cache frees an evicted leaf's slots and ``load`` after a device
  match: the pages the peer holds past the device prefix are read into new slots, inserted
  into the tree, and the match runs again. A failed or reclaimed read is a miss: the request
  recomputes those tokens, as in stock SGLang.

Tokens of a tree path are not readable from the (Rust) tree core, so the server keeps
``slot_tokens[slot]`` = the token whose KV the slot holds, written at every insert into the
tree (``note_insert``): every slot of a tree path got there through an insert. Paths inserted
under a LoRA / cache-salt namespace are marked and never spilled (not supported yet).

Runs on the scheduler thread only (hooks and tick); the donor's and links' own threads touch
only ``memory_ext.peer`` state.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter

from memory_ext.peer import PeerDonor, PeerKVIO, PeerKVTier, donor_socket, donor_sockets
from memory_ext.peer.controller import DonorController, geometry_of
from memory_ext.peer.kvpack import layout_of_buffers
from memory_ext.policy.swiftcache import DonationPolicy
from memory_ext.pool.lent_pool import LentPool
from memory_ext.vmm import host_backend
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.elastic.paths import pool_dir
from sglang_memx.peer import layer_stream, peer_name
from sglang_memx.peer.prefix import PeerPrefixCache
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import layer_stream as up_ls
from sglang_memx.upstream import peer_radix as up_peer
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.upstream import server_args as up_args

logger = logging.getLogger("sglang_memx")

GB = 1 << 30
PAGE_TOKENS = 16  # tokens of one peer block (rounded up to a multiple of the KV page size)
DONATE_INTERVAL_S = 0.5
DISCOVER_INTERVAL_S = 1.0
BORROW_WAIT_S = 0.2  # at most this long for the arbiter, once a donation is decided (``_supply_donation``)
WINDOW_S = 60.0  # Alg. 1's demand window: memory a request needed is not lent again before it ends
DEFAULT_DONATE_FRACTION = 0.5  # without --memx-peer-donate-max-gb: at most half of the KV capacity


class PeerKVServer:
    def __init__(self, scheduler, config, kv: ElasticKV | None, lent: LentPool | None, stream):
        tree = up_sched.tree_cache(scheduler)
        allocator = up_sched.allocator(scheduler)
        if not up_peer.is_unified(tree):
            raise RuntimeError(f"--memx-peer-kv: needs upstream's unified radix cache, this server has {type(tree)}")
        if kv is None or lent is None:
            raise RuntimeError("--memx-peer-kv: needs elastic KV on a shared pool (--memx-pool)")
        buffers = up_kv.kv_buffers(allocator)
        layers = len(buffers) // 2
        self.k_layers, self.v_layers = buffers[:layers], buffers[layers:]
        page = up_sched.page_size(scheduler)
        self.block_tokens = math.lcm(PAGE_TOKENS, page)
        self.layout = layout_of_buffers(
            self.k_layers, self.v_layers, self.block_tokens, up_args.model_path(up_sched.server_args(scheduler))
        )
        self.mode = config.peer_kv
        self.tree, self.allocator, self.kv, self.lent = tree, allocator, kv, lent
        self.pool_name, self.directory = config.pool, os.fspath(pool_dir(config))
        self.name = peer_name(up_sched.server_args(scheduler))
        self.stats: Counter[str] = Counter()
        self.donor = self.controller = None
        self.tier = self.io = self.cache = None
        self._refused: dict[str, str] = {}
        self._next_donate = self._next_discover = 0.0
        chunk = kv.buffers.pool.chunk_bytes
        capacity_tokens = up_sched.logical_capacity_tokens(scheduler)
        token_bytes = self.layout.block_bytes // self.block_tokens
        if self.mode in ("donate", "both"):
            cap = config.peer_donate_max_gb
            own = capacity_tokens * token_bytes
            cap_bytes = int(cap * GB) if cap is not None else int(own * DEFAULT_DONATE_FRACTION)
            geometry = geometry_of(self.layout)
            policy = DonationPolicy(geometry, geometry, chunk_bytes=chunk, kv_tokens=capacity_tokens,
                                    max_donate_bytes=cap_bytes, window_s=WINDOW_S)  # fmt: skip
            self.controller = DonorController(policy, self.layout, chunk)
            self.cap_chunks = policy.unit.meu_bytes * (cap_bytes // policy.unit.meu_bytes) // chunk
            self.donor = PeerDonor(kv.buffers.pool, donor_socket(self.directory, self.pool_name, self.name),
                                   max_bytes_per_lease=max(cap_bytes, policy.unit.meu_bytes), name=self.name,
                                   accept_layout=self.controller.accept_layout,
                                   on_lost=self.controller.lease_lost)  # fmt: skip
            self.controller.attach(self.donor)
            logger.info("memx peer KV: donor %s listening (at most %d chunks of %d B)", self.name, self.cap_chunks,
                        chunk)  # fmt: skip
        self.layer_stream = stream  # --memx-peer-layer-stream: built with the pool (peer.layer_stream), or None
        if self.layer_stream is not None:
            # streamed layers' buffers are one staging buffer: a spilled page would gather stale rows,
            # so the prefix tier is not built next to the cache (docs/peer-kv.md)
            logger.info("memx peer KV: layer stream cache on (%d of %d layers streamed); no prefix tier",
                        len(self.layer_stream.streamed), layers)  # fmt: skip
        elif self.mode in ("borrow", "both"):
            self.tier = PeerKVTier(self.layout)
            self.io = PeerKVIO(self.tier, self.k_layers, self.v_layers)
            self.cache = PeerPrefixCache(tree, allocator, self.io, self.k_layers[0].shape[0], self.stats)
            self.backend = host_backend(chunk)
            logger.info("memx peer KV: borrower %s, %d-token blocks of %d B", self.name, self.block_tokens,
                        self.layout.block_bytes)  # fmt: skip

    # ------------------------------------------------------------------ once per iteration
    def tick(self, scheduler) -> None:
        now = time.monotonic()
        lost = layer_stream.broken(self.layer_stream)
        if lost is not None and (up_sched.admitted_reqs(scheduler) or up_sched.waiting(scheduler)):
            self.stats["layer_stream_aborts"] += 1
            logger.error("memx layer stream cache: %s; aborting every request", lost)
            up_ls.abort_everything(scheduler, f"{layer_stream.LOST} ({lost})")
        if self.donor is not None:
            self._donor_step(scheduler, now)
        if self.tier is not None and now >= self._next_discover:
            self._next_discover = now + DISCOVER_INTERVAL_S
            self._discover()

    def _demand_tokens(self, scheduler) -> int:
        """What this server's requests need now: every admitted and waiting request's prompt + max_new."""
        reqs = list(up_sched.admitted_reqs(scheduler)) + list(up_sched.waiting(scheduler))
        return sum(up_req.prompt_len(r) + up_req.max_new_tokens(r) for r in reqs)

    def _donor_step(self, scheduler, now: float) -> None:
        demand = self._demand_tokens(scheduler)
        if demand:
            revoked_before = self.controller.revoked_chunks
            back = self.controller.on_demand(now, demand)
            revoked = self.controller.revoked_chunks - revoked_before
            if revoked:  # chunks under a borrower's write fence come back when the write ends
                self.stats["reclaims"] += 1
                self.stats["reclaimed_chunks"] += revoked
                logger.info("memx peer KV: reclaimed %d chunks from borrowers, %d at once (demand %d tokens)",
                            revoked, len(back), demand)  # fmt: skip
        if now < self._next_donate or not self.donor.leases():
            return
        self._next_donate = now + DONATE_INTERVAL_S
        placed = self.controller.on_tick(now, supply=self._supply_donation)
        if placed:
            self.stats["donated_chunks"] += placed

    def _supply_donation(self, chunks: int) -> None:
        """The donation's chunks come from the arbiter, like any KV chunk: borrowed once the policy
        has decided to donate them, at most up to the cap (a borrow before the decision held
        chunks the policy then kept, until the next give-back: churn at every donation tick)."""
        room = self.cap_chunks - self.controller.policy.donated_chunks + chunks  # the decision is booked
        short = min(chunks, room) - self.kv.buffers.pool.available()
        if short > 0:
            self.lent.borrow(short, wait=BORROW_WAIT_S)

    def _discover(self) -> None:
        linked = {link.peer for link in self.tier.links()}
        for donor, path in donor_sockets(self.directory, self.pool_name, exclude=self.name).items():
            if path in linked or path in self._refused:
                continue
            try:
                self.tier.connect(path, self.name, self.backend)
            except ValueError as exc:  # another layout (model, dtype, geometry): never mix KV
                self._refused[path] = str(exc)
                logger.warning("memx peer KV: donor %s refused this server: %s; carrying on without it", donor, exc)
                continue
            except (OSError, ConnectionError) as exc:  # gone, or not listening yet: try again later
                logger.debug("memx peer KV: donor %s not reachable: %s", donor, exc)
                continue
            self.stats["donors_connected"] += 1
            logger.info("memx peer KV: borrowing from donor %s", donor)

    # ------------------------------------------------------------------ the prefix cache's hooks
    def note_insert(self, radix_key, value) -> None:
        if self.cache is not None:
            self.cache.note_insert(radix_key, value)

    def spill(self, node_id) -> None:
        if self.cache is not None and self.tier.links():
            self.cache.spill(node_id)

    def load(self, match_params, matched, rematch):
        if self.cache is None or not self.tier.links():
            return matched
        return self.cache.load(match_params, matched, rematch)

    # ------------------------------------------------------------------ report
    def status(self) -> dict:
        doc = {"mode": self.mode, "name": self.name, "block_tokens": self.block_tokens,
               "block_bytes": self.layout.block_bytes, **dict(self.stats)}  # fmt: skip
        if self.donor is not None:
            st = self.donor.status()
            doc["donor"] = {
                "socket": self.donor.socket_path,
                "cap_bytes": self.cap_chunks * self.kv.buffers.pool.chunk_bytes,
                "donated_bytes": sum(le["donated_bytes"] for le in st["leases"]),
                "policy_donated_bytes": self.controller.policy.donated_chunks * self.kv.buffers.pool.chunk_bytes,
                "leases": [
                    {k: le[k] for k in ("borrower", "pid", "donated_bytes", "fenced_units")} for le in st["leases"]
                ],  # fmt: skip
                "reclaimed_bytes": self.stats["reclaimed_chunks"] * self.kv.buffers.pool.chunk_bytes,
                "refused": st.get("refused", 0),
            }
        if self.layer_stream is not None:
            doc["layer_stream"] = self.layer_stream.status()
        if self.tier is not None:
            st = self.tier.status()
            doc["borrower"] = {
                "peers": [
                    {
                        "donor": os.path.basename(p["peer"]),
                        "borrowed_bytes": p["borrowed_bytes"],
                        "blocks": p["blocks"],
                        "free_blocks": p["free_blocks"],
                        "pages": p["pages"],
                    }
                    for p in st["peers"]
                ],  # fmt: skip
                "borrowed_bytes": sum(p["borrowed_bytes"] for p in st["peers"]),
                "pages_held": st["pages"],
                "pages_stored": st.get("pages_stored", 0),
                "bytes_stored": st.get("bytes_stored", 0),
                "pages_hit": st.get("pages_hit", 0),
                "pages_missed": st.get("pages_missed", 0),
                "bytes_loaded": st.get("bytes_loaded", 0),
                "entries_dropped_reclaim": st.get("entries_dropped_reclaim", 0),
                "entries_dropped_dead": st.get("entries_dropped_dead", 0),
                "stale_dropped": st.get("stale_dropped", 0),
                "donors_lost": st.get("donors_lost", 0),
                "refused_by": sorted(os.path.basename(p) for p in self._refused),
            }
        return doc


def server_of(scheduler):
    """The scheduler's peer tier, or None."""
    tree = up_sched.tree_cache(scheduler)
    return None if tree is None else up_peer.peer_of(tree)


_without: set[int] = set()  # schedulers (by id) that run without the tier


def tick(scheduler, kv: ElasticKV | None, lent: LentPool | None, stream) -> None:
    """Once per scheduler iteration (the coordinator's peer step; ``kv``: its KV space, None without
    elastic KV; ``lent``: its shared pool's link, None without one; ``stream``: the layer stream
    cache built with the pool, or None): build the tier on the first call."""
    server = server_of(scheduler)
    if server is None:
        if id(scheduler) in _without:
            return
        config = up_args.config_of(up_sched.server_args(scheduler))
        if config.disabled or config.peer_kv == "off":
            _without.add(id(scheduler))
            return
        server = PeerKVServer(scheduler, config, kv, lent, stream)
        up_peer.attach_peer(up_sched.tree_cache(scheduler), server)
    server.tick(scheduler)
