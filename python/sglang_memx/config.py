"""The ``--memx-*`` flags: declaration, parsing and validation.

``MEMX_FLAGS`` is the single table of flags. ``add_memx_arguments`` puts them
in an argparse group; ``MemxConfig.from_namespace`` builds the validated
config, raising ``MemxConfigError`` that names the offending flag.

Invariant: a ``MemxConfig`` that exists has passed ``validate()``; it is a
plain, picklable value (it rides on ServerArgs into every SGLang process).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

GROUP_TITLE = "sglang-memx (integrated memory subsystem)"

# Upstream routes that a memx endpoint must never shadow.
RESERVED_HTTP_PATHS = frozenset({
    "/", "/health", "/health_generate", "/generate", "/encode", "/metrics",
    "/server_info", "/get_server_info", "/model_info", "/get_model_info",
    "/flush_cache", "/v1/models", "/v1/chat/completions", "/v1/completions",
    "/v1/embeddings", "/docs", "/openapi.json",
})


class MemxConfigError(ValueError):
    """A memx flag has a bad or contradictory value. ``flag`` names it."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


@dataclasses.dataclass(frozen=True)
class MemxFlag:
    """One ``--memx-*`` flag. ``dest`` is the MemxConfig field it fills."""

    option: str
    dest: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    action: str | None = None
    metavar: str | None = None

    def add_to(self, group) -> None:
        kwargs: dict[str, Any] = {"dest": f"memx_{self.dest}", "default": self.default,
                                  "help": self.help}
        if self.action:
            kwargs["action"] = self.action
        else:
            kwargs["type"] = self.type
            kwargs["metavar"] = self.metavar
        group.add_argument(self.option, **kwargs)


MEMX_FLAGS: tuple[MemxFlag, ...] = (
    MemxFlag(
        "--memx-disable", "disabled", action="store_true", default=False,
        help="Load the plugin but leave every memx behaviour off (stock SGLang "
             "behaviour; the status endpoint is not served). Contradicts any "
             "other --memx-* flag.",
    ),
    MemxFlag(
        "--memx-status-path", "status_path", type=str, default="/memx/status",
        metavar="PATH",
        help="HTTP path of the JSON status endpoint (default: /memx/status).",
    ),
)


@dataclasses.dataclass(frozen=True)
class MemxConfig:
    disabled: bool = False
    status_path: str = "/memx/status"

    def validate(self) -> "MemxConfig":
        path = self.status_path
        if not isinstance(path, str) or not path.startswith("/") or len(path) < 2:
            raise MemxConfigError("--memx-status-path",
                                  f"must be an absolute URL path like /memx/status, got {path!r}")
        if any(c.isspace() or c in "?#{}" for c in path):
            raise MemxConfigError("--memx-status-path",
                                  f"must not contain spaces, '?', '#' or braces, got {path!r}")
        if path.rstrip("/") in RESERVED_HTTP_PATHS or path in RESERVED_HTTP_PATHS:
            raise MemxConfigError("--memx-status-path",
                                  f"{path!r} is an upstream SGLang route; choose another path")
        if self.disabled:
            for flag in MEMX_FLAGS:
                if flag.dest != "disabled" and getattr(self, flag.dest) != flag.default:
                    raise MemxConfigError(
                        "--memx-disable", f"contradicts {flag.option}; drop one of the two")
        return self

    @property
    def features(self) -> dict[str, bool]:
        """Which memx features are on in this process (names are stable API)."""
        on = not self.disabled
        return {"status_endpoint": on}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MemxConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise MemxConfigError(f"--memx-{unknown[0].replace('_', '-')}", "unknown memx setting")
        return cls(**data).validate()

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "MemxConfig":
        values = {flag.dest: getattr(ns, f"memx_{flag.dest}", flag.default) for flag in MEMX_FLAGS}
        return cls(**values).validate()


def add_memx_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the memx group to ``parser`` (idempotent)."""
    if any(getattr(g, "title", None) == GROUP_TITLE for g in parser._action_groups):
        return
    group = parser.add_argument_group(GROUP_TITLE)
    for flag in MEMX_FLAGS:
        flag.add_to(group)
