"""memx's hooks as data, their registration with upstream's ``HookRegistry``, and the
start-up check that they are in force.

A ``HookSpec`` names an upstream target (a key of ``manifest.TARGETS``), the hook kind,
the hook function, the memx feature that needs it and why. ``register`` hands every
spec to upstream's registry (upstream applies them once all plugins have loaded).
``verify(feature_names)`` then checks, in the process that serves, that every hook a
feature on needs really wraps its target: upstream logs and skips a hook it cannot
apply, and a feature whose hook is missing must not run half-hooked.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable

from sglang_memx.upstream import manifest

KINDS = ("before", "after", "around", "replace")
# Features a hook can serve; "flags" hooks are needed whatever is on.
FEATURES = ("flags", "status_endpoint", "elastic_kv", "shared_pool", "host_buffer", "weights", "peer_kv")


class HooksNotInForce(RuntimeError):
    """A feature is on but a hook it needs does not wrap its upstream target."""


@dataclasses.dataclass(frozen=True)
class HookSpec:
    target: str  # key of manifest.TARGETS, e.g. "sglang.srt.server_args.ServerArgs.add_cli_args"
    kind: str  # "before" | "after" | "around" | "replace" (HookRegistry's HookType names)
    fn: Callable
    feature: str
    why: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: unknown hook kind {self.kind!r} for {self.target}")
        if self.feature not in FEATURES:
            raise ValueError(f"feature: unknown feature {self.feature!r} for {self.target}")
        if self.target not in manifest.TARGETS:
            raise ValueError(f"target: {self.target} is not declared in sglang_memx.upstream.manifest.TARGETS")
        if not self.why:
            raise ValueError(f"why: say why {self.target} is hooked")

    @property
    def expects(self) -> tuple[str, ...]:
        """Leading parameters of the target the hook relies on (from the manifest)."""
        return manifest.TARGETS[self.target]

    @property
    def private(self) -> bool:
        return manifest.is_private(self.target)


def register(specs: Iterable[HookSpec]) -> int:
    """Register ``specs`` with upstream's HookRegistry; returns the count."""
    registry = manifest.resolve("sglang.srt.plugins.hook_registry.HookRegistry")
    hook_type = manifest.resolve("sglang.srt.plugins.hook_registry.HookType")
    n = 0
    for spec in specs:
        registry.register(spec.target, spec.fn, hook_type[spec.kind.upper()])
        n += 1
    return n


def _wrapper_chain(obj) -> Iterable:
    seen = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        yield obj
        obj = inspect.getattr_static(obj, "__wrapped__", None) if callable(obj) else None


def in_force(spec: HookSpec) -> bool:
    """Whether ``spec.fn`` is captured by one of the wrappers now standing at ``spec.target``."""
    target = manifest.resolve_member(spec.target)
    for wrapper in _wrapper_chain(target):
        for cell in getattr(wrapper, "__closure__", None) or ():
            try:
                if cell.cell_contents is spec.fn:
                    return True
            except ValueError:  # an empty cell
                continue
    return False


def report(specs: Iterable[HookSpec], features_on: Iterable[str]) -> list[dict]:
    """One row per hook of a feature that is on: target, kind, feature, private, in force."""
    on = set(features_on) | {"flags"}
    return [
        {
            "target": s.target,
            "kind": s.kind,
            "feature": s.feature,
            "private": s.private,
            "in_force": in_force(s),
            "why": s.why,
        }
        for s in specs
        if s.feature in on
    ]


def verify(specs: Iterable[HookSpec], features_on: Iterable[str]) -> list[dict]:
    """``report`` for the features on; raise ``HooksNotInForce`` naming every missing hook."""
    rows = report(specs, features_on)
    missing = [f"{r['target']} ({r['kind']}, for {r['feature']})" for r in rows if not r["in_force"]]
    if missing:
        raise HooksNotInForce(
            "memx hooks not in force in this process: " + "; ".join(missing) + ". Upstream SGLang could not "
            "apply them (see its log: 'Failed to apply hooks'); run without the features that need them"
        )
    return rows
