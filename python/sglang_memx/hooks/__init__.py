"""Hooks into upstream SGLang, one module per upstream subsystem.

Each hook module exposes ``HOOKS``: a tuple of ``HookSpec`` naming the dotted
upstream target, the hook kind, the hook function and the leading parameter
names the hook relies on. ``test/upstream_compat`` resolves every target in
the pinned upstream and checks those parameters, so a pin bump that moves or
reshapes a target fails there, not at serving time.

Invariant: hook functions import sglang lazily (inside the function) or only
from modules that upstream has already imported when the hook runs.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

HOOK_MODULES = (
    "sglang_memx.hooks.server_args",
    "sglang_memx.hooks.scheduler",
    "sglang_memx.hooks.kv_cache",
    "sglang_memx.hooks.model_runner",
    "sglang_memx.hooks.http",
)


@dataclasses.dataclass(frozen=True)
class HookSpec:
    target: str  # dotted path in upstream, e.g. "sglang.srt.server_args.ServerArgs.add_cli_args"
    kind: str  # "before" | "after" | "around" | "replace" (HookRegistry's HookType names)
    fn: Callable
    expects: tuple[str, ...] = ()  # leading parameter names of the target the hook relies on
    why: str = ""

    def __post_init__(self):
        if self.kind not in ("before", "after", "around", "replace"):
            raise ValueError(f"kind: unknown hook kind {self.kind!r} for {self.target}")


def all_hook_specs() -> list[HookSpec]:
    specs: list[HookSpec] = []
    for name in HOOK_MODULES:
        specs.extend(importlib.import_module(name).HOOKS)
    return specs


def register_all(specs: list[HookSpec] | None = None) -> int:
    """Register ``specs`` (default: all) with upstream's HookRegistry; returns the count."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    specs = all_hook_specs() if specs is None else specs
    for spec in specs:
        HookRegistry.register(spec.target, spec.fn, HookType[spec.kind.upper()])
    return len(specs)
