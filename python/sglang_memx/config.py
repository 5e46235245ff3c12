"""The ``--memx-*`` flags: declaration, parsing and validation.

``MEMX_FLAGS`` (``flags``) is the single table of flags. ``add_memx_arguments`` puts them
in an argparse group; ``MemxConfig.from_namespace`` builds the validated
config, raising ``MemxConfigError`` that names the offending flag.

Invariant: a ``MemxConfig`` that exists has passed ``validate()``; it is a
plain, picklable value (it rides on ServerArgs into every SGLang process).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from typing import Any

from memory_ext.policy.default_slo import DEFAULT_SCALE, check_scale
from sglang_memx.flags import MEMX_FLAGS

GROUP_TITLE = "sglang-memx (integrated memory subsystem)"

# Upstream routes that a memx endpoint must never shadow.
RESERVED_HTTP_PATHS = frozenset(
    {
        "/",
        "/health",
        "/health_generate",
        "/generate",
        "/encode",
        "/metrics",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/flush_cache",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/docs",
        "/openapi.json",
    }
)


# Set by ``sglang-memx serve`` for its engines: the pid whose exit ends the pool's arbiter
# (``memory_ext.pool.arbiter --owner-pid``), so a killed ``serve`` leaves no pool behind.
POOL_OWNER_ENV = "SGLANG_MEMX_POOL_OWNER_PID"


def pool_owner_pid(environ=os.environ) -> int | None:
    """The pool owner's pid from ``POOL_OWNER_ENV`` (None when unset); a bad value names the variable."""
    raw = environ.get(POOL_OWNER_ENV)
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise MemxConfigError(POOL_OWNER_ENV, f"must be a positive pid, got {raw!r}")
    return int(raw)


# Set by ``sglang-memx serve`` beside the ``--memx-tpot-slo-ms`` it passes from a model's
# ``models.yaml`` entry: where the SLO came from (``models.yaml: models[0].tpot_slo_ms``), shown
# in the governor's status. Unset: the flag was given directly.
TPOT_SLO_SOURCE_ENV = "SGLANG_MEMX_TPOT_SLO_SOURCE"
TPOT_SLO_FLAG = "--memx-tpot-slo-ms"
TPOT_SLO_SCALE_FLAG = "--memx-tpot-slo-scale"  # the governor's default SLO when none is given
# The same for ``--memx-ttft-slo-ms``, which ``serve`` passes from a model's ``ttft_slo_ms`` to an
# engine with a host buffer and a governor (the host buffer's rule needs both SLOs).
TTFT_SLO_SOURCE_ENV = "SGLANG_MEMX_TTFT_SLO_SOURCE"
TTFT_SLO_FLAG = "--memx-ttft-slo-ms"
_MAX_SOURCE_CHARS = 200


class MemxConfigError(ValueError):
    """A memx flag has a bad or contradictory value. ``flag`` names it."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


def _slo_source(environ, env: str, flag: str) -> str:
    raw = environ.get(env)
    if raw is None or raw == "":
        return flag
    if len(raw) > _MAX_SOURCE_CHARS or not raw.isprintable():
        raise MemxConfigError(env, f"must be one printable line of at most {_MAX_SOURCE_CHARS} "
                              f"characters, got {raw[:60]!r}")  # fmt: skip
    return raw


def tpot_slo_source(environ=os.environ) -> str:
    """Where ``--memx-tpot-slo-ms`` came from: ``TPOT_SLO_SOURCE_ENV`` when set, else the flag;
    a value that is not one printable line of at most 200 characters names the variable."""
    return _slo_source(environ, TPOT_SLO_SOURCE_ENV, TPOT_SLO_FLAG)


def ttft_slo_source(environ=os.environ) -> str:
    """Where ``--memx-ttft-slo-ms`` came from: ``TTFT_SLO_SOURCE_ENV`` when set, else the flag (same rules)."""
    return _slo_source(environ, TTFT_SLO_SOURCE_ENV, TTFT_SLO_FLAG)


PEER_KV_MODES = ("off", "donate", "borrow", "both")

WEIGHT_MODES = ("off", "remap", "static")

_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclasses.dataclass(frozen=True)
class MemxConfig:
    disabled: bool = False
    status_path: str = "/memx/status"
    elastic_kv: bool = False
    pool: str | None = None
    pool_budget_gb: float | None = None
    pool_dir: str | None = None
    chunk_kb: int = 64
    torch_activations: bool = False
    host_buffer_gb: float | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    governor: bool = False
    tpot_slo_scale: float = DEFAULT_SCALE
    weights: str = "off"
    weights_streamed: float | None = None
    prefetch_depth: int | None = None
    tbt_slo_ms: float | None = None
    weights_profile: str | None = None
    weights_idle_after_s: float = 30.0
    sleep_after_s: float | None = None
    peer_kv: str = "off"
    peer_donate_max_gb: float | None = None
    peer_layer_stream: bool = False

    @property
    def governed(self) -> bool:
        """Whether the governor runs: ``--memx-governor``, or a TPOT SLO (which adds its batch cap)."""
        return self.governor or self.tpot_slo_ms is not None

    def validate(self) -> MemxConfig:
        path = self.status_path
        if not isinstance(path, str) or not path.startswith("/") or len(path) < 2:
            raise MemxConfigError("--memx-status-path", f"must be an absolute URL path like /memx/status, got {path!r}")
        if any(c.isspace() or c in "?#{}" for c in path):
            raise MemxConfigError("--memx-status-path", f"must not contain spaces, '?', '#' or braces, got {path!r}")
        if path.rstrip("/") == "/memx/metrics":
            raise MemxConfigError(
                "--memx-status-path", "/memx/metrics is the memx Prometheus endpoint; choose another path"
            )
        if path.rstrip("/") in RESERVED_HTTP_PATHS or path in RESERVED_HTTP_PATHS:
            raise MemxConfigError("--memx-status-path", f"{path!r} is an upstream SGLang route; choose another path")
        self._validate_pool()
        self._validate_host_buffer()
        self._validate_weights()
        self._validate_peer_kv()
        if self.disabled:
            for flag in MEMX_FLAGS:
                if flag.dest != "disabled" and getattr(self, flag.dest) != flag.default:
                    raise MemxConfigError("--memx-disable", f"contradicts {flag.option}; drop one of the two")
        return self

    def _validate_pool(self) -> None:
        if self.pool is not None:
            if not isinstance(self.pool, str) or not _POOL_NAME.fullmatch(self.pool):
                raise MemxConfigError(
                    "--memx-pool",
                    "must be 1-64 letters, digits, '_', '.' or '-' "
                    f"(starting with a letter or digit), got {self.pool!r}",
                )
        if self.pool_budget_gb is not None:
            b = self.pool_budget_gb
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
                raise MemxConfigError("--memx-pool-budget-gb", f"must be a positive number of GB, got {b!r}")
        if self.pool_dir is not None and (not isinstance(self.pool_dir, str) or not self.pool_dir.strip()):
            raise MemxConfigError("--memx-pool-dir", f"must be a directory path, got {self.pool_dir!r}")
        c = self.chunk_kb
        if isinstance(c, bool) or not isinstance(c, int) or c < 4 or c & (c - 1):
            raise MemxConfigError("--memx-chunk-kb", f"must be a power of two >= 4, got {c!r}")
        if c > 1 << 20:
            raise MemxConfigError("--memx-chunk-kb", f"must be at most 1048576 (1 GiB), got {c}")
        if not self.elastic_kv:
            for option, value in (
                ("--memx-pool", self.pool),
                ("--memx-pool-budget-gb", self.pool_budget_gb),
                ("--memx-pool-dir", self.pool_dir),
            ):
                if value is not None:
                    raise MemxConfigError(option, "needs --memx-elastic-kv (the pool backs the KV cache)")
            if c != 64:
                raise MemxConfigError("--memx-chunk-kb", "needs --memx-elastic-kv")
            if self.torch_activations:
                raise MemxConfigError("--memx-torch-activations", "needs --memx-elastic-kv")

    def _validate_host_buffer(self) -> None:
        for option, value in (
            ("--memx-host-buffer-gb", self.host_buffer_gb),
            ("--memx-ttft-slo-ms", self.ttft_slo_ms),
            ("--memx-tpot-slo-ms", self.tpot_slo_ms),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            ):
                raise MemxConfigError(option, f"must be a positive number, got {value!r}")
        if self.host_buffer_gb is not None and not self.elastic_kv:
            raise MemxConfigError("--memx-host-buffer-gb", "needs --memx-elastic-kv")
        # the TTFT SLO only sizes the host buffer; the TPOT SLO also drives the governor's batch
        # decision (``coordinator.governor``), which needs only elastic KV's coordinator
        if self.ttft_slo_ms is not None and self.host_buffer_gb is None:
            raise MemxConfigError("--memx-ttft-slo-ms", "needs --memx-host-buffer-gb (the SLOs size the host buffer)")
        if self.tpot_slo_ms is not None and not self.elastic_kv:
            raise MemxConfigError(
                "--memx-tpot-slo-ms", "needs --memx-elastic-kv (the governor runs on its coordinator)"
            )
        if self.governor and not self.elastic_kv:
            raise MemxConfigError("--memx-governor", "needs --memx-elastic-kv (the governor runs on its coordinator)")
        self._validate_slo_scale()
        slos = (self.ttft_slo_ms, self.tpot_slo_ms)
        if self.host_buffer_gb is not None and any(v is not None for v in slos):
            option = "--memx-ttft-slo-ms" if self.ttft_slo_ms is not None else "--memx-tpot-slo-ms"
            if None in slos:
                missing = "--memx-tpot-slo-ms" if self.tpot_slo_ms is None else "--memx-ttft-slo-ms"
                raise MemxConfigError(missing, f"must be given together with {option} (eLLM Alg. 2 uses both)")

    def _validate_slo_scale(self) -> None:
        """``--memx-tpot-slo-scale``: 0 or a number > 1, only for a governor given no TPOT SLO."""
        flag, scale = TPOT_SLO_SCALE_FLAG, self.tpot_slo_scale
        try:
            check_scale(flag, scale)
        except ValueError as err:
            raise MemxConfigError(flag, str(err).removeprefix(flag).strip()) from None
        if scale == DEFAULT_SCALE:
            return
        if self.tpot_slo_ms is not None:
            raise MemxConfigError(flag, "contradicts --memx-tpot-slo-ms (the scale makes the SLO when none is "
                                        "given); give one of the two")  # fmt: skip
        if not self.governor:
            raise MemxConfigError(flag, "needs --memx-governor (it sets the governor's default TPOT SLO)")

    def _validate_weights(self) -> None:
        mode = self.weights
        if mode not in WEIGHT_MODES:
            raise MemxConfigError("--memx-weights", f"must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
        f = self.weights_streamed
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1):
            raise MemxConfigError("--memx-weights-streamed", f"must be a fraction between 0 and 1, got {f!r}")
        d = self.prefetch_depth
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise MemxConfigError("--memx-prefetch-depth", f"must be a positive number of slots, got {d!r}")
        for option, value in (("--memx-tbt-slo-ms", self.tbt_slo_ms),
                              ("--memx-weights-idle-after-s", self.weights_idle_after_s),
                              ("--memx-sleep-after-s", self.sleep_after_s)):  # fmt: skip
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            ):
                raise MemxConfigError(option, f"must be a positive number, got {value!r}")
        if mode == "off":
            for option, value in (("--memx-weights-streamed", f), ("--memx-prefetch-depth", d),
                                  ("--memx-tbt-slo-ms", self.tbt_slo_ms),
                                  ("--memx-weights-profile", self.weights_profile)):  # fmt: skip
                if value is not None:
                    raise MemxConfigError(option, "needs --memx-weights remap or static")
            if self.weights_idle_after_s != 30.0:
                raise MemxConfigError("--memx-weights-idle-after-s", "needs --memx-weights remap")
            if self.sleep_after_s is not None:
                raise MemxConfigError("--memx-sleep-after-s", "needs --memx-weights remap (a sleeping model "
                                      "releases its layers)")  # fmt: skip
            return
        if not self.elastic_kv:
            raise MemxConfigError("--memx-weights", "needs --memx-elastic-kv (released layers lend to the KV cache)")
        if self.pool is None and self.pool_budget_gb is None:
            raise MemxConfigError(
                "--memx-weights",
                "needs a physical budget the weights and the KV cache share: --memx-pool-budget-gb GB "
                "(own pool) or --memx-pool NAME (shared); without one there is nothing to lend to",
            )
        if mode == "static" and f is None:
            raise MemxConfigError("--memx-weights-streamed", "is required with --memx-weights static")
        if mode == "remap":
            if f is not None:
                raise MemxConfigError("--memx-weights-streamed", "only applies to --memx-weights static")
        else:
            for option, value in (
                ("--memx-tbt-slo-ms", self.tbt_slo_ms),
                ("--memx-weights-profile", self.weights_profile),
                ("--memx-weights-idle-after-s", None if self.weights_idle_after_s == 30.0 else 1),
                ("--memx-sleep-after-s", self.sleep_after_s),
            ):
                if value is not None:
                    raise MemxConfigError(option, "only applies to --memx-weights remap")
        if self.sleep_after_s is not None and self.pool is None:
            raise MemxConfigError("--memx-sleep-after-s", "needs --memx-pool (a sleeping model gives its memory "
                                  "to the other servers of a shared pool)")  # fmt: skip
        if self.weights_profile is not None and (
            not isinstance(self.weights_profile, str) or not self.weights_profile.strip()
        ):
            raise MemxConfigError("--memx-weights-profile", f"must be a file path, got {self.weights_profile!r}")

    def _validate_peer_kv(self) -> None:
        """--memx-peer-kv / --memx-peer-donate-max-gb (docs/peer-kv.md)."""
        mode = self.peer_kv
        if mode not in PEER_KV_MODES:
            raise MemxConfigError("--memx-peer-kv", f"must be one of {', '.join(PEER_KV_MODES)}, got {mode!r}")
        g = self.peer_donate_max_gb
        if g is not None:
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
                raise MemxConfigError("--memx-peer-donate-max-gb", f"must be a positive number of GB, got {g!r}")
            if mode not in ("donate", "both"):
                raise MemxConfigError("--memx-peer-donate-max-gb", "needs --memx-peer-kv donate or both")
        if self.peer_layer_stream and mode != "borrow":
            raise MemxConfigError(
                "--memx-peer-layer-stream",
                f"needs --memx-peer-kv borrow (its streamed layers live in a donor's lease), got {mode!r}",
            )
        if self.peer_layer_stream and self.host_buffer_gb is not None:
            raise MemxConfigError(
                "--memx-peer-layer-stream",
                "cannot run with --memx-host-buffer-gb (parked KV is gathered layer by layer, and streamed "
                "layers have no buffer of their own); drop one of the two",
            )
        if mode == "off":
            return
        if self.pool is None:
            raise MemxConfigError(
                "--memx-peer-kv", "needs --memx-pool NAME (donors and borrowers are the servers of one shared pool)"
            )

    def check_server_args(self, disable_radix_cache: bool, cuda_graphs: bool) -> None:
        """Checks that need upstream's own flags too (run at parse time and again at pool build).
        ``cuda_graphs``: upstream may capture CUDA graphs (CUDA device, a phase not disabled)."""
        moving = self.weights == "remap" or (self.weights == "static" and (self.weights_streamed or 0) > 0)
        if moving and cuda_graphs:
            raise MemxConfigError(
                "--memx-weights",
                "cannot run with CUDA graphs: a captured graph replays fixed addresses and "
                "skips the layer hooks that bring released layers back; add "
                "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled",
            )
        if self.host_buffer_gb is not None and disable_radix_cache:
            raise MemxConfigError(
                "--memx-host-buffer-gb",
                "needs the radix cache (parked KV is restored "
                "through it); drop --disable-radix-cache or the host buffer",
            )

    def requested_flags(self) -> list[str]:
        """The ``--memx-*`` options (other than ``--memx-disable``) given a non-default value."""
        return [f.option for f in MEMX_FLAGS if f.dest != "disabled" and getattr(self, f.dest) != f.default]

    @property
    def features(self) -> dict[str, bool]:
        """Which memx features are on in this process (names are stable API)."""
        on = not self.disabled
        return {
            "status_endpoint": on,
            "elastic_kv": on and self.elastic_kv,
            "shared_pool": on and self.pool is not None,
            "host_buffer": on and self.host_buffer_gb is not None,
            "weights": on and self.weights != "off",
            "peer_kv": on and self.peer_kv != "off",
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemxConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise MemxConfigError(f"--memx-{unknown[0].replace('_', '-')}", "unknown memx setting")
        return cls(**data).validate()

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> MemxConfig:
        values = {flag.dest: getattr(ns, f"memx_{flag.dest}", flag.default) for flag in MEMX_FLAGS}
        return cls(**values).validate()


def add_memx_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the memx group to ``parser`` (idempotent)."""
    if any(getattr(g, "title", None) == GROUP_TITLE for g in parser._action_groups):
        return
    group = parser.add_argument_group(GROUP_TITLE)
    for flag in MEMX_FLAGS:
        flag.add_to(group)
