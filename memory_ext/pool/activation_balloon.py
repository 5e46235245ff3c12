"""ActivationBalloon: the activation side of one server's KV pool (eLLM ballooning, E1/E2).

The pool that backs elastic KV also holds the activation memory of the
batch being formed and run: chunks owned by ``Owner.ACTIVATION``. Invariants:

* ``live`` (chunks the current batch needs) <= ``held`` (chunks owned) after
  every successful ``reserve``; a batch is admitted only if its activation
  fits together with its KV (``reserve`` returns False and takes nothing
  otherwise: no hold-and-wait).
* KV inflates into idle activation memory (``held - live``) when it needs to
  map a group and FREE is short (``lend_to_kv``); activation takes memory back
  from KV lazily, only when a batch needs it and only the shortfall
  (``memory_ext.policy.activation.plan_activation``).
* ``live`` goes back to 0 once per scheduler iteration (``end_iteration``):
  the previous forward has finished by then (no overlap scheduling on CPU).

On CPU the chunks are accounting only (torch's CPU allocator still serves the
tensors; the chunks are never mapped). On CUDA, with an ``arena``
(``memory_ext.pool.segment_arena``), every held chunk is mapped into the
arena, and the forward's tensors come from it through torch's pluggable
allocator / ``MemPool`` (``mempool``, used by the model-runner hook). Then:

* ``held`` == the arena's mapped chunks; ``reserve`` maps what it acquires;
* ``lend_to_kv`` unmaps from the arena's top, after ``release_cached`` has
  handed torch's cached segments back (at most once a second), and never
  under a live segment (a tensor that outlives its forward): it may give
  fewer chunks than ``idle()`` promised, and KV's ``grow`` then maps fewer
  groups.
"""

from __future__ import annotations

from collections.abc import Callable

from memory_ext.policy.activation import ActivationProfile, plan_activation
from memory_ext.pool import Owner


class ActivationBalloon:
    MEASURE_FIRST = 3  # forwards measured after start-up whatever their size
    MEASURE_LIMIT = 8  # measured forwards in all (later ones only if larger than any before)

    def __init__(self, pool, profile: ActivationProfile, max_batch_tokens: int = 0, arena=None, mempool=None):
        self.pool = pool
        self.arena = arena  # SegmentArena whose mapped chunks are exactly ``chunks`` (CUDA), or None
        self.mempool = mempool  # ArenaMemPool the forward allocates from, or None
        self.profile = profile
        self.measurements: list[tuple] = []  # (tokens, seqs, peak bytes) of measured forwards
        self._measuring = True
        self.max_batch_tokens = max_batch_tokens  # the largest prefill batch (chunked-prefill size)
        self.chunks: list = []
        self.live = 0
        self.stats = {
            "reserves": 0,
            "refused": 0,
            "chunks_from_free": 0,
            "chunks_from_kv": 0,
            "chunks_lent_to_kv": 0,
            "peak_held": 0,
            "peak_need": 0,
            "deferred_requests": 0,
            "overcommitted_chunks": 0,
            "profile_raised": 0,
        }

    @property
    def held(self) -> int:
        return len(self.chunks)

    def idle(self) -> int:
        return max(0, self.held - self.live)

    def need_chunks(self, tokens: int, seqs: int) -> int:
        return self.profile.chunks_for(tokens, seqs, self.pool.chunk_bytes)

    def reserve(
        self, tokens: int, seqs: int, kv_idle_chunks: Callable[[], int], deflate_kv: Callable[[int], int]
    ) -> bool:
        """Make sure a batch of ``tokens`` tokens / ``seqs`` sequences has its activation chunks.

        ``kv_idle_chunks()``: chunks KV could give up now (free groups, evictable cache);
        ``deflate_kv(n)``: unmap at least ``n`` chunks of KV into FREE, return how many it freed.
        """
        need = self.need_chunks(tokens, seqs)
        self.stats["reserves"] += 1
        self.stats["peak_need"] = max(self.stats["peak_need"], need)
        if need <= self.held:
            self.live = max(self.live, need)
            return True
        step = plan_activation(need, self.held, self.pool.available(), kv_idle_chunks())
        if not step.fits:
            self.stats["refused"] += 1
            return False
        if step.deflate_kv:
            deflate_kv(step.deflate_kv)
        if step.shortfall > self.pool.available():  # deflation freed less than planned
            self.stats["refused"] += 1
            return False
        got = self.pool.acquire(Owner.ACTIVATION, step.shortfall)
        if self.arena is not None:
            try:
                self.arena.grow(got)
            except Exception:
                self.pool.release(Owner.ACTIVATION, got)
                raise
        self.chunks.extend(got)
        self.stats["chunks_from_free"] += step.take_free
        self.stats["chunks_from_kv"] += step.deflate_kv
        self.stats["peak_held"] = max(self.stats["peak_held"], self.held)
        self.live = max(self.live, need)
        return True

    def lend_to_kv(self, n: int) -> int:
        """Inflation: give up to ``n`` idle chunks to FREE so KV can map them; return how many."""
        n = min(n, self.idle())
        if n <= 0:
            return 0
        if self.arena is not None:
            give = self.arena.shrink(n, self.mempool.release_cached if self.mempool is not None else None)
            gone = {c.handle_id for c in give}
            self.chunks = [c for c in self.chunks if c.handle_id not in gone]
            n = len(give)
            if not n:
                return 0
        else:
            give, self.chunks = self.chunks[-n:], self.chunks[:-n]
        self.pool.release(Owner.ACTIVATION, give)
        self.stats["chunks_lent_to_kv"] += n
        return n

    def release_idle(self, keep: int = 0) -> int:
        """Idle chunks beyond ``keep`` back to FREE (a server in a shared pool gives them back)."""
        return self.lend_to_kv(self.held - max(self.live, keep))

    # ------------------------------------------------------ profile measurement
    def wants_measurement(self, tokens: int) -> bool:
        n = len(self.measurements)
        if not self._measuring or tokens <= 0 or n >= self.MEASURE_LIMIT:
            return False
        return n < self.MEASURE_FIRST or tokens > max(m[0] for m in self.measurements)

    def record_measurement(self, tokens: int, seqs: int, peak_bytes: int) -> None:
        """A measured forward's peak: the profile is raised if it predicted less."""
        self.measurements.append((tokens, seqs, peak_bytes))
        if self.profile.observe(tokens, seqs, peak_bytes):
            self.stats["profile_raised"] += 1

    def stop_measuring(self) -> None:
        self._measuring = False

    def end_iteration(self) -> None:
        self.live = 0

    def status(self) -> dict:
        p = self.profile
        allocator = (
            {"kind": "torch"}
            if self.arena is None
            else {
                "kind": "memx arena",
                "mapped_chunks": self.arena.mapped_chunks,
                "pinned_chunks": self.arena.pinned_chunks(),
                "cache_releases": self.arena.releases,
                **self.arena.stats(),
            }
        )
        return {
            "held_chunks": self.held,
            "allocator": allocator,
            "max_batch_tokens": self.max_batch_tokens,
            "live_chunks": self.live,
            "held_bytes": self.held * self.pool.chunk_bytes,
            "profile": {
                "per_token_bytes": p.per_token_bytes,
                "per_seq_bytes": p.per_seq_bytes,
                "fixed_bytes": p.fixed_bytes,
                "source": p.source,
                "observations": p.observations,
            },
            "measurements": [
                {"tokens": t, "seqs": q, "peak_bytes": b, "profile_bytes": p.bytes_for(t, q)}
                for t, q, b in self.measurements
            ],
            **self.stats,
        }
