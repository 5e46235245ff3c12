"""Every name installed upstream SGLang imports from ``sgl_kernel`` must exist in
the portable package, and importing it must not switch on upstream's AMX path.

The scan reads upstream's source with ``ast`` (nothing of it is imported except
the package location), so it follows whatever sglang version is installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest
import torch

PACKAGE = "sgl_kernel"


def _is_ours(module: str) -> bool:
    # sgl_kernel_npu (Ascend) is a different package that merely shares the prefix.
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def scan_sgl_kernel_uses(root: Path) -> dict[str, set[str]]:
    """Map module -> names used from it, over every ``.py`` under ``root``.

    Collected: ``from sgl_kernel[.x] import y`` (y under module ``sgl_kernel[.x]``),
    ``import sgl_kernel.x`` (x under ``sgl_kernel``) and ``sgl_kernel.y`` attribute
    reads (y under ``sgl_kernel``). Relative imports are never ours.
    """
    uses: dict[str, set[str]] = defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if PACKAGE not in text:
            continue
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module and _is_ours(node.module):
                    for alias in node.names:
                        if alias.name != "*":
                            uses[node.module].add(alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_ours(alias.name) and alias.name != PACKAGE:
                        parent, _, child = alias.name.rpartition(".")
                        uses[parent].add(child)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == PACKAGE:
                uses[PACKAGE].add(node.attr)
    return dict(uses)


def _sglang_root() -> Path:
    """Directory of the installed sglang package, found without importing it
    (importing sglang takes tens of seconds)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("upstream sglang is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def upstream_uses() -> dict[str, set[str]]:
    root = _sglang_root()
    uses = scan_sgl_kernel_uses(root)
    # Guard against a scan that silently finds nothing (wrong root, changed syntax).
    assert sum(len(v) for v in uses.values()) > 50, uses
    return uses


def test_scan_sees_known_imports(upstream_uses):
    assert "rmsnorm" in upstream_uses[PACKAGE]
    assert "transfer_kv_per_layer" in upstream_uses[f"{PACKAGE}.kvcacheio"]
    assert "is_arch_support_pdl" in upstream_uses[f"{PACKAGE}.utils"]


def test_every_upstream_name_exists(upstream_uses):
    missing = []
    for module_name, names in sorted(upstream_uses.items()):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} (module: {exc})")
            continue
        for name in sorted(names):
            if not hasattr(module, name):
                missing.append(f"{module_name}.{name}")
    assert not missing, "names upstream imports but sgl_kernel lacks:\n" + "\n".join(missing)


def test_upstream_from_imports_execute(upstream_uses):
    """Run the actual import statements (not just hasattr) for every module."""
    for module_name, names in sorted(upstream_uses.items()):
        namespace: dict = {}
        exec(f"from {module_name} import {', '.join(sorted(names))}", namespace)
        assert all(name in namespace for name in names)


def test_no_torch_ops_registered():
    import sgl_kernel  # noqa: F401

    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_upstream_amx_probe_still_keys_on_convert_weight_packed():
    """The check above is only meaningful while upstream's AMX probe looks for
    that op; read the probe's source to make sure it still does."""
    source = (_sglang_root() / "srt" / "utils" / "common.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    probes = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "_is_intel_amx_backend_available"
    ]
    assert probes, "upstream's AMX probe moved; re-check how it detects sgl_kernel ops"
    assert "convert_weight_packed" in ast.unparse(probes[0])
