"""Architecture rules, read from the source with ``ast``:

* ``memory_ext`` never imports sglang (or sglang_memx);
* no import cycle anywhere in memx's own packages (``sglang_memx``, ``memory_ext``,
  ``benchmark``), counting imports inside functions and ``if TYPE_CHECKING:`` blocks;
* the engine-agnostic activation balloon lives in ``memory_ext``.
"""

from __future__ import annotations

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


def test_the_activation_balloon_is_engine_agnostic():
    from memory_ext.pool.activation_balloon import ActivationBalloon

    assert ActivationBalloon.__module__.startswith("memory_ext.")
