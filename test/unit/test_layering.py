"""Architecture rule: memory_ext never imports sglang (or sglang_memx)."""

import ast
from pathlib import Path

import memory_ext

FORBIDDEN = ("sglang", "sglang_memx", "sgl_kernel")


def test_memory_ext_imports_no_engine_code():
    root = Path(memory_ext.__file__).parent
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
