"""Elastic KV during upstream's KV pool build (``KVCacheConfigurator.configure``), with its
optional part from the peer tier (the layer stream cache), composed here above both.

``scope`` opens a build for this process's main model when ``--memx-elastic-kv`` is on
(a draft model's pool stays stock); inside it, the MHA pool's ``_create_buffers_normal``
asks ``make_elastic``, which backs the K/V buffers with pooled groups instead of zeroed
tensors. ``finish`` then checks what upstream built (a pool kind elastic KV cannot back
is refused with an error naming the flag, never served half-elastic), builds the host buffer
and ties the allocator to the device's coordinator (``coordinator.device``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from functools import partial

from memory_ext.policy.default_slo import SoloStepDefault
from memory_ext.policy.governor import BatchGovernor
from memory_ext.pool.lent_pool import LentPool
from memory_ext.pool.lockstep_pool import LockstepLentPool
from sglang_memx.config import MemxConfig, MemxConfigError, tpot_slo_source, ttft_slo_source
from sglang_memx.coordinator import device
from sglang_memx.coordinator.components import LayerStreamPart, PeerTier
from sglang_memx.coordinator.governor import GovernorPart, SloInForce
from sglang_memx.coordinator.rank_agreement import RankAgreement
from sglang_memx.coordinator.rank_pools import RankPools
from sglang_memx.coordinator.swa_spaces import SwaSpaces
from sglang_memx.elastic import shared_pool
from sglang_memx.elastic.build import activation_profile, build_elastic_kv, build_sibling_kv
from sglang_memx.elastic.host_buffer import build_host_buffer
from sglang_memx.elastic.slab import cell_format
from sglang_memx.families import ServedShape, check_served_shape, pool_class_for
from sglang_memx.peer import layer_stream, peer_name
from sglang_memx.upstream import kv as up_kv
from sglang_memx.upstream import layer_stream as up_ls
from sglang_memx.upstream import model as up_model
from sglang_memx.upstream import scheduler as up_sched
from sglang_memx.upstream import server_args as up_args

SUPPORTED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")  # SWA: its two sub-allocators

_current = threading.local()


@dataclass
class Build:
    config: MemxConfig
    server_args: object
    profile: object
    batch_tokens: int
    model_class: str = "this model"  # the served model's class, named in refusals
    tp_size: int = 1  # tensor parallel ranks: above 1, the ranks agree (``rank_agreement``), no arena
    kv: object = None
    lent: LentPool | None = None  # the shared pool's link (--memx-pool), with the KV space
    layer_stream: object = None  # peer.layer_stream.LayerStreamSetup (--memx-peer-layer-stream), once planned
    hybrid_swa: bool = False  # upstream builds SWAKVPool: a second space (the sliding-window sub-pool) joins ``kv``
    spaces: dict = field(default_factory=dict)  # id(MHA sub-pool) -> its ElasticKV (SWAKVPool's two)


def current() -> Build | None:
    """The build open in this thread (the main model's pool build with elastic KV), or None."""
    return vars(_current).get("build")


def plan_layer_stream(build: Build, configurator, stock_tokens: int) -> int:
    """With --memx-peer-layer-stream: the token count upstream should build the pool with, planned
    once per build from what upstream sized (``stock_tokens``: the local KV budget) and the donation."""
    if build.layer_stream is None:
        dims = up_model.decoder_dims(up_kv.configurator_parts(configurator)[1])
        if dims is None:
            raise MemxConfigError("--memx-peer-layer-stream", "the model's config lacks its KV heads / head dim")
        args = build.server_args
        build.layer_stream = layer_stream.plan(
            build.config, stock_tokens=stock_tokens, layers=up_ls.configurator_layers(configurator),
            kv_heads=dims["num_kv_heads"], head_dim=dims["head_dim"], dtype=up_ls.configurator_kv_dtype(configurator),
            page_size=up_args.page_size(args), model=up_args.model_path(args),
            name=peer_name(args),
            chunk_bytes=build.config.chunk_kb << 10,
        )  # fmt: skip
    page = up_args.page_size(build.server_args)
    return build.layer_stream.plan.capacity_tokens // page * page


@contextlib.contextmanager
def scope(configurator):
    server_args, model_config, model_dtype, is_draft = up_kv.configurator_parts(configurator)
    config = up_args.config_of(server_args)
    if config.disabled or not config.elastic_kv or is_draft:
        yield None
        return
    model_class = up_model.architecture(model_config)
    tp_size, pp_size = up_args.parallel_sizes(server_args)
    traits = up_kv.configurator_pool_traits(configurator)
    check_served_shape(config, ServedShape(model_class, pool_class_for(**traits), tp_size, pp_size,
                                           up_args.device_kind(server_args)))  # fmt: skip
    # two spaces on one pool: activations stay outside it, as in stock (the balloon counts one space's groups)
    profile = None if traits["hybrid_swa"] else activation_profile(up_model.decoder_dims(model_config),
                                                                   model_dtype.itemsize)  # fmt: skip
    build = Build(config, server_args, profile, up_args.max_prefill_batch_tokens(server_args), model_class=model_class,
                  tp_size=tp_size, hybrid_swa=traits["hybrid_swa"])  # fmt: skip
    _current.build = build
    try:
        yield build
    finally:
        _current.build = None


def make_elastic(pool) -> bool:
    """Back ``pool``'s buffers with pooled groups if a build is open; False: stock buffers. ``pool``
    is the MHA pool (K and V rows of every layer) or the MLA pool (one latent row per layer)."""
    build = vars(_current).get("build")
    if build is None:
        return False
    why = up_kv.elastic_pool_refusal(pool)
    if why is not None:
        raise MemxConfigError("--memx-elastic-kv", f"does not support {why}; run without the flag")
    if build.kv is not None:
        return _make_second_space(build, pool)
    g = up_kv.pool_geometry(pool)
    stream = build.layer_stream
    if stream is not None and g["kind"] != "mha":  # the launcher refuses it first (families)
        raise MemxConfigError("--memx-peer-layer-stream", f"streams K and V rows of an MHA pool; {build.model_class} "
                              f"is served from {type(pool).__name__}; run without the flag")  # fmt: skip
    rows = _local_rows(g, stream)
    kv, build.lent = build_elastic_kv(build.config, rows["row_bytes"], g["rows"], g["page_size"], g["pages"],
                                      g["device"], server_url=up_args.server_url(build.server_args),
                                      profile=build.profile, batch_tokens=build.batch_tokens,
                                      ranks=build.tp_size)  # fmt: skip
    index_of = rows["index_of"]
    up_kv.set_kv_views(pool, lambda i, dtype, shape: kv.buffers.view(index_of(i), dtype, shape))
    if stream is not None:  # the staging layer's views: what every streamed layer's buffer is
        layers = g["layers"]
        k_stage = kv.buffers.view(index_of(layers - 1), g["store_dtype"], (g["kv_heads"], g["head_dim"]))
        v_stage = kv.buffers.view(index_of(2 * layers - 1), g["store_dtype"], (g["kv_heads"], g["v_head_dim"]))
        layer_stream.attach(stream, layers, k_stage, v_stage)
    # the group is this slab (same LCM rule); with the layer stream cache it holds the local layers only
    kv.cell, kv.slab = cell_format({**g, "layers": rows["layers"], "row_bytes": rows["row_bytes"]},
                                   kv.buffers.pool.chunk_bytes)  # fmt: skip
    build.kv = kv
    build.spaces[id(pool)] = kv
    return True


def _make_second_space(build: Build, pool) -> bool:
    """SWAKVPool's second MHA sub-pool (the sliding-window one): a second space on the first's pool.
    Any other pool build that makes a second MHA pool is refused: backing one would be half-elastic."""
    if not build.hybrid_swa or len(build.spaces) != 1:
        raise MemxConfigError("--memx-elastic-kv", "backs one KV pool per server (two for a hybrid sliding-window "
                              "model's SWAKVPool); this pool build makes another; run without the flag")  # fmt: skip
    g = up_kv.pool_geometry(pool)
    kv = build_sibling_kv(build.config, g["row_bytes"], g["rows"], g["page_size"], g["pages"], g["device"],
                          build.kv.buffers.pool)  # fmt: skip
    up_kv.set_kv_views(pool, lambda i, dtype, shape: kv.buffers.view(i, dtype, shape))
    kv.cell, kv.slab = cell_format(g, kv.buffers.pool.chunk_bytes)
    build.spaces[id(pool)] = kv
    return True


def _local_rows(g: dict, stream) -> dict:
    """The buffers this server backs: every one of ``g``'s, or with the layer stream cache (MHA
    only) the local layers' K and V plus the staging layer's (``layer_stream.buffer_index``)."""
    if stream is None:
        return {"row_bytes": g["row_bytes"], "layers": g["layers"], "index_of": lambda i: i}
    own, index_of = layer_stream.buffer_index(stream, g["layers"])
    return {"row_bytes": [g["k_row_bytes"]] * own + [g["v_row_bytes"]] * own, "layers": own, "index_of": index_of}


def finish(build: Build, result) -> None:
    pool, allocator = up_kv.configured_pool_and_allocator(result)
    kv = build.kv
    _check_built(build, pool, allocator)
    swa = _swa_spaces(build, pool, allocator)
    if swa is None:
        kv.restrict_free_list(allocator)
    else:
        kv.restrict_free_list(swa.full_allocator)
        swa.swa.restrict_free_list(swa.swa_allocator)
    if build.layer_stream is not None:
        build.layer_stream.req_to_token = up_ls.req_to_token_table(result)
    # again here: a server may be built without the CLI parser
    build.config.check_server_args(
        up_args.radix_cache_disabled(build.server_args), up_args.cuda_graphs_possible(build.server_args)
    )
    host = None
    if build.config.host_buffer_gb is not None:
        host = build_host_buffer(build.config, kv.buffers.group_bytes)
    extra: list = [] if swa is None else [swa]
    if build.layer_stream is not None:
        extra.append(LayerStreamPart(build.layer_stream))
    if build.config.peer_kv != "off":
        extra.append(PeerTier(kv))
    ranks = RankAgreement(build.tp_size, up_sched.tp_cpu_group()) if build.tp_size > 1 else None
    if ranks is not None:
        extra.append(ranks)
        if isinstance(build.lent, LockstepLentPool):  # a shared pool: the ranks' FREE and reclaims agreed
            extra.append(RankPools(build.lent, ranks, partial(shared_pool.note_refused, kv)))
    if build.config.governed:  # the no-harm admission rules; with a TPOT SLO (given or measured), the batch cap too
        tpot, ttft = build.config.tpot_slo_ms, build.config.ttft_slo_ms
        default = SoloStepDefault(build.config.tpot_slo_scale)  # held while no TPOT SLO is given
        extra.append(GovernorPart(BatchGovernor(None if tpot is None else tpot / 1e3, default=default),
                                  tpot_source=tpot_slo_source(),
                                  ttft=None if ttft is None else SloInForce(ttft, ttft_slo_source()),
                                  tick_time=None if ranks is None else ranks.tick_time))  # fmt: skip
    coordinator = device.attach(allocator, kv, tuple(extra), lent=build.lent, host=host)
    if swa is not None:  # each sub-allocator's hooks find the space whose free list it is
        device.tie(swa.full_allocator, coordinator)
        device.tie(swa.swa_allocator, device.Coordinator(swa.swa, (swa,)))


def _check_built(build: Build, pool, allocator) -> None:
    """What upstream built is a pool and allocator elastic KV backs whole (else the error names the flag)."""
    if build.kv is None:
        why = up_kv.elastic_pool_refusal(pool) or f"{type(pool).__name__}"
        raise MemxConfigError(
            "--memx-elastic-kv",
            f"supports the MHA/GQA and MLA token-to-KV pools only (MHATokenToKVPool, unquantized KV, NHD layout; "
            f"MLATokenToKVPool, unquantized; SWAKVPool of two such MHA pools); "
            f"{build.model_class} in this configuration uses {why}",
        )
    subs = up_kv.swa_sub_allocators(allocator) if up_kv.is_swa_allocator(allocator) else (allocator,)
    if any(type(a).__name__ not in SUPPORTED_ALLOCATORS for a in subs):
        raise MemxConfigError(
            "--memx-elastic-kv",
            f"supports the {' and '.join(SUPPORTED_ALLOCATORS)} only (or the two of SWATokenToKVPoolAllocator); "
            f"{build.model_class} in this configuration uses {type(allocator).__name__} (over {type(pool).__name__})",
        )


def _swa_spaces(build: Build, pool, allocator) -> SwaSpaces | None:
    """A hybrid sliding-window model's two spaces with their sub-allocators, or None (one space)."""
    if not up_kv.is_swa_allocator(allocator):
        return None
    full_pool, swa_pool = up_kv.swa_sub_pools(pool) if up_kv.is_swa_pool(pool) else (None, None)
    full, swa = build.spaces.get(id(full_pool)), build.spaces.get(id(swa_pool))
    if full is not build.kv or swa is None:
        raise MemxConfigError("--memx-elastic-kv", f"backs both sub-pools of SWAKVPool; {build.model_class} in "
                              f"this configuration uses {type(pool).__name__} with other sub-pools; run without "
                              "the flag")  # fmt: skip
    if up_kv.swa_ring(allocator):  # its rows are addressed by request slot: no free list to keep them in
        raise MemxConfigError("--memx-elastic-kv", f"backs SWAKVPool's sub-pools through their allocators; "
                              f"{build.model_class} in this configuration keeps a per-request sliding-window ring; "
                              "run without the flag")  # fmt: skip
    full_allocator, swa_allocator = up_kv.swa_sub_allocators(allocator)
    return SwaSpaces(full, swa, full_allocator, swa_allocator)
