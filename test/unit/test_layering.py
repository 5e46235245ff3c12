"""Architecture rules, read from the source with ``ast``:

* ``memory_ext`` never imports sglang (or sglang_memx);
* no import cycle anywhere in memx's own packages (``sglang_memx``, ``memory_ext``,
  ``benchmark``), counting imports inside functions and ``if TYPE_CHECKING:`` blocks;
* between the parts of ``sglang_memx`` (its subpackages and top-level modules: ``elastic``,
  ``weights``, ``peer``, ``coordinator``, ``hooks``, ``status``, ...) dependencies go one way:
  no pair imports each other and no cycle runs through several, imports inside functions counted;
* the engine-agnostic activation balloon lives in ``memory_ext``;
* ``memory_ext.pool`` and its arbiter import without torch (the arbiter daemon needs none).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import memory_ext
import sglang_memx
from support.imports import absolute_imports, find_cycle, import_graph, module_files

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("sglang", "sglang_memx", "sgl_kernel")
ROOTS = {
    "sglang_memx": Path(sglang_memx.__file__).parent,
    "memory_ext": Path(memory_ext.__file__).parent,
    "benchmark": REPO / "benchmark",
}


def import_graph_of_memx() -> dict[str, set[str]]:
    files = {}
    for package, root in ROOTS.items():
        files.update({m: p for m, p in module_files(root, package).items() if not m.startswith("benchmark.results")})
    return import_graph(files)


def test_memory_ext_imports_no_engine_code():
    root = ROOTS["memory_ext"]
    offenders = [f"{path.name}: {n}" for path in root.rglob("*.py") for n in absolute_imports(path)
                 if n.split(".")[0] in FORBIDDEN]  # fmt: skip
    assert list(root.rglob("*.py")), "memory_ext has no modules to check"
    assert offenders == []


def test_no_import_cycles_in_memx_packages():
    graph = import_graph_of_memx()
    assert len(graph) > 50, "the scan found too few modules"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def part_of(module: str) -> str:
    """The part of ``sglang_memx`` a module belongs to: ``sglang_memx.elastic.kv`` -> ``elastic``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sglang_memx"


def memx_part_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """Edges part -> parts it imports, and for each edge the module imports behind it."""
    graph = import_graph(module_files(ROOTS["sglang_memx"], "sglang_memx"))
    parts: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for mod, targets in graph.items():
        a = part_of(mod)
        parts.setdefault(a, set())
        for t in targets:
            b = part_of(t)
            if a != b:
                parts[a].add(b)
                why.setdefault((a, b), []).append(f"{mod} -> {t}")
    return parts, why


def test_no_two_way_dependencies_between_memx_parts():
    graph, why = memx_part_graph()
    assert {"elastic", "weights", "peer", "hooks"} <= set(graph), "the scan missed memx's subpackages"
    two_way = [f"{a} <-> {b}: {why[a, b]} / {why[b, a]}" for a in sorted(graph) for b in sorted(graph[a])
               if a < b and a in graph.get(b, ())]  # fmt: skip
    assert two_way == []


def test_no_import_cycles_between_memx_parts():
    graph, _ = memx_part_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"cycle between parts of sglang_memx: {' -> '.join(cycle)}"


def test_the_activation_balloon_is_engine_agnostic():
    from memory_ext.pool.activation_balloon import ActivationBalloon

    assert ActivationBalloon.__module__.startswith("memory_ext.")


NO_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not importable here")
            return None

    sys.meta_path.insert(0, NoTorch())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker did not block")
    import memory_ext.pool
    import memory_ext.pool.arbiter
    import memory_ext.pool.kv_space  # noqa: F401  (the engine-free KV space)
    assert memory_ext.pool.Arbiter is memory_ext.pool.arbiter.Arbiter
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    print("imported without torch")
    """
)


def test_pool_and_arbiter_import_without_torch():
    """The arbiter daemon (``python -m memory_ext.pool.arbiter``) runs where torch may be absent."""
    root = str(Path(memory_ext.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", NO_TORCH], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "imported without torch"
