"""``models.yaml`` for ``sglang-memx serve``: YAML in, frozen dataclasses out.

Invariants:

* Every error is a ``ServeConfigError`` whose ``field`` is the path of the offending
  value in the YAML document (``models[1].name``, ``router.port``, ``devices[0]``) and
  is raised by ``load_config`` / ``parse_config`` before anything is started.
* Unknown fields are errors (a typo never silently falls back to a default).
* The result is immutable (frozen dataclasses, tuples) and already cross-checked:
  model names and device names are unique, a model's ``device`` names a declared
  device, ``1 <= min_replicas <= max_replicas <= MAX_REPLICAS`` (and, until scaling
  is implemented, ``max_replicas == min_replicas``), every model path is a directory
  holding a ``config.json``.

Whether each model fits on a device is the placement's question
(``sglang_memx.serve.placement``), which raises the same error type.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ServeConfigError",
    "ModelConfig",
    "DeviceConfig",
    "RouterConfig",
    "LaunchConfig",
    "HealthConfig",
    "ServeConfig",
    "parse_config",
    "load_config",
    "LAUNCHER_FLAGS",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")
DEVICE_KINDS = ("cpu", "cuda")
MAX_REPLICAS = 32  # per model: a sanity bound (each replica is a whole engine process)
MAX_TOKENS = 1 << 40  # a token count past this is a typo (and its bytes would overflow a float)
UNCAPPED = 1 << 30  # a queue or in-flight cap nobody set: larger than any real load
# What the supervisor's periodic probe GETs (docs/router.md, "Hung engines"): memx's status
# round-trips through the scheduler loop without a request; upstream's /health (= /health_generate
# in 0.5.23) runs a one-token generation on an idle engine, which would wake a sleeping one.
HEALTH_PATHS = ("/memx/status", "/health", "/health_generate")

# Flags the launcher sets itself; a model's server_args may not repeat them.
LAUNCHER_FLAGS = (
    "--model-path",
    "--host",
    "--port",
    "--device",
    "--dtype",
    "--kv-cache-dtype",
    "--served-model-name",
    "--max-total-tokens",
    "--memx-elastic-kv",
    "--memx-pool",
    "--memx-pool-budget-gb",
    "--memx-pool-dir",
    "--memx-disable",
    "--api-key",
)

# The model name is the OpenAI ``model`` id and a URL path segment prefix (/models/<name>/...).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*(/[A-Za-z0-9._:@+-]+)*")
_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a field name shown as is in an error's path; others are quoted
_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


class ServeConfigError(ValueError):
    """A bad ``models.yaml``: ``field`` is the YAML path of the bad value."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    """One served model. ``priority``: higher is more important (0 default)."""

    name: str
    path: str
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float | None = None  # its engines' --memx-tpot-slo-ms (the governor); None: no governor
    priority: int = 0
    min_replicas: int = 1  # engines started for this model (each its own instance in placement)
    max_replicas: int = 1  # defaults to min_replicas; scaling above min is not implemented (must equal it)
    max_inflight: int | None = None  # None: router.max_inflight_per_engine
    max_queued: int | None = None  # None: router.max_queued
    max_total_tokens: int | None = None  # logical KV tokens; None: what the device pool holds (capped)
    kv_reserve_tokens: int = 1024  # KV tokens charged to the model's base footprint in placement
    device: str | None = None  # pin to one device; None: placement chooses
    server_args: tuple[str, ...] = ()
    sleep_after_s: float | None = None  # idle this long: the engine sleeps (weights + KV back to the pool)


@dataclass(frozen=True)
class DeviceConfig:
    """One placement candidate. ``cores``: CPU cores its servers share (cpu only; None = all);
    ``index``: the CUDA ordinal (cuda only; None = the device's position among cuda devices);
    ``lend_idle_cores`` (cpu only): an engine with work computes on its idle siblings' cores
    too (``sglang_memx.compute_share``); False keeps each engine on its own share."""

    name: str
    kind: str = "cpu"
    memory_gb: float = 1.0
    cores: tuple[int, ...] | None = None
    index: int | None = None
    max_inflight: int | None = None  # requests of all its models handed to engines at once; None: no shared cap
    lend_idle_cores: bool = True


@dataclass(frozen=True)
class RouterConfig:
    """The OpenAI-compatible front: where it listens and how it admits.

    Defaults refuse nothing stock SGLang would serve: no queue cap (``max_queued`` None), no
    in-flight cap (``max_inflight_per_engine`` None: every request goes to its engine at once,
    whose own scheduler batches it, as stock's does) and no shedding. ``hopeless_after_slo_x``:
    when set, a queued request is shed once it has waited this many times its model's TTFT SLO
    past its deadline (it could only ever miss). ``api_key``: every
    route but /health needs ``Authorization: Bearer <key>``; the engines get it as
    ``--api-key`` (None: no key).
    """

    host: str = "127.0.0.1"
    port: int = 30000
    max_queued: int | None = None
    max_inflight_per_engine: int | None = None
    hopeless_after_slo_x: float | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None


@dataclass(frozen=True)
class LaunchConfig:
    """How engines are started: logs, pool sockets, start-up timeout, extra memx flags for all,
    and how a dead engine is restarted (``launcher.RestartPolicy``)."""

    log_dir: str | None = None  # None: ./sglang-memx-serve-logs
    pool_dir: str | None = None  # None: memx's default pool directory
    startup_timeout_s: float = 600.0
    memx_args: tuple[str, ...] = ()
    max_restarts: int = 3  # restart attempts within restart_window_s; then the engine stays dead
    restart_backoff_s: float = 1.0  # before the first attempt, doubling (at most 30 s)
    restart_window_s: float = 600.0


@dataclass(frozen=True)
class HealthConfig:
    """Periodic probing of live engines (``launcher.HealthProbe``): every ``interval_s`` (None:
    never) a GET of ``path`` with ``timeout_s``; ``failures`` probes in a row without a 200 while
    the process is alive: the engine is hung, killed and restarted like a dead one."""

    interval_s: float | None = 5.0
    timeout_s: float = 10.0
    failures: int = 3
    path: str = "/memx/status"


@dataclass(frozen=True)
class ServeConfig:
    models: tuple[ModelConfig, ...]
    devices: tuple[DeviceConfig, ...]
    router: RouterConfig = field(default_factory=RouterConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    source: str | None = None  # the file it was read from
    health: HealthConfig = field(default_factory=HealthConfig)

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def device(self, name: str) -> DeviceConfig:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def inflight_cap(self, model: ModelConfig) -> int:
        """Requests of ``model`` handed to one engine at once (``UNCAPPED``: no cap was set)."""
        cap = model.max_inflight if model.max_inflight is not None else self.router.max_inflight_per_engine
        return UNCAPPED if cap is None else cap

    def queue_cap(self, model: ModelConfig) -> int:
        """Requests of ``model`` the router queues (``UNCAPPED``: no cap was set)."""
        cap = model.max_queued if model.max_queued is not None else self.router.max_queued
        return UNCAPPED if cap is None else cap

    def total_queue_cap(self) -> int:
        return UNCAPPED if self.router.max_queued is None else self.router.max_queued


# ------------------------------------------------------------------ value checks


def _str(path, v, pattern=None, choices=None):
    if not isinstance(v, str) or not v:
        raise ServeConfigError(path, f"must be a non-empty string, got {v!r}")
    if choices is not None and v not in choices:
        raise ServeConfigError(path, f"must be one of {', '.join(choices)}, got {v!r}")
    if pattern is not None and not pattern.fullmatch(v):
        raise ServeConfigError(path, f"{v!r} has characters not allowed here (letters, digits, . _ - and inner /)")
    return v


def _int(path, v, minimum=None, maximum=None):
    if isinstance(v, bool) or not isinstance(v, int):
        raise ServeConfigError(path, f"must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise ServeConfigError(path, f"must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ServeConfigError(path, f"must be <= {maximum}, got {v}")
    return v


def _pos(path, v, maximum=1e15):
    # maximum: well past any real value, and keeps later arithmetic (x GIB, ms -> s) finite
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
        raise ServeConfigError(path, f"must be a positive number, got {v!r}")
    if v > maximum:
        raise ServeConfigError(path, f"must be <= {maximum:g}, got {v!r}")
    return float(v)


def _bool(path, v):
    if not isinstance(v, bool):
        raise ServeConfigError(path, f"must be true or false, got {v!r}")
    return v


def _opt(check):
    return lambda path, v: None if v is None else check(path, v)


def _args(path, v):
    if isinstance(v, str):
        v = v.split()
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise ServeConfigError(path, f"must be a list of strings, got {v!r}")
    return tuple(v)


def _cores(path, v):
    if not isinstance(v, list) or not v:
        raise ServeConfigError(path, f"must be a non-empty list of core ids, got {v!r}")
    cores = tuple(_int(f"{path}[{i}]", c, 0) for i, c in enumerate(v))
    if len(set(cores)) != len(cores):
        raise ServeConfigError(path, f"lists a core twice: {list(cores)}")
    return cores


def _fields(path: str, doc, spec: dict) -> dict:
    """Check a mapping against ``spec`` (field -> (checker, required)); return the checked values."""
    if not isinstance(doc, dict):
        raise ServeConfigError(path, f"must be a mapping, got {type(doc).__name__}")
    for key in doc:
        if key not in spec:
            name = key if isinstance(key, str) and _KEY.fullmatch(key) else repr(key)  # '', 'a.b', None: quoted
            raise ServeConfigError(f"{path}.{name}" if path else name, f"unknown field (known: {', '.join(spec)})")
    out = {}
    for key, (check, required) in spec.items():
        sub = f"{path}.{key}" if path else key
        if key not in doc:
            if required:
                raise ServeConfigError(sub, "is required")
            continue
        out[key] = check(sub, doc[key])
    return out


# ------------------------------------------------------------------- sections

_MODEL_SPEC = {
    "name": (lambda p, v: _str(p, v, _NAME), True),
    "path": (_str, True),
    "dtype": (lambda p, v: _str(p, v, choices=DTYPES), False),
    "precision": (lambda p, v: _str(p, v, choices=DTYPES), False),  # alias of dtype
    "kv_cache_dtype": (lambda p, v: _str(p, v, choices=KV_DTYPES), False),
    "ttft_slo_ms": (_pos, False),
    "tpot_slo_ms": (_opt(_pos), False),
    "priority": (lambda p, v: _int(p, v, -1000, 1000), False),
    "min_replicas": (lambda p, v: _int(p, v, 1, MAX_REPLICAS), False),
    "max_replicas": (lambda p, v: _int(p, v, 1, MAX_REPLICAS), False),
    "max_inflight": (_opt(lambda p, v: _int(p, v, 1)), False),
    "max_queued": (_opt(lambda p, v: _int(p, v, 0)), False),
    "max_total_tokens": (_opt(lambda p, v: _int(p, v, 16, MAX_TOKENS)), False),
    "kv_reserve_tokens": (lambda p, v: _int(p, v, 0, MAX_TOKENS), False),
    "device": (_opt(lambda p, v: _str(p, v, _DEVICE_NAME)), False),
    "server_args": (_args, False),
    "sleep_after_s": (_opt(_pos), False),
}

_DEVICE_SPEC = {
    "name": (lambda p, v: _str(p, v, _DEVICE_NAME), True),
    "kind": (lambda p, v: _str(p, v, choices=DEVICE_KINDS), False),
    "memory_gb": (_pos, True),
    "cores": (_opt(_cores), False),
    "index": (_opt(lambda p, v: _int(p, v, 0)), False),
    "max_inflight": (_opt(lambda p, v: _int(p, v, 1)), False),
    "lend_idle_cores": (_bool, False),
}

_ROUTER_SPEC = {
    "host": (_str, False),
    "port": (lambda p, v: _int(p, v, 0, 65535), False),
    "max_queued": (_opt(lambda p, v: _int(p, v, 0)), False),
    "max_inflight_per_engine": (_opt(lambda p, v: _int(p, v, 1)), False),
    "hopeless_after_slo_x": (_opt(_pos), False),
    "request_timeout_s": (_pos, False),
    "api_key": (_opt(_str), False),
}

_LAUNCH_SPEC = {
    "log_dir": (_opt(_str), False),
    "pool_dir": (_opt(_str), False),
    "startup_timeout_s": (_pos, False),
    "memx_args": (_args, False),
    "max_restarts": (lambda p, v: _int(p, v, 0, 100), False),
    "restart_backoff_s": (_pos, False),
    "restart_window_s": (_pos, False),
}

_DAY_S = 86400.0  # health times past a day are typos (and a socket timeout must fit a time_t)
_HEALTH_SPEC = {
    "interval_s": (_opt(lambda p, v: _pos(p, v, _DAY_S)), False),
    "timeout_s": (lambda p, v: _pos(p, v, _DAY_S), False),
    "failures": (lambda p, v: _int(p, v, 1, 100), False),
    "path": (lambda p, v: _str(p, v, choices=HEALTH_PATHS), False),
}

_TOP_SPEC = {
    "models": (lambda p, v: v, True),
    "devices": (lambda p, v: v, True),
    "router": (lambda p, v: v, False),
    "launch": (lambda p, v: v, False),
    "health": (lambda p, v: v, False),
}


def _check_server_args(path: str, args: tuple[str, ...]) -> None:
    for i, a in enumerate(args):
        flag = a.split("=", 1)[0]
        if flag in LAUNCHER_FLAGS:
            raise ServeConfigError(f"{path}[{i}]", f"{flag} is set by the launcher from the config, not here")


def _check_slo_flags(models: list[ModelConfig], launch: LaunchConfig) -> None:
    """A model's ``tpot_slo_ms`` reaches its engines as ``--memx-tpot-slo-ms`` (``engine_specs``): the
    flag may not come again from its ``server_args`` or ``launch.memx_args``. A host buffer given
    there then gets the model's ``ttft_slo_ms`` as ``--memx-ttft-slo-ms`` too, unless one is given
    (``engine_specs``; the engine refuses one SLO of the two)."""
    for i, m in enumerate(models):
        if m.tpot_slo_ms is None:
            continue
        for path, args in ((f"models[{i}].server_args", m.server_args), ("launch.memx_args", launch.memx_args)):
            for j, a in enumerate(args):
                if a.split("=", 1)[0] == "--memx-tpot-slo-ms":
                    why = f"--memx-tpot-slo-ms contradicts models[{i}].tpot_slo_ms (the launcher passes that)"
                    raise ServeConfigError(f"{path}[{j}]", why + "; give one of the two")


def _model(i: int, doc, base: Path) -> ModelConfig:
    path = f"models[{i}]"
    v = _fields(path, doc, _MODEL_SPEC)
    if "precision" in v:
        if "dtype" in v and v["dtype"] != v["precision"]:
            raise ServeConfigError(f"{path}.precision", f"contradicts dtype {v['dtype']!r} (give one of them)")
        v["dtype"] = v.pop("precision")
    model_dir = Path(os.path.expanduser(v["path"]))
    if not model_dir.is_absolute():
        model_dir = base / model_dir
    try:
        is_dir, has_config = model_dir.is_dir(), (model_dir / "config.json").is_file()
    except OSError as exc:  # a name too long, a symlink loop, ...
        raise ServeConfigError(f"{path}.path", f"{str(model_dir)!r}: {exc.strerror or exc}") from None
    if not is_dir:
        raise ServeConfigError(f"{path}.path", f"{str(model_dir)!r} is not a directory")
    if not has_config:
        raise ServeConfigError(f"{path}.path", f"{str(model_dir)!r} has no config.json (not a model checkpoint)")
    v["path"] = str(model_dir.resolve())
    v.setdefault("max_replicas", v.get("min_replicas", 1))
    if v["max_replicas"] < v.get("min_replicas", 1):
        raise ServeConfigError(f"{path}.max_replicas", f"{v['max_replicas']} < min_replicas {v['min_replicas']}")
    if v["max_replicas"] > v.get("min_replicas", 1):
        raise ServeConfigError(
            f"{path}.max_replicas",
            f"{v['max_replicas']} > min_replicas {v.get('min_replicas', 1)}: scaling between min and max is not "
            "implemented yet; set max_replicas = min_replicas (that many engines are started)",
        )
    if "server_args" in v:
        _check_server_args(f"{path}.server_args", v["server_args"])
    return ModelConfig(**v)


def _list(path: str, doc) -> list:
    if not isinstance(doc, list) or not doc:
        raise ServeConfigError(path, "must be a non-empty list")
    return doc


def parse_config(doc, base_dir: str | os.PathLike = ".", source: str | None = None) -> ServeConfig:
    """Validate a parsed YAML document (relative model paths resolve against ``base_dir``)."""
    if doc is None:
        raise ServeConfigError("models", "is required (the file is empty)")
    top = _fields("", doc, _TOP_SPEC)
    base = Path(base_dir)
    devices = []
    for i, d in enumerate(_list("devices", top["devices"])):
        dev = DeviceConfig(**_fields(f"devices[{i}]", d, _DEVICE_SPEC))
        if dev.kind == "cuda" and dev.cores is not None:
            raise ServeConfigError(f"devices[{i}].cores", "only a cpu device has cores")
        if dev.kind == "cuda" and "lend_idle_cores" in d:
            raise ServeConfigError(f"devices[{i}].lend_idle_cores", "only a cpu device has cores")
        if dev.kind == "cpu" and dev.index is not None:
            raise ServeConfigError(f"devices[{i}].index", "only a cuda device has an index")
        if any(o.name == dev.name for o in devices):
            raise ServeConfigError(f"devices[{i}].name", f"duplicate {dev.name!r}")
        devices.append(dev)
    models = []
    for i, m in enumerate(_list("models", top["models"])):
        model = _model(i, m, base)
        if any(o.name == model.name for o in models):
            raise ServeConfigError(f"models[{i}].name", f"duplicate {model.name!r}")
        if model.device is not None and all(d.name != model.device for d in devices):
            raise ServeConfigError(f"models[{i}].device", f"{model.device!r} is not a declared device")
        models.append(model)
    router = RouterConfig(**_fields("router", top.get("router") or {}, _ROUTER_SPEC))
    launch = LaunchConfig(**_fields("launch", top.get("launch") or {}, _LAUNCH_SPEC))
    health = HealthConfig(**_fields("health", top.get("health") or {}, _HEALTH_SPEC))
    _check_slo_flags(models, launch)
    if health.interval_s is not None and health.path != "/memx/status":
        sleepy = [m.name for m in models if m.sleep_after_s is not None]
        if sleepy:  # upstream's /health generates a token: every probe would wake the engine
            raise ServeConfigError("health.path", f"{health.path} runs a generation, which wakes a sleeping "
                                   f"engine and keeps it awake ({', '.join(sleepy)}: sleep_after_s); "
                                   "use /memx/status")  # fmt: skip
    return ServeConfig(tuple(models), tuple(devices), router, launch, source, health=health)


def load_config(path: str | os.PathLike) -> ServeConfig:
    """Read and validate ``path`` (a YAML file)."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ServeConfigError("--config", f"cannot read {str(p)!r}: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ServeConfigError("--config", f"{str(p)!r} is not valid YAML: {exc}") from None
    return parse_config(doc, base_dir=p.resolve().parent, source=str(p))
