"""Move the served model's decoder layers into the elastic KV's pool (after the KV pool build).

Runs once per scheduler process, from the hook after ``ModelRunner.alloc_memory_pool``: by
then the model is loaded and the pool exists. Each decoder layer's own parameters (those not
shared with another layer) are packed into a ``WeightStore`` layer and rebound to views over
it; per-layer torch forward hooks run the ``LayerPipeline`` steps. Refusals name the flag:
a model memx cannot hook, or a budget that cannot hold the layers beside one KV group.
"""

from __future__ import annotations

import logging

from memory_ext.policy.oneiros import uniform_interval_layers
from memory_ext.pool import PoolExhausted
from memory_ext.pool.lent_pool import LentPool
from memory_ext.weights import HostCopier, LayerPipeline, WeightStore
from sglang_memx.config import MemxConfigError, tpot_slo_source
from sglang_memx.elastic.kv import ElasticKV
from sglang_memx.upstream import model as up_model
from sglang_memx.upstream import server_args as up_args
from sglang_memx.weights.state import WeightsState

logger = logging.getLogger("sglang_memx")

GB = 1 << 30


def _copier(device: str):
    if str(device).startswith("cuda"):
        from memory_ext.weights import CudaCopier

        return CudaCopier(device)
    return HostCopier()


def step_slo(config) -> tuple[float | None, str | None]:
    """The per-step SLO the released layers' streaming must keep (ms) and its flag:
    ``--memx-tbt-slo-ms``, else the governor's ``--memx-tpot-slo-ms`` (a decode step longer than the
    TPOT SLO cannot average within it), else none (the controller lends as Oneiros does)."""
    if config.tbt_slo_ms is not None:
        return config.tbt_slo_ms, "--memx-tbt-slo-ms"
    if config.tpot_slo_ms is not None:
        return config.tpot_slo_ms, tpot_slo_source()
    return None, None


def _own_params(layers) -> dict:
    """index -> parameters of that layer alone (a parameter two layers share stays out)."""
    seen: dict[int, int] = {}
    for _, layer in layers:
        for p in layer.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {i: [p for p in layer.parameters() if seen[id(p)] == 1 and p.is_contiguous()] for i, layer in layers}


def load_profile(path: str, n_layers: int):
    """The layer profile at ``path``; errors name ``--memx-weights-profile``."""
    from memory_ext.policy.layer_profile import LayerProfile

    try:
        profile = LayerProfile.load(path)
    except (OSError, ValueError) as exc:
        raise MemxConfigError("--memx-weights-profile", f"cannot use {path}: {exc}") from None
    if profile.n_layers != n_layers:
        raise MemxConfigError("--memx-weights-profile", f"{path} profiles {profile.n_layers} decoder layers "
                              f"({profile.model}), this model has {n_layers}")  # fmt: skip
    return profile


def attach(runner, kv: ElasticKV | None, lent: LentPool | None) -> WeightsState | None:
    """Move the runner's decoder layers into the pool of ``kv`` (the KV space the coordinator holds;
    None: stock KV; ``lent``: its shared pool's link, None for an own pool) and return their state,
    or None when ``--memx-weights`` is off."""
    config = up_args.config_of(up_model.runner_server_args(runner))
    if config.disabled or config.weights == "off":
        return None
    if kv is None:  # a draft model's pool stays stock, and so do its weights
        return None
    try:
        layers = up_model.decoder_layers(up_model.runner_model(runner))
    except up_model.NotHookable as exc:
        raise MemxConfigError("--memx-weights", f"cannot remap this model's weights: {exc}") from None
    if len(layers) < 2:
        raise MemxConfigError("--memx-weights", f"needs at least 2 decoder layers, the model has {len(layers)}")
    params = _own_params(layers)
    pool = kv.buffers.pool
    g = pool.chunk_bytes
    need = sum(-(-sum(p.numel() * p.element_size() + 256 for p in ps) // g) for ps in params.values())
    if lent is not None and pool.available() < need:
        lent.borrow(need - pool.available(), wait=30.0)
    store = WeightStore(pool, _copier(up_model.runner_device(runner)))
    nbytes = 0
    try:
        for i, ps in params.items():
            for p, view in zip(ps, store.add_layer(i, [p.data for p in ps])):
                p.data = view
            nbytes += sum(p.numel() * p.element_size() for p in ps)
    except PoolExhausted:
        store.close()
        budget = "--memx-pool-budget-gb" if lent is None else "--memx-pool"
        raise MemxConfigError(
            budget,
            f"the pool cannot hold the decoder layers ({need * g / GB:.3f} GB) beside the KV cache's first "
            f"group and the prefill activation; raise the budget",
        ) from None
    keys = [i for i, _ in layers]
    pipeline = LayerPipeline(store, keys)
    slo_ms, slo_source = step_slo(config)
    for i, layer in layers:
        layer.register_forward_pre_hook(lambda module, args, i=i: pipeline.before_layer(i))
        layer.register_forward_hook(lambda module, args, out, i=i: pipeline.after_layer(i))
    state = WeightsState(
        mode=config.weights,
        store=store,
        pipeline=pipeline,
        layer_keys=keys,
        layer_bytes=max(sum(p.numel() * p.element_size() for p in ps) for ps in params.values()),
        link_bytes_per_s=store.measure_copy(keys[0]),
        idle_after_s=config.weights_idle_after_s,
        sleep_after_s=config.sleep_after_s,
        tbt_slo_s=None if slo_ms is None else slo_ms / 1e3,
        tbt_slo_source=slo_source,
        copies_share_compute=isinstance(store.copier, HostCopier),  # the host copier's thread shares the cores
        depth=config.prefetch_depth,
    )
    if config.weights_profile is not None:
        state.profile = load_profile(config.weights_profile, len(keys))
    if config.weights == "static":
        n = round(config.weights_streamed * len(keys))
        slots = min(config.prefetch_depth or 2, n)
        pipeline.request([keys[j] for j in uniform_interval_layers(len(keys), n)], slots)
        pipeline.apply_pending()
    logger.info(
        "memx: %d decoder layers (%.1f MiB) moved into the pool (%s); %d streamed through %d slot(s)",
        len(keys), nbytes / (1 << 20), config.weights, len(store.streamed()), store.num_slots,
    )  # fmt: skip
    return state
