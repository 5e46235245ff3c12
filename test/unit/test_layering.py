"""Architecture rules, read from the source with ``ast``:

* ``memory_ext`` never imports sglang (or sglang_memx);
* no import cycle anywhere in memx's own packages (``sglang_memx``, ``memory_ext``,
  ``benchmark``), counting imports inside functions and ``if TYPE_CHECKING:`` blocks;
* the engine-agnostic activation balloon lives in ``memory_ext``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import memory_ext
import sglang_memx

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("sglang", "sglang_memx", "sgl_kernel")
ROOTS = {
    "sglang_memx": Path(sglang_memx.__file__).parent,
    "memory_ext": Path(memory_ext.__file__).parent,
    "benchmark": REPO / "benchmark",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts or "results" in path.parts:
                continue
            rel = path.relative_to(root).with_suffix("")
            parts = [package, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``module`` imports, at any depth of its source."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names = [f"{stem}.{a.name}" for a in node.names] + [stem]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {m: _imports(m, p, known) for m, p in modules.items()}
    # a package's __init__ importing its own submodules is how packages expose names, not a cycle
    # of logic: drop edges from a package to its children, keep everything else
    return {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}


def test_memory_ext_imports_no_engine_code():
    root = ROOTS["memory_ext"]
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert list(root.rglob("*.py")), "memory_ext has no modules to check"
    assert offenders == []


def test_no_import_cycles_in_memx_packages():
    graph = import_graph()
    assert len(graph) > 50, "the scan found too few modules"
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_activation_balloon_is_engine_agnostic():
    from memory_ext.pool.activation_balloon import ActivationBalloon

    assert ActivationBalloon.__module__.startswith("memory_ext.")
