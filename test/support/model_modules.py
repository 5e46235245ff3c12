"""Which of upstream's model modules the test servers need: the rest go into upstream's
``SGLANG_DISABLED_MODEL_ARCHS`` so that no server imports ~250 model modules it never runs (about 2
CPU-s of the one process of a server that loads upstream's model registry, measured with
``PYTHONPROFILEIMPORTTIME``).

Kept: every module that defines a class named in an architecture the tests build (the tiny models,
the tiny families, the embedded model). A test model whose architecture is missing here fails at
start with upstream's "architecture not supported" error, never silently.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sglang_memx.models.tiny import ARCHITECTURES as TINY
from sglang_memx.models.tiny_families import ARCHITECTURES as FAMILIES

ENV = "SGLANG_DISABLED_MODEL_ARCHS"
EMBEDDED = ("LlamaForCausalLM",)  # test_embedded_model_prepare.py checks the converted config says so
KEEP = (*TINY.values(), *FAMILIES.values(), *EMBEDDED)


def _models_dir() -> Path | None:
    spec = importlib.util.find_spec("sglang")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return path if path.is_dir() else None


def disabled_model_modules(keep_archs=KEEP) -> str:
    """Comma-separated module names (upstream's format) of the model modules defining none of
    ``keep_archs``; empty when upstream's models directory is not found."""
    root = _models_dir()
    if root is None:
        return ""
    wanted = tuple(f"class {arch}(" for arch in keep_archs)
    off = []
    for path in sorted(root.glob("*.py")):
        if path.stem == "__init__":
            continue
        text = path.read_text(errors="replace")
        if not any(w in text for w in wanted):
            off.append(path.stem)
    return ",".join(off)
