"""Upstream subsystem: server arguments (``sglang.srt.server_args``).

* ``ServerArgs.add_cli_args`` (after): adds the ``--memx-*`` group and makes the parser
  reject bad memx values the argparse way (exit 2, flag named), including a memx feature
  asked on an SGLang outside the supported range, and a served shape memx cannot back
  (``families``: a hybrid sliding-window pool, tensor / pipeline parallel size above 1; the
  model class and pool class named), before any model is loaded.
* ``ServerArgs.from_cli_args`` (around): builds the validated ``MemxConfig``, checks that
  the hooks of every feature on are in force in this (the launcher) process and attaches
  the config to the ServerArgs record, which upstream pickles into every process it starts.
"""

from __future__ import annotations

import argparse
import logging

from sglang_memx import __version__
from sglang_memx.config import MemxConfig, MemxConfigError, add_memx_arguments
from sglang_memx.families import ServedShape, architecture, check_served_shape, checkpoint_config, pool_class_for
from sglang_memx.families import text_config as checkpoint_text_config
from sglang_memx.peer.checks import check_peer_kv
from sglang_memx.upstream import model as up_model
from sglang_memx.upstream import server_args as up_args
from sglang_memx.upstream import version
from sglang_memx.upstream.registry import HookSpec

logger = logging.getLogger("sglang_memx")


def check_namespace(ns: argparse.Namespace) -> MemxConfig:
    """The validated config of a parsed command line (``MemxConfigError`` names the flag)."""
    config = MemxConfig.from_namespace(ns)
    requested = config.requested_flags()
    if requested and not version.is_supported(version.installed_sglang()):
        raise MemxConfigError(requested[0], version.unsupported_message(version.installed_sglang(), requested[0]))
    config.check_server_args(up_args.radix_cache_disabled(ns), up_args.cuda_graphs_possible(ns))
    check_peer_kv(config, disable_radix_cache=up_args.radix_cache_disabled(ns),
                  hierarchical_cache=up_args.hierarchical_cache(ns), device=up_args.device(ns))  # fmt: skip
    if config.elastic_kv and not config.disabled:
        check_served_shape(config, launch_shape(ns))
    return config


def launch_shape(ns: argparse.Namespace) -> ServedShape:
    """What upstream will serve, as far as the command line and a local checkpoint's ``config.json``
    tell before any model is loaded (the scheduler checks again with upstream's resolved facts)."""
    tp, pp = up_args.parallel_sizes(ns)
    hf = checkpoint_config(up_args.model_path(ns))
    device = up_args.device_kind(ns)
    if hf is None:
        return ServedShape(architecture(None), None, tp, pp, device)
    text = checkpoint_text_config(hf)
    archs = hf.get("architectures") or []
    hybrid = not up_args.hybrid_swa_memory_disabled(ns) and up_model.hybrid_swa_architecture(archs, text)
    layer_types = text.get("layer_types") or []
    pool = pool_class_for(hybrid_swa=hybrid, mla=text.get("kv_lora_rank") is not None,
                          linear="linear_attention" in layer_types)  # fmt: skip
    return ServedShape(architecture(hf), pool, tp, pp, device)


def _validating_parse_args(parser: argparse.ArgumentParser):
    original = parser.parse_args

    def parse_args(args=None, namespace=None):
        ns = original(args, namespace)
        try:
            check_namespace(ns)
        except MemxConfigError as exc:
            parser.error(str(exc))  # prints usage + message, exits with status 2
        return ns

    parse_args.memx_validating = True
    return parse_args


def after_add_cli_args(result, parser: argparse.ArgumentParser):
    add_memx_arguments(parser)
    if not getattr(parser.parse_args, "memx_validating", False):  # our marker on argparse's method
        parser.parse_args = _validating_parse_args(parser)
    return result


def startup_line(config: MemxConfig) -> str:
    on = [name for name, enabled in config.features.items() if enabled]
    state = "disabled (--memx-disable)" if config.disabled else "active"
    return (
        f"sglang-memx {__version__} {state} on sglang {version.installed_sglang()}; "
        f"features on: {', '.join(on) or 'none'}"
    )


def around_from_cli_args(original, cls, args: argparse.Namespace):
    server_args = original(cls, args)
    config = check_namespace(args)
    if version.is_supported(version.installed_sglang()):
        from sglang_memx.hooks import verify_hooks

        verify_hooks(config)
    up_args.attach_config(server_args, config)
    logger.info(startup_line(config))
    return server_args


HOOKS = (
    HookSpec("sglang.srt.server_args.ServerArgs.add_cli_args", "after", after_add_cli_args, "flags",
             "add and validate the --memx-* flags"),
    HookSpec("sglang.srt.server_args.ServerArgs.from_cli_args", "around", around_from_cli_args, "flags",
             "carry the validated MemxConfig into every SGLang process"),
)  # fmt: skip
