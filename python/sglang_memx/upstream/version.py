"""Which SGLang releases memx supports: one constant, checked at start-up.

``SUPPORTED_SGLANG`` is the only place the supported range is written; the
package metadata (``pyproject.toml``), the lock input (``requirements/cpu.in``),
the lock, the Docker images and the docs are checked against it by
``test/upstream_compat/test_version_gate.py``. A server started with a memx
feature on an SGLang outside the range stops with an error naming both
versions; with no feature on, memx stays out of the way and says so.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"
TESTED_SGLANG = "0.5.23"  # the release the lock pins and CI runs


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is outside ``SUPPORTED_SGLANG``."""


def installed_sglang() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def is_supported(installed: str) -> bool:
    try:
        return Version(installed) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        return False


def unsupported_message(installed: str, what: str) -> str:
    return (
        f"{what} needs SGLang {SUPPORTED_SGLANG} (tested: {TESTED_SGLANG}), but sglang {installed} is "
        f"installed; install sglang=={TESTED_SGLANG} or run without memx features (--memx-disable)"
    )


def require_supported(what: str, installed: str | None = None) -> None:
    """Raise ``UnsupportedSGLang`` naming both versions unless the installed SGLang is supported."""
    installed = installed_sglang() if installed is None else installed
    if not is_supported(installed):
        raise UnsupportedSGLang(unsupported_message(installed, what))
