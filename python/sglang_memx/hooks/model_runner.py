"""Upstream subsystem: model executor (``sglang.srt.model_executor``).

* ``ModelRunner.forward`` (around): with elastic KV, the map calls made on the request path for
  this forward's batch are counted (per decode step in status); with ballooning, the forward runs through
  ``elastic.forward.run_forward``: the activation profile is measured on the first forwards
  (and later larger ones), and on CUDA with the activation arena every forward allocates its
  activations from the pool's chunks.
* ``ModelRunner.alloc_memory_pool`` (after): with ``--memx-weights``, the decoder layers move
  into the pool.
* ``WeightUpdater.update_weights_from_*`` / ``load_weights_from_distributed`` (around): refused
  with upstream's ``(False, message)`` while memx holds the layers.
"""

from __future__ import annotations

from sglang_memx.coordinator import device
from sglang_memx.coordinator.components import ActivationBalloonPart, WeightLender
from sglang_memx.coordinator.rank_agreement import RankAgreement
from sglang_memx.elastic.forward import run_forward
from sglang_memx.upstream import model as up_model
from sglang_memx.upstream.registry import HookSpec
from sglang_memx.weights.attach import attach
from sglang_memx.weights.forward import run_with_weights


def around_forward(original, runner, forward_batch, *args, **kwargs):
    coordinator = device.of(up_model.runner_allocator(runner))
    if coordinator is None:
        return original(runner, forward_batch, *args, **kwargs)
    decode = up_model.forward_is_decode(forward_batch)
    coordinator.kv.note_forward(decode)
    activation = coordinator.part(ActivationBalloonPart)
    if activation is None:
        forward = lambda: original(runner, forward_batch, *args, **kwargs)  # noqa: E731
    else:
        ranks = coordinator.part(RankAgreement)  # --tp > 1: the measured peaks are agreed
        forward = lambda: run_forward(activation.balloon, up_model.runner_device(runner),  # noqa: E731
                                      up_model.forward_shape(forward_batch),
                                      lambda: original(runner, forward_batch, *args, **kwargs),
                                      agree=None if ranks is None else ranks.max_over_ranks)  # fmt: skip
    weights = coordinator.part(WeightLender)
    if weights is None:
        return forward()
    return run_with_weights(weights.weights, decode, up_model.forward_shape(forward_batch), forward)


def after_alloc_memory_pool(result, runner, *args, **kwargs):
    coordinator = device.of(up_model.runner_allocator(runner))
    if coordinator is None:
        state = attach(runner, None, None)
    else:
        state = attach(runner, coordinator.kv, coordinator.shared_pool())
    if state is not None:
        coordinator.register(WeightLender(coordinator.kv, state))


WEIGHT_UPDATE_REFUSED = (
    "memx: online weight updates are not supported with --memx-weights (released layers have no "
    "memory behind their parameters, and the host master copies would go stale); restart the "
    "server without --memx-weights to update weights"
)


def around_weight_update(original, updater, *args, **kwargs):
    """Upstream's (success, message) answer: refused while memx holds the decoder layers."""
    coordinator = device.of(up_model.runner_allocator(up_model.updater_runner(updater)))
    if coordinator is not None and coordinator.part(WeightLender) is not None:
        return False, WEIGHT_UPDATE_REFUSED
    return original(updater, *args, **kwargs)


_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"

HOOKS = (
    HookSpec("sglang.srt.model_executor.model_runner.ModelRunner.forward", "around", around_forward, "elastic_kv",
             "count request-path maps per decode step; measure the activation profile on real forwards; "
             "allocate activations from the pool (CUDA); weights (needs elastic KV): apply released / restored "
             "layers between forwards, time the steps"),
    HookSpec("sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool", "after",
             after_alloc_memory_pool, "weights", "move the decoder layers into the pool once model and pool exist"),
    *(HookSpec(f"{_UPDATER}.{name}", "around", around_weight_update, "weights",
               "refuse online weight updates (success false, reason named) while layers are in the pool")
      for name in ("update_weights_from_disk", "update_weights_from_tensor", "load_weights_from_distributed",
                   "update_weights_from_ipc")),
)  # fmt: skip
