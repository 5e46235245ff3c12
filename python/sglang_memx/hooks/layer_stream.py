"""Upstream subsystems: the KV pool's sizing and the attention layer: the layer stream cache
(``--memx-peer-layer-stream`` with ``--memx-peer-kv borrow``; docs/peer-kv.md, "Layer stream cache (W2)").

* ``KVCacheConfigurator.config_from_budget`` (after): upstream has turned its KV budget into a token
  count (profile, ``--max-total-tokens``, page alignment); that many tokens of every layer is the local
  budget, and the pool is built with the tokens the layer split holds in it
  (``coordinator.pool_build.plan_layer_stream``). Only inside the main model's elastic pool build.
* ``RadixAttention.forward`` (around): before a streamed layer's attention, the batch's rows of that
  layer are copied from the donor into the staging buffer; after it, the rows the forward wrote are
  copied back (``peer.layer_stream.before`` / ``after``). Other layers, and servers without the cache,
  pass straight through.
* ``Scheduler.process_batch_result`` (around): once the cache is broken (its donor gone; a copy into
  staging failed, so the forward that just ran may have read partial or foreign bytes), every
  request of the step whose results are about to be processed is ended with the named error before
  upstream emits anything of that step (``upstream.layer_stream.withhold_step``): no token computed
  from lost KV reaches a client. The tick's abort (``PeerKVServer.tick``) then clears the queue.

All three are registered with the ``peer_kv`` feature (they do nothing unless the cache is on).
"""

from __future__ import annotations

from sglang_memx.coordinator import pool_build
from sglang_memx.peer import layer_stream
from sglang_memx.upstream import layer_stream as up_ls
from sglang_memx.upstream.registry import HookSpec


def after_config_from_budget(result, configurator, budget_bytes, *args, **kwargs):
    build = pool_build.current()
    if build is None or not build.config.peer_layer_stream:
        return result
    tokens = pool_build.plan_layer_stream(build, configurator, up_ls.pool_config_tokens(result))
    up_ls.set_pool_config_tokens(result, tokens)
    return result


def around_attention(original, attn_layer, q, k, v, forward_batch, *args, **kwargs):
    setup = layer_stream.active()
    layer = up_ls.attn_layer_id(attn_layer)
    if not layer_stream.streams(setup, layer):
        return original(attn_layer, q, k, v, forward_batch, *args, **kwargs)
    rows = layer_stream.batch_rows(setup, layer, lambda: up_ls.read_rows(forward_batch, setup.req_to_token))
    layer_stream.before(setup, layer, rows)
    out = original(attn_layer, q, k, v, forward_batch, *args, **kwargs)
    layer_stream.after(setup, layer, up_ls.written_rows(forward_batch))
    return out


def around_process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    setup = layer_stream.active()
    lost = layer_stream.broken(setup)
    if lost is not None:
        layer_stream.note_withheld(setup, up_ls.withhold_step(scheduler, batch, f"{layer_stream.LOST} ({lost})"))
    return original(scheduler, batch, result, *args, **kwargs)


HOOKS = (
    HookSpec("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget", "after",
             after_config_from_budget, "peer_kv",
             "layer stream cache: size the KV pool by the layers kept local, for the same local budget"),
    HookSpec("sglang.srt.layers.radix_attention.RadixAttention.forward", "around", around_attention, "peer_kv",
             "layer stream cache: copy a streamed layer's rows in from the donor before its attention, "
             "the new rows back after"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler.process_batch_result", "around", around_process_batch_result,
             "peer_kv", "layer stream cache: once its donor is gone, end the step's requests with the named error "
             "before any token of a forward that may have read lost KV is emitted"),
)  # fmt: skip
