"""Shared pytest setup: test/ on sys.path (for test/support), GPU skipping, model fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TEST_DIR))

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# no test server imports upstream's model modules for architectures no test builds (a user's value wins)
from support import model_modules  # noqa: E402

os.environ.setdefault(model_modules.ENV, model_modules.disabled_model_modules())


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this host); runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory) -> Path:
    root = os.environ.get("SGLANG_MEMX_TINY_MODELS")
    return Path(root) if root else tmp_path_factory.mktemp("tiny-models")
