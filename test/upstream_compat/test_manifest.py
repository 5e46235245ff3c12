"""The upstream adapter's manifest against the installed SGLang, and memx's code against the manifest.

* every declared class, function, constant and hook target resolves; every member exists on
  its class; every callable takes the leading parameters memx passes;
* every hook function accepts the full call shape of its target;
* the adapter modules read, on upstream objects (the manifest's ROLES), only declared members;
* no memx module outside ``sglang_memx.upstream`` imports sglang, and nothing in memx reads a
  declared upstream member with ``getattr(..., default)`` (a rename must fail, not fall back).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import sglang_memx
from sglang_memx.hooks import HOOK_MODULES, all_hook_specs
from sglang_memx.upstream import manifest
from support.imports import absolute_imports

PACKAGE = Path(sglang_memx.__file__).parent
ADAPTER = PACKAGE / "upstream"
ADAPTER_BOOKKEEPING = {"manifest.py", "registry.py", "version.py", "__init__.py"}
SPECS = all_hook_specs()


def _class(short: str):
    return pkgutil.resolve_name(manifest.CLASSES[short])


def _targets(node):
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _assigned_in_source(cls, name: str) -> bool:
    """``self.<name> = ...`` (plain, annotated, augmented or tuple-unpacked) in the class or its bases."""
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in _targets(target)]
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            if any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in targets):  # fmt: skip
                return True
    return False


def _has_member(cls, name: str) -> bool:
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__struct_fields__", ()):  # msgspec structs
        return True
    if any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__):
        return True
    return _assigned_in_source(cls, name)


# ------------------------------------------------------------------ the manifest resolves
def test_plugin_is_registered_as_entry_point():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("memx") == "sglang_memx.plugin:load"


@pytest.mark.parametrize("short", sorted(manifest.CLASSES))
def test_declared_class_resolves(short):
    assert inspect.isclass(_class(short)), manifest.CLASSES[short]


@pytest.mark.parametrize(
    "short,member", [(c, m) for c, members in sorted(manifest.MEMBERS.items()) for m in sorted(members)]
)
def test_declared_member_exists(short, member):
    cls = _class(short)
    assert _has_member(cls, member), f"{manifest.CLASSES[short]}.{member} is gone"
    value_class = manifest.MEMBERS[short][member]
    assert value_class is None or value_class in manifest.CLASSES


@pytest.mark.parametrize("path", sorted(manifest.PARAMS))
def test_declared_callable_takes_the_leading_parameters(path):
    if path in manifest.OBJECTS:
        fn = pkgutil.resolve_name(path)
    else:
        short, method = path.split(".")
        fn = vars(_class(short)).get(method) or getattr(_class(short), method)
        fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    params = list(inspect.signature(inspect.unwrap(fn)).parameters)
    expected = list(manifest.PARAMS[path])
    assert params[: len(expected)] == expected, f"{path} takes {params}, memx passes {expected}"


@pytest.mark.parametrize("path", sorted(manifest.OBJECTS))
def test_declared_object_resolves(path):
    obj = pkgutil.resolve_name(path)
    kind = manifest.OBJECTS[path]
    assert {"function": callable(obj), "constant": isinstance(obj, (int, float, str)), "object": True}[kind]


def test_undeclared_names_are_refused():
    with pytest.raises(LookupError, match="not declared"):
        manifest.resolve("sglang.srt.managers.scheduler.Scheduler.process_input_requests")


# ------------------------------------------------------------------ hook targets
def test_one_hook_module_per_subsystem_and_each_declares_hooks():
    assert len(set(HOOK_MODULES)) == len(HOOK_MODULES)
    for name in HOOK_MODULES:
        mod = importlib.import_module(name)
        assert mod.HOOKS, f"{name} declares no hooks"
        assert mod.__doc__ and "Upstream subsystem" in mod.__doc__


def test_every_target_is_hooked_once_and_every_declared_target_is_used():
    targets = [s.target for s in SPECS]
    assert len(targets) == len(set(targets))
    assert set(targets) == set(manifest.TARGETS)


def _raw_target(target: str):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = vars(owner).get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    return inspect.unwrap(getattr(owner, attr))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.target)
def test_target_exists_with_expected_parameters(spec):
    fn = _raw_target(spec.target)
    params = list(inspect.signature(fn).parameters)
    assert params[: len(spec.expects)] == list(spec.expects), (
        f"{spec.target} now takes {params}, hook expects leading {spec.expects}"
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.target)
def test_hook_function_accepts_the_targets_call_shape(spec):
    """HookRegistry calls fn([result | original,] *target_args, **target_kwargs): every parameter of
    the target, passed the way a caller may pass it, must bind to the hook."""
    leading = {"before": 0, "after": 1, "around": 1, "replace": 0}[spec.kind]
    hook = inspect.signature(spec.fn)
    positional, keywords = [None] * leading, {}
    for p in inspect.signature(_raw_target(spec.target)).parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(None)
        elif p.kind is p.KEYWORD_ONLY:
            keywords[p.name] = None
    hook.bind(*positional, **keywords)


# ------------------------------------------------------------------ memx's code against the manifest
def _py_files(root: Path):
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_outside_the_adapter_imports_sglang():
    offenders = [f"{path.relative_to(PACKAGE)}: {n}" for path in _py_files(PACKAGE) if ADAPTER not in path.parents
                 for n in absolute_imports(path) if n.split(".")[0] == "sglang"]  # fmt: skip
    assert offenders == []


def _declared_members() -> set[str]:
    return {m for members in manifest.MEMBERS.values() for m in members}


def test_no_getattr_with_a_default_on_an_upstream_name():
    declared = _declared_members()
    offenders = []
    for path in _py_files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in declared):  # fmt: skip
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} getattr(..., {node.args[1].value!r}, ...)")
    assert offenders == []


class _ReadChecker(ast.NodeVisitor):
    """Attribute reads on upstream objects (names in ROLES, chained through member types)."""

    def __init__(self, own_names: set[str]):
        self.undeclared: list[str] = []
        self.own = own_names
        self.self_role: str | None = None

    def role_of(self, node) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "self":
                return self.self_role
            return manifest.ROLES.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = self.role_of(node.value)
            return manifest.MEMBERS.get(owner, {}).get(node.attr) if owner else None
        if isinstance(node, ast.Call):
            return self.role_of(node.func)
        if isinstance(node, ast.Call) is False and isinstance(node, ast.Subscript):
            return None
        return None

    def visit_ClassDef(self, node):
        base = [b for b in node.bases if isinstance(b, ast.Name)]
        previous = self.self_role
        if base:  # memx's subclasses of upstream classes: ``self`` is the base's role
            self.self_role = manifest.ROLES.get(base[0].id)
        self.generic_visit(node)
        self.self_role = previous

    def visit_Attribute(self, node):
        owner = self.role_of(node.value)
        if owner is not None and node.attr not in manifest.MEMBERS.get(owner, {}) and node.attr not in self.own:
            self.undeclared.append(f"{owner}.{node.attr} (line {node.lineno})")
        self.generic_visit(node)


@pytest.mark.parametrize("path", [p for p in _py_files(ADAPTER) if p.name not in ADAPTER_BOOKKEEPING],
                         ids=lambda p: p.name)  # fmt: skip
def test_adapter_reads_only_declared_members(path):
    tree = ast.parse(path.read_text())
    own = set()
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                own |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    checker = _ReadChecker(own)
    checker.visit(tree)
    assert checker.undeclared == [], f"{path.name} reads undeclared upstream members: {checker.undeclared}"


def test_the_read_checker_catches_an_undeclared_read():
    checker = _ReadChecker(set())
    checker.visit(ast.parse("def f(scheduler, req):\n    return scheduler.waiting_queue, req.not_a_field\n"))
    assert checker.undeclared == ["Req.not_a_field (line 2)"]


# ------------------------------------------------------------------ what memx's seams rely on
def test_the_physical_budget_relies_on_upstreams_budget_arithmetic():
    """``upstream.scheduler.physical_budget_class`` overrides ``remaining_total`` and ``reserve``:
    upstream's check must compare against ``remaining_total`` and ``reserve`` must add the
    decode tokens to the total offset only."""
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    source = inspect.getsource(PrefillBudget)
    for line in ("total_tokens < self.remaining_total", "self.total_offset += immediate + max_new_tokens",
                 "self.current_offset += immediate"):  # fmt: skip
        assert line in source, line
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    assert "PrefillBudget(" in inspect.getsource(BaseTokenToKVPoolAllocator.create_prefill_budget)


def test_server_args_record_carries_private_attributes_through_pickle():
    import pickle

    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy")
    args._memx_config = {"status_path": "/memx/status", "disabled": False}
    clone = pickle.loads(pickle.dumps(args))
    assert clone._memx_config == args._memx_config
