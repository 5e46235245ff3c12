"""Architecture rules, read from the source with ``ast``:

* ``memory_ext`` never imports sglang (or sglang_memx);
* no import cycle anywhere in memx's own packages (``sglang_memx``, ``memory_ext``,
  ``benchmark``), counting imports inside functions and ``if TYPE_CHECKING:`` blocks;
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
