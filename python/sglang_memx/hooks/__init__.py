"""Hooks into upstream SGLang, one module per upstream subsystem.

Each hook module exposes ``HOOKS``: a tuple of ``upstream.registry.HookSpec`` naming
the upstream target (declared in ``upstream.manifest.TARGETS`` with the leading
parameters the hook relies on), the hook kind, the hook function, the memx feature
that needs it and why. A hook is a few lines that call into memx's own modules.
``test/upstream_compat`` resolves every target in the installed SGLang and checks
its parameters; at start-up ``upstream.registry.verify`` checks that the hooks of
every feature on are in force.

Invariant: hook modules import sglang only through ``sglang_memx.upstream``.
"""

from __future__ import annotations

import importlib

from sglang_memx.upstream.registry import HookSpec, register

HOOK_MODULES = (
    "sglang_memx.hooks.server_args",
    "sglang_memx.hooks.http",
    "sglang_memx.hooks.scheduler",
    "sglang_memx.hooks.kv_cache",
    "sglang_memx.hooks.model_runner",
    "sglang_memx.hooks.peer_kv",
    "sglang_memx.hooks.layer_stream",
)

__all__ = ["HOOK_MODULES", "HookSpec", "all_hook_specs", "hook_table", "hooks_status", "register_all", "verify_hooks"]


def all_hook_specs() -> list[HookSpec]:
    specs: list[HookSpec] = []
    for name in HOOK_MODULES:
        specs.extend(importlib.import_module(name).HOOKS)
    return specs


def register_all(specs: list[HookSpec] | None = None) -> int:
    """Register ``specs`` (default: all) with upstream's HookRegistry; returns the count."""
    return register(all_hook_specs() if specs is None else specs)


def hooks_status(config) -> list[dict]:
    """The hooks of the features on, and whether each is in force in this process (/memx/status)."""
    from sglang_memx.upstream.registry import report

    return report(all_hook_specs(), [name for name, on in config.features.items() if on])


_verified: dict[tuple, list[dict]] = {}


def verify_hooks(config) -> list[dict]:
    """Check (once per process and feature set) that every hook of the features on is in force;
    raises ``upstream.registry.HooksNotInForce`` naming the missing ones. Returns the report."""
    from sglang_memx.upstream.registry import verify

    on = tuple(sorted(name for name, enabled in config.features.items() if enabled))
    if on not in _verified:
        _verified[on] = verify(all_hook_specs(), on)
    return _verified[on]


def hook_table() -> str:
    """The hooks as a Markdown table (``sglang-memx hooks``; ``docs/hooks.md`` holds its output)."""
    specs = all_hook_specs()
    rows = ["| upstream target | kind | feature | private | why |", "|---|---|---|---|---|"]
    for s in specs:
        target = s.target.removeprefix("sglang.srt.")
        rows.append(f"| `{target}` | {s.kind} | {s.feature} | {'yes' if s.private else ''} | {s.why} |")
    private = sum(s.private for s in specs)
    rows.append("")
    rows.append(f"{len(specs)} hooks on {len({s.target for s in specs})} upstream targets, {private} of them private.")
    return "\n".join(rows)
