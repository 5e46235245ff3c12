"""Upstream environment variables that memx (``sglang-memx serve``) and its test servers set: the
module of the pinned release that reads each still names it. A renamed variable would be ignored
silently (a rank on every core, NCCL tried at ``--tp 2``, every model module imported again)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# variable -> the upstream module that reads it
READERS = {
    "SGLANG_CPU_OMP_THREADS_BIND": "sglang.srt.utils.numa_utils",  # serve/tensor_parallel.py, serve/cores.py
    "SGLANG_NCCL_SO_PATH": "sglang.srt.distributed.device_communicators.pynccl_wrapper",  # gloo at --tp > 1
    "SGLANG_USE_CPU_ENGINE": "sglang.srt.platforms",  # the CPU engine (scripts/test.sh, scripts/serve.sh)
    "SGLANG_DISABLED_MODEL_ARCHS": "sglang.srt.models.registry",  # test/support/model_modules.py
}


def _source(module: str) -> str:
    """The module's file text, found without importing it (nor its parent packages)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.submodule_search_locations, top
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


@pytest.mark.parametrize("name,module", sorted(READERS.items()))
def test_upstream_reads_the_variable(name, module):
    assert name in _source(module), f"{module} no longer names {name}"
