"""Upstream subsystem: server arguments (``sglang.srt.server_args``).

* ``ServerArgs.add_cli_args`` (after): adds the ``--memx-*`` group and makes the
  parser reject bad memx values the argparse way (exit 2, flag named).
* ``ServerArgs.from_cli_args`` (around): builds the validated ``MemxConfig`` and
  attaches it to the ServerArgs record as ``_memx_config`` (a plain dict), which
  upstream pickles into every process it starts.
"""

from __future__ import annotations

import argparse
import logging

from sglang_memx.config import MemxConfig, MemxConfigError, add_memx_arguments
from sglang_memx.hooks import HookSpec
from sglang_memx.runtime import attach_config, log_startup_line

logger = logging.getLogger("sglang_memx")


def _validating_parse_args(parser: argparse.ArgumentParser):
    original = parser.parse_args

    def parse_args(args=None, namespace=None):
        ns = original(args, namespace)
        try:
            MemxConfig.from_namespace(ns).check_server_args(bool(getattr(ns, "disable_radix_cache", False)))
        except MemxConfigError as exc:
            parser.error(str(exc))  # prints usage + message, exits with status 2
        return ns

    parse_args.memx_validating = True
    return parse_args


def after_add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    add_memx_arguments(parser)
    if not getattr(parser.parse_args, "memx_validating", False):
        parser.parse_args = _validating_parse_args(parser)
    return result


def around_from_cli_args(original, cls, args: argparse.Namespace, *rest, **kwargs):
    server_args = original(cls, args, *rest, **kwargs)
    config = MemxConfig.from_namespace(args)
    attach_config(server_args, config)
    log_startup_line(config)
    return server_args


HOOKS = (
    HookSpec(
        "sglang.srt.server_args.ServerArgs.add_cli_args",
        "after",
        after_add_cli_args,
        expects=("parser",),
        why="add and validate the --memx-* flags",
    ),
    HookSpec(
        "sglang.srt.server_args.ServerArgs.from_cli_args",
        "around",
        around_from_cli_args,
        expects=("cls", "args"),
        why="carry the validated MemxConfig into every SGLang process",
    ),
)
