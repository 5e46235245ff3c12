"""SwiftCache decision logic (W2-W4) as plain policy objects: numbers in, decisions out.

Nothing here allocates, maps or moves memory; there is no torch and no sglang.
Only the standard library (dataclasses, enum, math, collections) is used.

* W2 -- sizing of the master's layer stream cache (LSC) and regular cache (RC),
  paper section 3.2, Eq. 1-5: :func:`layer_block_bytes`, :func:`worker_full_layer_blocks`,
  :func:`master_single_layer_blocks`, :func:`plan_lsc_from_blocks`, :func:`plan_lsc`;
  its layer-granular realisation in a server (:func:`plan_layer_stream`).
* W3 -- block-major elastic cache and its minimum elastic unit (MEU), section 3.4,
  Eq. 6-9: :func:`block_elems`, :func:`block_major_shape`, :func:`min_elastic_unit`.
* W4 -- worker scale up / scale down, section 3.5, Algorithm 1: :func:`scale_up`,
  :func:`scale_down`, the sliding :class:`RequestWindow` and the bookkeeping
  :class:`ElasticWorkerPolicy` that applies decisions to its own counters.

Readings of the paper where it is not explicit (each one is tested):

R1 (Eq. 5) when sum(K_i) >= K_master the floor would be negative; the text says
   "leaving no space for RC", so N_RC is clamped at 0.
R2 (Eq. 1-3) byte quantities may be any non-negative integers; M_block must come
   out integral (e.g. INT4 with dtype_bytes=0.5 needs an even element count).
R3 (Eq. 6-9) Eq. 6/7 count elements of one K (or V) plane over all layers of a
   block. The physical block also holds V and its dtype may differ between the
   two models, so the alignment is computed on whole-block *bytes*
   (2 x BE x dtype_bytes). With equal dtypes this gives exactly Eq. 9's MEU_m /
   MEU_i (the common factor 2 x dtype cancels); ``lcm_elems`` is still reported
   literally as Eq. 8.
R4 (Alg. 1, SCALEUP) N_i is the worker's current allocation and ``need`` is the
   block demand of the incoming request (ceil(request_len / B_i)); a caller that
   wants aggregate demand passes the aggregate token count. The paper does not
   cap the reclaim; here, when ``donated_blocks`` (worker blocks currently lent
   to the master) is given, at most floor(donated / MEU_i) MEUs are reclaimed and
   the unmet rest is reported as ``shortfall_blocks``. ``donated_blocks=None``
   is the paper's uncapped behaviour.
R5 (Alg. 1, SCALEDOWN) an empty window has max_len = 0, so everything above
   ``min_blocks`` (default 0) may be released, in whole MEUs (floor). Release
   never takes the allocation below max(max_need, min_blocks) nor below 0.
R6 "the last t seconds" is inclusive: a request recorded at time ts is in the
   window at time now iff now - t <= ts <= now.
R7 direction: SCALE_UP means the worker gains k*MEU_i blocks and the master
   gives back k*MEU_m blocks; SCALE_DOWN is the reverse (worker donates).
R8 (Alg. 1, SCALEDOWN) the paper donates everything the window did not need. A donor
   may cap its donation (``max_donated_blocks``, e.g. --memx-peer-donate-max-gb): the
   release is then at most floor((cap - donated) / MEU_i) MEUs, never negative.
R9 (Eq. 6-9 on a chunked pool) memory moves between processes in pool chunks, so the
   unit that both sides and the pool can move without waste is
   lcm(master block bytes, worker block bytes, chunk bytes): ``chunk_aligned_unit``
   scales the MEU by the smallest factor making ``meu_bytes`` a multiple of the chunk.
   A donor whose KV is backed in chunk-aligned groups (memx's LayeredKVBuffers) passes
   its group as its block, which makes the factor 1.

The donor side of the peer tier (``DonationPolicy``) is ``ElasticWorkerPolicy`` on the
chunk-aligned unit, with decisions also expressed in chunks: its own demand in tokens in,
how many chunks to donate or reclaim out. The simulator's swiftcache mechanism drives the same
ElasticWorkerPolicy, so both take Alg. 1's decisions from one implementation.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._checks import check_int as _int

__all__ = [
    "KVGeometry",
    "LSCPlan",
    "ElasticUnit",
    "ScaleAction",
    "ScaleDecision",
    "RequestWindow",
    "ElasticWorkerPolicy",
    "layer_block_bytes",
    "worker_full_layer_blocks",
    "master_single_layer_blocks",
    "plan_lsc_from_blocks",
    "plan_lsc",
    "LayerStreamPlan",
    "plan_layer_stream",
    "block_elems",
    "block_major_shape",
    "min_elastic_unit",
    "blocks_for_tokens",
    "scale_up",
    "scale_down",
    "chunk_aligned_unit",
    "DonationStep",
    "DonationPolicy",
]


# --------------------------------------------------------------------------- validation


def _num(name: str, value, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} and finite, got {value}")
    return value


def _integral(name: str, value) -> int:
    """A product that must be a whole number of bytes (R2)."""
    rounded = round(value)
    if abs(value - rounded) > 1e-9:
        raise ValueError(f"{name} is not a whole number of bytes: {value}")
    return int(rounded)


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class KVGeometry:
    """KV shape of one model on one GPU (heads already divided by TP)."""

    num_layers: int
    block_size: int  # tokens per block (B)
    num_kv_heads: int  # H_kv
    head_dim: int  # D_kv
    dtype_bytes: float = 2  # d_type; 0.5 for INT4, 1 for FP8, 2 for FP16/BF16

    def __post_init__(self) -> None:
        _int("num_layers", self.num_layers, minimum=1)
        _int("block_size", self.block_size, minimum=1)
        _int("num_kv_heads", self.num_kv_heads, minimum=1)
        _int("head_dim", self.head_dim, minimum=1)
        _num("dtype_bytes", self.dtype_bytes)


def layer_block_bytes(geom: KVGeometry) -> int:
    """Eq. 1: M_block = 2 * B * H_kv * D_kv * d_type (K and V of one block, one layer)."""
    return _integral(
        "layer block bytes (Eq. 1)",
        2 * geom.block_size * geom.num_kv_heads * geom.head_dim * geom.dtype_bytes,
    )


def worker_full_layer_blocks(worker_cache_bytes: int, m_block_bytes: int, num_layers: int) -> int:
    """Eq. 2: K_i = floor(C_worker_i / (M_block * L)), master full-layer blocks a worker can hold."""
    _int("worker_cache_bytes", worker_cache_bytes)
    _int("m_block_bytes", m_block_bytes, minimum=1)
    _int("num_layers", num_layers, minimum=1)
    return worker_cache_bytes // (m_block_bytes * num_layers)


def master_single_layer_blocks(master_cache_bytes: int, m_block_bytes: int) -> int:
    """Eq. 3: K_master = floor(C_master / M_block)."""
    _int("master_cache_bytes", master_cache_bytes)
    _int("m_block_bytes", m_block_bytes, minimum=1)
    return master_cache_bytes // m_block_bytes


# --------------------------------------------------------------------------- W2: LSC + RC


@dataclass(frozen=True)
class LSCPlan:
    """Master-side split of local KV memory into layer stream cache and regular cache."""

    num_layers: int  # L of the master
    k_master: int  # single-layer blocks the master memory holds (Eq. 3)
    k_workers: tuple[int, ...]  # full-layer master blocks each worker holds (Eq. 2)
    n_lsc: int  # single-layer blocks of LSC (Eq. 4)
    n_rc: int  # full-layer blocks of RC (Eq. 5, R1)
    block_size: int | None = None  # tokens per block, if known
    m_block_bytes: int | None = None  # Eq. 1, if known

    @property
    def max_context_blocks(self) -> int:
        """N_LSC + N_RC: longest context in blocks the master supports."""
        return self.n_lsc + self.n_rc

    @property
    def max_context_tokens(self) -> int | None:
        return None if self.block_size is None else self.max_context_blocks * self.block_size

    @property
    def baseline_context_blocks(self) -> int:
        """Without LSC the master holds only floor(K_master / L) full-layer blocks."""
        return self.k_master // self.num_layers

    @property
    def unused_single_layer_blocks(self) -> int:
        """Single-layer blocks left after LSC and RC (the floor remainder of Eq. 5)."""
        return self.k_master - self.n_lsc - self.n_rc * self.num_layers

    @property
    def lsc_bytes(self) -> int | None:
        return None if self.m_block_bytes is None else self.n_lsc * self.m_block_bytes

    @property
    def rc_bytes(self) -> int | None:
        if self.m_block_bytes is None:
            return None
        return self.n_rc * self.num_layers * self.m_block_bytes


def plan_lsc_from_blocks(
    k_master: int,
    k_workers: Sequence[int],
    num_layers: int,
    *,
    block_size: int | None = None,
    m_block_bytes: int | None = None,
) -> LSCPlan:
    """Eq. 4-5 from block counts (the form of the paper's worked example)."""
    _int("k_master", k_master)
    _int("num_layers", num_layers, minimum=1)
    if block_size is not None:
        _int("block_size", block_size, minimum=1)
    if m_block_bytes is not None:
        _int("m_block_bytes", m_block_bytes, minimum=1)
    if isinstance(k_workers, (str, bytes)):
        raise ValueError(f"k_workers must be a sequence of ints, got {k_workers!r}")
    ks = tuple(_int(f"k_workers[{i}]", k) for i, k in enumerate(k_workers))
    total = sum(ks)
    n_lsc = min(total, k_master)  # Eq. 4
    n_rc = max(0, (k_master - total) // num_layers)  # Eq. 5, clamped (R1)
    return LSCPlan(
        num_layers=num_layers,
        k_master=k_master,
        k_workers=ks,
        n_lsc=n_lsc,
        n_rc=n_rc,
        block_size=block_size,
        m_block_bytes=m_block_bytes,
    )


def plan_lsc(master: KVGeometry, master_cache_bytes: int, worker_cache_bytes: Sequence[int]) -> LSCPlan:
    """Eq. 1-5 from byte budgets: master KV bytes and each worker's KV bytes on loan."""
    if not isinstance(master, KVGeometry):
        raise ValueError(f"master must be a KVGeometry, got {master!r}")
    if isinstance(worker_cache_bytes, (str, bytes)):
        raise ValueError(f"worker_cache_bytes must be a sequence of ints, got {worker_cache_bytes!r}")
    m_block = layer_block_bytes(master)
    k_master = master_single_layer_blocks(_int("master_cache_bytes", master_cache_bytes), m_block)
    ks = [
        worker_full_layer_blocks(_int(f"worker_cache_bytes[{i}]", c), m_block, master.num_layers)
        for i, c in enumerate(worker_cache_bytes)
    ]
    return plan_lsc_from_blocks(k_master, ks, master.num_layers, block_size=master.block_size, m_block_bytes=m_block)


@dataclass(frozen=True)
class LayerStreamPlan:
    """The server's realisation of an ``LSCPlan`` at layer granularity (docs/peer-kv.md, W2).

    An engine whose KV pool gives a token one slot shared by all layers cannot split tokens into
    LSC and RC blocks (the paper's Eq. 4-5 split); it splits *layers*: ``resident_layers`` keep
    their KV of every slot locally, ``streamed_layers`` keep it at the donors and share
    ``staging_layers`` local layer buffer(s) into which each streamed layer's used rows are copied
    before its attention. For ``capacity_tokens`` slots the local memory is
    ``(resident + staging) x capacity`` layer-rows, the donors' ``streamed x capacity``.
    Invariant: ``capacity_tokens <= lsc.max_context_tokens`` (the paper's bound for the same
    budgets; the layer split can only reach it, never pass it) and both byte totals fit.
    """

    lsc: LSCPlan
    resident_layers: int
    streamed_layers: int
    staging_layers: int
    capacity_tokens: int
    token_layer_bytes: int  # K and V of one token in one layer

    @property
    def local_bytes(self) -> int:
        return (self.resident_layers + self.staging_layers) * self.capacity_tokens * self.token_layer_bytes

    @property
    def peer_bytes(self) -> int:
        return self.streamed_layers * self.capacity_tokens * self.token_layer_bytes

    @property
    def baseline_tokens(self) -> int:
        """Tokens a server without LSC holds in the same local memory (every layer resident)."""
        return self.lsc.baseline_context_blocks * (self.lsc.block_size or 1)


def plan_layer_stream(
    master: KVGeometry,
    master_cache_bytes: int,
    worker_cache_bytes: Sequence[int],
    *,
    staging_layers: int = 1,
) -> LayerStreamPlan:
    """Eq. 1-5 (``plan_lsc``) for the budgets, then the layer split that holds the most tokens.

    For each resident count R (0 .. L-1; R = L means no streaming) the capacity is
    ``min(C_master / ((R + staging) * b), sum(C_worker) / ((L - R) * b))`` tokens (b: K+V bytes of
    one token in one layer), capped by the paper's ``(N_LSC + N_RC) * B`` and rounded down to whole
    blocks of ``B`` tokens; the largest wins (ties: more resident layers, less streaming).
    """
    lsc = plan_lsc(master, master_cache_bytes, worker_cache_bytes)
    _int("staging_layers", staging_layers, minimum=1)
    layers, block = master.num_layers, master.block_size
    b = lsc.m_block_bytes // block  # Eq. 1 per token
    peer = sum(int(c) for c in worker_cache_bytes)
    bound = lsc.max_context_tokens
    best = (master_cache_bytes // (layers * b) // block * block, layers)  # no streaming: every layer resident
    for resident in range(layers - 1, -1, -1):
        local_rows = master_cache_bytes // ((resident + staging_layers) * b)
        peer_rows = peer // ((layers - resident) * b)
        tokens = min(local_rows, peer_rows, bound) // block * block
        if tokens > best[0]:
            best = (tokens, resident)
    tokens, resident = best
    streamed = layers - resident
    return LayerStreamPlan(
        lsc=lsc,
        resident_layers=resident,
        streamed_layers=streamed,
        staging_layers=staging_layers if streamed else 0,
        capacity_tokens=tokens,
        token_layer_bytes=b,
    )


# --------------------------------------------------------------------------- W3: MEU


def block_elems(geom: KVGeometry) -> int:
    """Eq. 6/7: BE = L * B * H_kv * D_kv (one block, all layers, one of K/V)."""
    return geom.num_layers * geom.block_size * geom.num_kv_heads * geom.head_dim


def block_major_shape(geom: KVGeometry, n_blocks: int) -> tuple[int, int, int]:
    """Block-major layout (n_blocks, n_layers, block_elems_per_layer); resizing touches only the tail."""
    _int("n_blocks", n_blocks)
    return (n_blocks, geom.num_layers, geom.block_size * geom.num_kv_heads * geom.head_dim)


@dataclass(frozen=True)
class ElasticUnit:
    """Minimum elastic unit between the master and one worker (Eq. 8-9, R3)."""

    master_block_elems: int  # BE_m (Eq. 6)
    worker_block_elems: int  # BE_i (Eq. 7)
    lcm_elems: int  # Eq. 8, literal
    master_block_bytes: int  # whole block-major block, K and V, all layers
    worker_block_bytes: int
    meu_master: int  # MEU_m, master blocks per unit (Eq. 9)
    meu_worker: int  # MEU_i, worker blocks per unit (Eq. 9)
    meu_bytes: int  # bytes of one unit; == meu_master*master_block_bytes == meu_worker*worker_block_bytes

    def master_blocks(self, units: int) -> int:
        return _int("units", units) * self.meu_master

    def worker_blocks(self, units: int) -> int:
        return _int("units", units) * self.meu_worker

    def bytes_for(self, units: int) -> int:
        return _int("units", units) * self.meu_bytes


def _block_bytes(geom: KVGeometry, role: str) -> int:
    return _integral(f"{role} block bytes", 2 * block_elems(geom) * geom.dtype_bytes)


def min_elastic_unit(master: KVGeometry, worker: KVGeometry) -> ElasticUnit:
    """MEU of Eq. 6-9 (byte-aligned per R3)."""
    if not isinstance(master, KVGeometry):
        raise ValueError(f"master must be a KVGeometry, got {master!r}")
    if not isinstance(worker, KVGeometry):
        raise ValueError(f"worker must be a KVGeometry, got {worker!r}")
    be_m, be_i = block_elems(master), block_elems(worker)
    mb, wb = _block_bytes(master, "master"), _block_bytes(worker, "worker")
    lcm_bytes = math.lcm(mb, wb)
    return ElasticUnit(
        master_block_elems=be_m,
        worker_block_elems=be_i,
        lcm_elems=math.lcm(be_m, be_i),
        master_block_bytes=mb,
        worker_block_bytes=wb,
        meu_master=lcm_bytes // mb,
        meu_worker=lcm_bytes // wb,
        meu_bytes=lcm_bytes,
    )


# --------------------------------------------------------------------------- W4: Alg. 1


class ScaleAction(str, enum.Enum):
    NONE = "none"
    SCALE_UP = "scale_up"  # worker reclaims from the master
    SCALE_DOWN = "scale_down"  # worker donates to the master


@dataclass(frozen=True)
class ScaleDecision:
    """Outcome of SCALEUP / SCALEDOWN. Counts are always >= 0; ``action`` gives the direction (R7)."""

    action: ScaleAction
    units: int  # k, whole MEUs moved
    worker_blocks: int  # k * MEU_i (worker gains on SCALE_UP, releases on SCALE_DOWN)
    master_blocks: int  # k * MEU_m (master releases on SCALE_UP, gains on SCALE_DOWN)
    needed_blocks: int  # need (up) or max_need (down)
    worker_blocks_before: int
    worker_blocks_after: int
    donated_blocks_after: int | None  # worker blocks lent to the master afterwards, if tracked
    shortfall_blocks: int = 0  # up only: blocks still missing because the donation ran out (R4)
    reason: str = ""

    @property
    def changed(self) -> bool:
        return self.units > 0


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """ceil(tokens / block_size), Alg. 1 lines 11 and 23."""
    _int("tokens", tokens)
    _int("block_size", block_size, minimum=1)
    return -(-tokens // block_size)


def _check_meu(meu_worker: int, meu_master: int) -> None:
    _int("meu_worker", meu_worker, minimum=1)
    _int("meu_master", meu_master, minimum=1)


def scale_up(
    current_blocks: int,
    block_size: int,
    meu_worker: int,
    meu_master: int,
    request_len: int,
    *,
    donated_blocks: int | None = None,
) -> ScaleDecision:
    """Alg. 1 SCALEUP: reclaim ceil((need - N_i) / MEU_i) MEUs, capped by the donation (R4)."""
    _int("current_blocks", current_blocks)
    _check_meu(meu_worker, meu_master)
    if donated_blocks is not None:
        _int("donated_blocks", donated_blocks)
    need = blocks_for_tokens(_int("request_len", request_len), block_size)
    if need <= current_blocks:
        return ScaleDecision(
            ScaleAction.NONE,
            0,
            0,
            0,
            need,
            current_blocks,
            current_blocks,
            donated_blocks,
            reason="allocation already covers the request",
        )
    diff = need - current_blocks
    k = -(-diff // meu_worker)
    reason = "reclaim whole MEUs for the request"
    if donated_blocks is not None:
        k_max = donated_blocks // meu_worker
        if k > k_max:
            k = k_max
            reason = "donation exhausted; reclaim all lent MEUs"
    after = current_blocks + k * meu_worker
    return ScaleDecision(
        ScaleAction.SCALE_UP if k else ScaleAction.NONE,
        k,
        k * meu_worker,
        k * meu_master,
        need,
        current_blocks,
        after,
        None if donated_blocks is None else donated_blocks - k * meu_worker,
        shortfall_blocks=max(0, need - after),
        reason=reason if k else "nothing lent to reclaim",
    )


def scale_down(
    current_blocks: int,
    block_size: int,
    meu_worker: int,
    meu_master: int,
    window_lengths: Iterable[int],
    *,
    min_blocks: int = 0,
    donated_blocks: int | None = None,
    max_donated_blocks: int | None = None,
) -> ScaleDecision:
    """Alg. 1 SCALEDOWN: release floor((N_i - max_need) / MEU_i) MEUs not needed by the last window (R5),
    at most up to ``max_donated_blocks`` donated in total (R8; needs ``donated_blocks``)."""
    _int("current_blocks", current_blocks)
    _check_meu(meu_worker, meu_master)
    _int("min_blocks", min_blocks)
    if donated_blocks is not None:
        _int("donated_blocks", donated_blocks)
    if max_donated_blocks is not None:
        _int("max_donated_blocks", max_donated_blocks)
        if donated_blocks is None:
            raise ValueError("max_donated_blocks needs donated_blocks (what is lent already)")
    if isinstance(window_lengths, (str, bytes)):
        raise ValueError(f"window_lengths must be an iterable of ints, got {window_lengths!r}")
    max_len = 0
    for i, n in enumerate(window_lengths):
        max_len = max(max_len, _int(f"window_lengths[{i}]", n))
    max_need = blocks_for_tokens(max_len, block_size)
    floor_blocks = max(max_need, min_blocks)
    if floor_blocks >= current_blocks:
        return ScaleDecision(
            ScaleAction.NONE,
            0,
            0,
            0,
            max_need,
            current_blocks,
            current_blocks,
            donated_blocks,
            reason="recent demand needs the whole allocation",
        )
    k = (current_blocks - floor_blocks) // meu_worker
    reason = "release MEUs unused in the last window" if k else "surplus smaller than one MEU"
    if max_donated_blocks is not None:
        k_cap = max(0, max_donated_blocks - donated_blocks) // meu_worker
        if k > k_cap:
            k = k_cap
            reason = "donation cap reached" if not k else "release MEUs up to the donation cap"
    after = current_blocks - k * meu_worker
    return ScaleDecision(
        ScaleAction.SCALE_DOWN if k else ScaleAction.NONE,
        k,
        k * meu_worker,
        k * meu_master,
        max_need,
        current_blocks,
        after,
        None if donated_blocks is None else donated_blocks + k * meu_worker,
        reason=reason,
    )


class RequestWindow:
    """Request lengths seen in the last ``window_s`` seconds (inclusive, R6). Caller supplies time."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = _num("window_s", window_s)
        self._items: deque[tuple[float, int]] = deque()
        self._last = float("-inf")

    def record(self, now: float, request_len: int) -> None:
        now = _num("now", now, positive=False)
        _int("request_len", request_len)
        if now < self._last:
            raise ValueError(f"now must not go backwards: {now} < {self._last}")
        self._last = now
        self._items.append((now, request_len))

    def lengths(self, now: float) -> tuple[int, ...]:
        now = _num("now", now, positive=False)
        cutoff = now - self.window_s
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()
        return tuple(n for ts, n in self._items if ts <= now)

    def max_len(self, now: float) -> int:
        return max(self.lengths(now), default=0)


@dataclass
class ElasticWorkerPolicy:
    """Bookkeeping for one worker: allocation and blocks lent to the master, both in worker blocks.

    ``on_request`` runs SCALEUP (never reclaims more than is lent), ``on_tick`` runs
    SCALEDOWN over the last window. Each returns the decision and applies it to the
    counters; the caller performs the actual remap and block-table sync.
    """

    block_size: int
    meu_worker: int
    meu_master: int
    current_blocks: int
    donated_blocks: int = 0
    window_s: float = 60.0
    min_blocks: int = 0
    max_donated_blocks: int | None = None
    _window: RequestWindow = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _int("block_size", self.block_size, minimum=1)
        _check_meu(self.meu_worker, self.meu_master)
        _int("current_blocks", self.current_blocks)
        _int("donated_blocks", self.donated_blocks)
        _int("min_blocks", self.min_blocks)
        if self.max_donated_blocks is not None:
            _int("max_donated_blocks", self.max_donated_blocks)
        self._window = RequestWindow(self.window_s)

    @classmethod
    def from_unit(cls, unit: ElasticUnit, **kw) -> ElasticWorkerPolicy:
        return cls(meu_worker=unit.meu_worker, meu_master=unit.meu_master, **kw)

    @property
    def total_blocks(self) -> int:
        return self.current_blocks + self.donated_blocks

    def _apply(self, d: ScaleDecision) -> ScaleDecision:
        self.current_blocks = d.worker_blocks_after
        if d.donated_blocks_after is not None:
            self.donated_blocks = d.donated_blocks_after
        return d

    def on_request(self, now: float, request_len: int) -> ScaleDecision:
        self._window.record(now, request_len)
        return self._apply(
            scale_up(
                self.current_blocks,
                self.block_size,
                self.meu_worker,
                self.meu_master,
                request_len,
                donated_blocks=self.donated_blocks,
            )
        )

    def on_tick(self, now: float) -> ScaleDecision:
        return self._apply(
            scale_down(
                self.current_blocks,
                self.block_size,
                self.meu_worker,
                self.meu_master,
                self._window.lengths(now),
                min_blocks=self.min_blocks,
                donated_blocks=self.donated_blocks,
                max_donated_blocks=self.max_donated_blocks,
            )
        )


# --------------------------------------------------------------- chunked pool (R9)


def chunk_aligned_unit(unit: ElasticUnit, chunk_bytes: int) -> ElasticUnit:
    """The MEU scaled by the smallest factor that makes ``meu_bytes`` a whole number of chunks (R9)."""
    if not isinstance(unit, ElasticUnit):
        raise ValueError(f"unit must be an ElasticUnit, got {unit!r}")
    _int("chunk_bytes", chunk_bytes, minimum=1)
    f = math.lcm(unit.meu_bytes, chunk_bytes) // unit.meu_bytes
    if f == 1:
        return unit
    return ElasticUnit(
        master_block_elems=unit.master_block_elems,
        worker_block_elems=unit.worker_block_elems,
        lcm_elems=unit.lcm_elems,
        master_block_bytes=unit.master_block_bytes,
        worker_block_bytes=unit.worker_block_bytes,
        meu_master=unit.meu_master * f,
        meu_worker=unit.meu_worker * f,
        meu_bytes=unit.meu_bytes * f,
    )


@dataclass(frozen=True)
class DonationStep:
    """One decision of a donor, in Alg. 1's terms and in what the mechanism moves."""

    decision: ScaleDecision
    chunks: int  # pool chunks that change hands (k * meu_bytes / chunk_bytes)
    master_blocks: int  # borrower blocks the donated region gains (donate) or loses (reclaim)

    @property
    def action(self) -> ScaleAction:
        return self.decision.action

    @property
    def donate(self) -> bool:
        return self.decision.action is ScaleAction.SCALE_DOWN

    @property
    def reclaim(self) -> bool:
        return self.decision.action is ScaleAction.SCALE_UP


class DonationPolicy:
    """A donor's Alg. 1 on the chunk-aligned MEU (R9), with a cap on the donation (R8).

    ``worker`` is the donor's geometry (its block: the smallest KV unit it can give back),
    ``master`` the borrower's. ``kv_tokens`` is the donor's whole KV capacity in tokens; it starts
    with all of it and donates nothing. ``on_demand(now, tokens)`` is SCALEUP for the donor's
    current demand (tokens it needs now), ``on_tick(now)`` SCALEDOWN over the last ``window_s``.
    """

    def __init__(
        self,
        worker: KVGeometry,
        master: KVGeometry,
        *,
        chunk_bytes: int,
        kv_tokens: int,
        max_donate_bytes: int | None = None,
        window_s: float = 60.0,
        min_tokens: int = 0,
    ) -> None:
        self.unit = chunk_aligned_unit(min_elastic_unit(master, worker), chunk_bytes)
        self.chunk_bytes = chunk_bytes
        total = _int("kv_tokens", kv_tokens) // worker.block_size
        cap = None
        if max_donate_bytes is not None:
            cap = _int("max_donate_bytes", max_donate_bytes) // self.unit.meu_bytes * self.unit.meu_worker
        self.policy = ElasticWorkerPolicy.from_unit(
            self.unit,
            block_size=worker.block_size,
            current_blocks=total,
            window_s=window_s,
            min_blocks=blocks_for_tokens(_int("min_tokens", min_tokens), worker.block_size),
            max_donated_blocks=cap,
        )

    @property
    def donated_chunks(self) -> int:
        return self.policy.donated_blocks // self.unit.meu_worker * self.unit.meu_bytes // self.chunk_bytes

    def _step(self, d: ScaleDecision) -> DonationStep:
        return DonationStep(d, d.units * self.unit.meu_bytes // self.chunk_bytes, d.master_blocks)

    def on_demand(self, now: float, tokens: int) -> DonationStep:
        return self._step(self.policy.on_request(now, tokens))

    def on_tick(self, now: float) -> DonationStep:
        return self._step(self.policy.on_tick(now))

    def still_lent(self, worker_blocks: int) -> None:
        """A reclaim the mechanism could not carry out (e.g. only pinned leases hold the memory):
        those blocks are still lent, and the donor does not have them."""
        _int("worker_blocks", worker_blocks)
        worker_blocks = min(worker_blocks, self.policy.current_blocks)
        self.policy.current_blocks -= worker_blocks
        self.policy.donated_blocks += worker_blocks

    def lost(self, worker_blocks: int) -> None:
        """The borrower is gone: its donation is the donor's again (the chunks came back)."""
        _int("worker_blocks", worker_blocks)
        worker_blocks = min(worker_blocks, self.policy.donated_blocks)
        self.policy.donated_blocks -= worker_blocks
        self.policy.current_blocks += worker_blocks
