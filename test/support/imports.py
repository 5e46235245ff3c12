"""The import graph of a package tree, read from its source with ``ast`` (used by the layering tests).

Every ``import`` / ``from ... import`` counts, at any depth (inside functions, under
``if TYPE_CHECKING:``), relative imports resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (the directory of ``package``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return files[name].name == "__init__.py"


def _target(name: str, files: dict[str, Path]) -> str | None:
    """The known module ``name`` refers to: itself, or its longest known prefix."""
    while name:
        if name in files:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Edges module -> modules it imports, from every ``import`` / ``from ... import``
    anywhere in its source (any depth, TYPE_CHECKING blocks included), relative
    imports resolved. ``from pkg import name`` points at ``pkg.name`` when that is
    a module, else at ``pkg``. Modules outside ``files`` are ignored."""
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges = set()
        pkg = mod if _is_package(mod, files) else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    t = _target(alias.name, files)
                    if t:
                        edges.add(t)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = pkg.split(".")
                    if node.level - 1 >= len(base_parts):
                        raise AssertionError(f"{path}: relative import beyond the top package")
                    base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    t = full if full in files else _target(base, files)
                    if t:
                        edges.add(t)
        edges.discard(mod)  # names imported from itself are no cycle
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative DFS, deterministic order)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        color[start] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
                continue
            if color.get(nxt, BLACK) == GREY:
                return path[path.index(nxt) :] + [nxt]
            if color.get(nxt) == WHITE:
                color[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def absolute_imports(path: Path) -> list[str]:
    """Every absolute module name ``path`` imports (``import x.y`` -> ``x.y``; ``from x import y`` -> ``x``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names
