"""The layer stream cache inside one SGLang scheduler (``--memx-peer-layer-stream``; docs/peer-kv.md,
"Layer stream cache (W2)").

Three moments, each called from a hook:

1. ``plan(build, stock_tokens, ...)`` — upstream has just sized its KV pool (``config_from_budget``:
   its memory profile or ``--max-total-tokens``, user cap applied). Those ``stock_tokens`` of every
   layer are this server's local KV budget ``C_master``. It connects a *pinned* lease to a donor of
   its pool (``PeerLink(pin_bytes=...)``, waiting for one to listen and for its donation to settle),
   and ``plan_layer_stream`` (Eq. 1-5 through ``plan_lsc``, the simulator's policy) picks how many
   layers stream and how many tokens the pool then holds; upstream builds the pool with that many.
2. ``buffers(setup, geometry)`` — the MHA pool's K/V buffers are being backed (elastic KV): only the
   resident layers and one staging layer get pooled buffers; every streamed layer's K (V) buffer is
   the staging K (V) buffer. ``attach`` builds the ``LayerStreamCache`` over the staging views.
3. ``before`` / ``after`` one streamed layer's attention: the batch's rows are loaded from the donor
   into staging; the rows the forward wrote are stored back.

When the donor is gone the cache is ``broken``: the copies stop (``LayerStreamLost`` is caught, the
forward runs on whatever staging holds: partial, stale or foreign rows). Invariant: no output of a
forward that ran while (or after) the cache broke reaches a client. Before upstream processes a step's
results, every request of that step is ended with the named error and its output withheld
(``hooks.layer_stream.around_process_batch_result``, ``note_withheld``); ``PeerKVServer.tick`` then
aborts every other request before the next batch.

One per scheduler process (tensor parallel size 1): ``active()``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from memory_ext.peer import LayerStreamCache, LayerStreamLost, PeerKVLayout, PeerLink, donor_sockets
from memory_ext.peer.lsc import plane_bytes
from memory_ext.policy.swiftcache import KVGeometry, LayerStreamPlan, plan_layer_stream
from memory_ext.vmm import host_backend
from sglang_memx.config import MemxConfig, MemxConfigError
from sglang_memx.elastic.paths import pool_dir

logger = logging.getLogger("sglang_memx")

FLAG = "--memx-peer-layer-stream"
BLOCK_TOKENS = 16  # the peer tier's block (as PeerKVServer's): the lease must carry the donor's layout
STAGING_LAYERS = 1
WAIT_DONOR_S = 120.0  # at start-up, for a donor of the pool to listen
WAIT_GRANT_S = 60.0  # then for its first donation to the pinned lease
SETTLE_S = 2.0  # the donation has not grown for this long: it is what the donor lends
LOST = "memx layer stream cache: the donor holding this server's streamed layers' KV is gone; the request cannot go on"


@dataclass
class LayerStreamSetup:
    config: MemxConfig
    link: PeerLink
    layout: PeerKVLayout
    plan: LayerStreamPlan
    granted_bytes: int
    stock_tokens: int
    backend: object
    resident: int = 0
    streamed: tuple[int, ...] = ()
    lsc: LayerStreamCache | None = None
    req_to_token: torch.Tensor | None = None
    stats: dict = field(default_factory=lambda: {"forwards": 0, "bytes_last_forward": 0, "copies_skipped": 0,
                                                 "steps_withheld": 0, "requests_withheld": 0})  # fmt: skip
    _forward_bytes: int = 0
    _rows: torch.Tensor | None = None  # the current forward's read rows (see ``batch_rows``)

    def status(self) -> dict:
        p = self.plan
        doc = {
            "donor": self.link.socket_path.rsplit("/", 1)[-1],
            "stock_tokens": self.stock_tokens,
            "capacity_tokens": p.capacity_tokens,
            "resident_layers": p.resident_layers,
            "streamed_layers": p.streamed_layers,
            "staging_layers": p.staging_layers,
            "granted_bytes": self.granted_bytes,
            "local_kv_bytes_planned": p.local_bytes,
            "peer_bytes_planned": p.peer_bytes,
            "plan_lsc": {"n_lsc": p.lsc.n_lsc, "n_rc": p.lsc.n_rc, "max_context_tokens": p.lsc.max_context_tokens},
            **self.stats,
        }
        if self.lsc is not None:
            doc.update({f"lsc_{k}": v for k, v in self.lsc.status().items()})
        return doc


_active: LayerStreamSetup | None = None


def active() -> LayerStreamSetup | None:
    return _active


def _connect(config: MemxConfig, layout: PeerKVLayout, backend, pin_bytes: int, name: str) -> PeerLink:
    directory, pool = pool_dir(config), config.pool
    end = time.monotonic() + WAIT_DONOR_S
    last: Exception | None = None
    while time.monotonic() < end:
        for donor, path in sorted(donor_sockets(directory, pool).items()):
            try:
                return PeerLink(path, f"{name}-lsc", layout, backend, pin_bytes=pin_bytes)
            except ValueError as exc:  # another layout: never mix KV
                raise MemxConfigError(FLAG, f"donor {donor} refused this server's layer stream lease: {exc}") from exc
            except (OSError, ConnectionError) as exc:  # not listening yet
                last = exc
        time.sleep(0.5)
    raise MemxConfigError(
        FLAG,
        f"no donor of pool {pool!r} accepted a lease within {WAIT_DONOR_S:.0f} s "
        f"(start a --memx-peer-kv donate server on the same --memx-pool first); {last}",
    )


def _wait_for_grant(link: PeerLink, want: int) -> int:
    end = time.monotonic() + WAIT_GRANT_S
    seen, since = 0, time.monotonic()
    while time.monotonic() < end:
        now_bytes = link.usable_bytes
        if now_bytes >= want:
            return now_bytes
        if now_bytes != seen:
            seen, since = now_bytes, time.monotonic()
        elif seen and time.monotonic() - since >= SETTLE_S:
            return seen
        time.sleep(0.05)
    return link.usable_bytes


def plan(
    config: MemxConfig, *, stock_tokens: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    page_size: int, model: str, name: str, chunk_bytes: int,
) -> LayerStreamSetup:  # fmt: skip
    """Connect the pinned lease and decide the split; see the module docstring (moment 1)."""
    global _active
    itemsize = torch.empty((), dtype=dtype).element_size()
    dtype_name = str(dtype).replace("torch.", "")
    block = math.lcm(BLOCK_TOKENS, page_size)
    layout = PeerKVLayout(num_layers=layers, block_tokens=block, num_kv_heads=kv_heads, head_dim=head_dim,
                          dtype=dtype_name, model=model)  # fmt: skip
    geometry = KVGeometry(num_layers=layers, block_size=block, num_kv_heads=kv_heads, head_dim=head_dim,
                          dtype_bytes=itemsize)  # fmt: skip
    token_layer = 2 * kv_heads * head_dim * itemsize
    local = stock_tokens * layers * token_layer  # C_master: what stock would give its KV
    backend = host_backend(chunk_bytes)
    # the most a donation can be worth: every layer streamed at local / (one staging layer) tokens
    want = layers * (local // token_layer + page_size) * token_layer
    link = _connect(config, layout, backend, want, name)
    granted = _wait_for_grant(link, want)
    # the planes hold the padded page too: plan with what is left after it
    usable = max(0, granted - layers * page_size * token_layer)
    p = plan_layer_stream(geometry, local, [usable], staging_layers=STAGING_LAYERS)
    setup = LayerStreamSetup(config, link, layout, p, granted, stock_tokens, backend)
    _active = setup
    logger.info(
        "memx layer stream cache: donor %s lends %d B; local budget %d tokens x %d layers -> %d tokens "
        "(%d resident + %d staging layer(s), %d streamed; plan_lsc bound %s tokens)",
        link.socket_path.rsplit("/", 1)[-1], granted, stock_tokens, layers, p.capacity_tokens, p.resident_layers,
        p.staging_layers, p.streamed_layers, p.lsc.max_context_tokens,
    )  # fmt: skip
    if p.streamed_layers == 0:
        logger.warning("memx layer stream cache: the donation (%d B) is too small to stream a layer; "
                       "every layer stays resident", granted)  # fmt: skip
    return setup


def buffer_index(setup: LayerStreamSetup, layers: int):
    """``(row_bytes list order, index_of(i))``: buffer ``i`` of upstream (0..L-1 K, L..2L-1 V) -> pooled
    buffer; resident layers 0..R-1 have their own, layers R.. (streamed) share buffer R (staging)."""
    resident = setup.plan.resident_layers
    own = resident + STAGING_LAYERS

    def index_of(i: int) -> int:
        kv, layer = divmod(i, layers)
        return kv * own + min(layer, resident)

    return own, index_of


def attach(setup: LayerStreamSetup, layers: int, staging_k: torch.Tensor, staging_v: torch.Tensor) -> None:
    """The cache over the staging views (moment 2); checks the lease covers every streamed plane."""
    resident = setup.plan.resident_layers
    setup.resident = resident
    setup.streamed = tuple(range(resident, layers))
    rows = staging_k.shape[0]
    need = len(setup.streamed) * plane_bytes(rows, staging_k[0].numel() * staging_k.element_size(),
                                             staging_v[0].numel() * staging_v.element_size())  # fmt: skip
    if need > setup.link.usable_bytes:
        raise MemxConfigError(FLAG, f"the donor's lease ({setup.link.usable_bytes} B) no longer holds the "
                                    f"{len(setup.streamed)} streamed layers of {rows} rows ({need} B)")  # fmt: skip
    setup.lsc = LayerStreamCache(setup.link, setup.streamed, staging_k, staging_v)


def streams(setup: LayerStreamSetup | None, layer: int) -> bool:
    return setup is not None and setup.lsc is not None and setup.lsc.streams(layer)


def batch_rows(setup: LayerStreamSetup, layer: int, read) -> torch.Tensor:
    """The rows the current forward reads: ``read()`` at its first streamed layer, reused by the
    others (layers run in order within one forward, and its batch does not change between them)."""
    if layer == setup.streamed[0] or setup._rows is None:
        setup._rows = read()
    return setup._rows


def before(setup: LayerStreamSetup, layer: int, rows: torch.Tensor) -> None:
    """Donor -> staging for the batch's rows of ``layer`` (moment 3)."""
    lsc = setup.lsc
    if layer == setup.streamed[0]:
        setup.stats["forwards"] += 1
        setup.stats["bytes_last_forward"] = setup._forward_bytes
        setup._forward_bytes = 0
    _move(setup, lsc.load, layer, rows)


def after(setup: LayerStreamSetup, layer: int, rows: torch.Tensor) -> None:
    _move(setup, setup.lsc.store, layer, rows)


def _move(setup: LayerStreamSetup, fn, layer: int, rows: torch.Tensor) -> None:
    if rows.numel() == 0:
        return
    if setup.lsc.broken is not None:
        setup.stats["copies_skipped"] += 1
        return
    try:
        fn(layer, rows)
    except LayerStreamLost as exc:
        setup.stats["copies_skipped"] += 1
        logger.error("memx layer stream cache: %s; this step's outputs are withheld, every request aborted", exc)
        return
    setup._forward_bytes += int(rows.numel()) * (setup.lsc.k_row_bytes + setup.lsc.v_row_bytes)


def note_withheld(setup: LayerStreamSetup, requests: int) -> None:
    """A step's results were processed with the cache broken: its ``requests`` were ended unsent."""
    setup.stats["steps_withheld"] += 1
    setup.stats["requests_withheld"] += requests


def broken(setup: LayerStreamSetup | None) -> str | None:
    if setup is None or setup.lsc is None:
        return None
    if setup.lsc.broken is None and setup.link.dead:
        setup.lsc.broken = "the donor's lease closed"
    return setup.lsc.broken
