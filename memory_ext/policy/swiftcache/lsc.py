"""W2: the master's layer stream cache (LSC) and regular cache (RC), Eq. 4-5, and their
layer-granular realisation in a server (``plan_layer_stream``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import check_int as _int
from .geometry import KVGeometry, layer_block_bytes, master_single_layer_blocks, worker_full_layer_blocks


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
