"""The KV state is typed and carries no optional mechanisms (issue 25), read from the source with ``ast``:

* every parameter named ``kv`` in ``sglang_memx`` is annotated (``ElasticKV``, or the engine-free
  ``KVSpace`` where only its geometry is read);
* nothing outside the coordinator reads a mechanism off the KV state (``kv.lent``, ``kv.host``):
  the coordinator hands out the typed part (``Coordinator.shared_pool``, ``host_buffer``,
  ``activation_side``), and ``ElasticKV`` has no such attribute;
* no module of ``sglang_memx`` or ``memory_ext`` is over 500 lines and no function over 120
  (``EXCEPTIONS`` names any that may be, with the reason).
"""

from __future__ import annotations

import ast
from pathlib import Path

import memory_ext
import sglang_memx

ROOT = Path(sglang_memx.__file__).parent
SHORT_ROOTS = {"sglang_memx": ROOT, "memory_ext": Path(memory_ext.__file__).parent}  # held to the size limits
MECHANISMS = ("lent", "host", "weights", "layer_stream")  # once attached to the KV state after construction
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 120
EXCEPTIONS: dict[str, str] = {}  # "package/path" or "package/path:function" -> why it may be longer


def _sources(root=ROOT):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(root).as_posix(), path.read_text()


def _short_sources():
    """Every module held to the size limits, as ``("package/path", text)``."""
    for package, root in SHORT_ROOTS.items():
        for rel, text in _sources(root):
            yield f"{package}/{rel}", text


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_every_kv_parameter_is_typed():
    untyped = [
        f"{rel}:{fn.lineno} {fn.name}"
        for rel, text in _sources()
        for fn in _functions(ast.parse(text))
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        if arg.arg == "kv" and arg.annotation is None
    ]
    assert untyped == []


def test_nothing_outside_the_coordinator_reads_a_mechanism_off_the_kv_state():
    reads = [
        f"{rel}:{node.lineno} kv.{node.attr}"
        for rel, text in _sources()
        if not rel.startswith("coordinator/")
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Attribute) and node.attr in MECHANISMS
        and isinstance(node.value, ast.Name) and node.value.id == "kv"
    ]  # fmt: skip
    assert reads == []


def test_elastic_kv_has_no_optional_mechanism_attributes():
    from memory_ext.pool import ChunkPool, LayeredKVBuffers
    from memory_ext.vmm import host_backend
    from sglang_memx.elastic.kv import ElasticKV

    kv = ElasticKV(LayeredKVBuffers(ChunkPool(host_backend(4096), 64), [64] * 4, 257, 1), 1, 256)
    assert [name for name in MECHANISMS if hasattr(kv, name)] == []


def test_modules_and_functions_stay_short():
    long = []
    seen = set()
    for rel, text in _short_sources():
        seen.add(rel.partition("/")[0])
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES and rel not in EXCEPTIONS:
            long.append(f"{rel}: {lines} lines")
        for fn in _functions(ast.parse(text)):
            length = fn.end_lineno - fn.lineno + 1
            if length > MAX_FUNCTION_LINES and f"{rel}:{fn.name}" not in EXCEPTIONS:
                long.append(f"{rel}:{fn.lineno} {fn.name}: {length} lines")
    assert seen == set(SHORT_ROOTS), "the scan missed a package"
    assert long == []
