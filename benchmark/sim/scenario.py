"""Strict loader for scenario files (JSON, or YAML when PyYAML is importable).

Every field is type- and range-checked; unknown keys are rejected. Any
problem raises ``ScenarioError`` (a ``ValueError``) whose message is
``<file>: <dotted.field[path]>: <what was expected>, got <value>``.
The file format is documented in ``docs/simulation.md``.
"""

from __future__ import annotations

import builtins
import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import registry
from .core.engine import GPU_SHARING
from .core.hardware import GPUS
from .core.models import DTYPE_BYTES, MODELS
from .core.spec import ArbiterSpec, ModelEntry, NodeSpec, ScenarioSpec
from .core.workload import LENGTH_PRESETS, ArrivalSpec, LengthDist, SessionSpec, WorkloadSpec

try:  # optional dependency
    import yaml  # type: ignore
except ImportError:  # pragma: no cover
    yaml = None

__all__ = [
    "ScenarioError",
    "ScenarioSpec",
    "ArbiterSpec",
    "NodeSpec",
    "ModelEntry",
    "Scenario",
    "load_scenario",
    "parse_scenario",
    "YAML_AVAILABLE",
]

YAML_AVAILABLE = yaml is not None
_REQUIRED = object()


class ScenarioError(ValueError):
    """A malformed scenario or workload file; the message names file and field."""


class _Obj:
    """A dict being read field by field; ``done()`` rejects leftover keys."""

    def __init__(self, data: Any, path: str, src: str) -> None:
        self.path, self.src = path, src
        if not isinstance(data, dict):
            self.fail("", "a mapping", data)
        self.data, self.seen = data, set()

    def at(self, key: str) -> str:
        if not key:
            return self.path or "<root>"
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, expected: str, got: Any) -> None:
        raise ScenarioError(f"{self.src}: {self.at(key)}: expected {expected}, got {got!r}")

    def _get(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if default is _REQUIRED:
                raise ScenarioError(f"{self.src}: {self.at(key)}: required field is missing")
            return default
        return self.data[key]

    def has(self, key: str) -> bool:
        return key in self.data

    def str(self, key: str, default: Any = _REQUIRED, choices: builtins.list[str] | None = None) -> Any:
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if not isinstance(v, str) or not v:
            self.fail(key, "a non-empty string", v)
        if choices is not None and v not in choices:
            self.fail(key, f"one of {', '.join(choices)}", v)
        return v

    def int(self, key: str, default: Any = _REQUIRED, min: int | None = None, max: int | None = None) -> Any:
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if (
            isinstance(v, bool)
            or not isinstance(v, int)
            or (min is not None and v < min)
            or (max is not None and v > max)
        ):
            rng = " and ".join(
                x for x in (f">= {min}" if min is not None else "", f"<= {max}" if max is not None else "") if x
            )
            self.fail(key, f"int {rng}".strip(), v)
        return v

    def num(
        self,
        key: str,
        default: Any = _REQUIRED,
        min: float | None = None,
        max: float | None = None,
        positive: bool = False,
    ) -> Any:
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return v
        bad = isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf"))
        if not bad:
            bad = (positive and v <= 0) or (min is not None and v < min) or (max is not None and v > max)
        if bad:
            parts = (
                (["> 0"] if positive else [])
                + ([f">= {min}"] if min is not None else [])
                + ([f"<= {max}"] if max is not None else [])
            )
            self.fail(key, ("finite number " + " and ".join(parts)).strip(), v)
        return float(v)

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self._get(key, default)
        if not isinstance(v, bool):
            self.fail(key, "true or false", v)
        return v

    def obj(self, key: str, optional: bool = True) -> _Obj | None:
        v = self._get(key, None if optional else _REQUIRED)
        if v is None:
            return None
        return _Obj(v, self.at(key), self.src)

    def list(self, key: str, default: Any = _REQUIRED, nonempty: bool = False) -> builtins.list[tuple[str, Any]]:
        v = self._get(key, default)
        if v is default and default is not _REQUIRED:
            return []
        if not isinstance(v, list) or (nonempty and not v):
            self.fail(key, "a non-empty list" if nonempty else "a list", v)
        return [(f"{self.at(key)}[{i}]", x) for i, x in enumerate(v)]

    def raw(self, key: str, default: Any = None) -> Any:
        return self._get(key, default)

    def done(self) -> None:
        extra = sorted(set(self.data) - self.seen, key=str)
        if extra:
            raise ScenarioError(
                f"{self.src}: {self.at(str(extra[0]))}: unknown field (allowed: {', '.join(sorted(self.seen))})"
            )


@dataclass
class Scenario:
    """A loaded file: the base spec, its variants (name, spec), an optional
    rate sweep and the paper's reference numbers."""

    base: ScenarioSpec
    variants: list[tuple[str, ScenarioSpec]]
    rate_scales: list[float]
    paper: dict[str, Any]
    raw: dict[str, Any]
    source: str


_DTYPES = [d for d in DTYPE_BYTES if d in ("bf16", "fp16", "fp8")]


def _length(v: Any, path: str, src: str) -> LengthDist:
    if isinstance(v, str):
        if v not in LENGTH_PRESETS:
            raise ScenarioError(f"{src}: {path}: expected one of {', '.join(LENGTH_PRESETS)} or a mapping, got {v!r}")
        return LENGTH_PRESETS[v]
    o = _Obj(v, path, src)
    kind = o.str("kind", "lognormal", ["lognormal", "fixed"])
    if kind == "fixed":
        d = LengthDist("fixed", value=o.int("value", min=1))
    else:
        d = LengthDist(
            "lognormal",
            mean=o.num("mean", positive=True),
            sigma=o.num("sigma", 1.0, min=0),
            min=o.int("min", 1, min=1),
            max=o.int("max", 1 << 20, min=1),
        )
        if d.max < d.min:
            o.fail("max", f"int >= min ({d.min})", d.max)
    o.done()
    return d


def _arrival(o: _Obj) -> ArrivalSpec:
    kind = o.str("kind", "poisson", ["poisson", "gamma", "onoff", "batch"])
    if kind == "batch":
        a = ArrivalSpec("batch", count=o.int("count", min=1))
    else:
        a = ArrivalSpec(
            kind,
            rate=o.num("rate", min=0),
            cv=o.num("cv", 2.0, positive=True),
            on_s=o.num("on_s", 60.0, positive=True),
            off_s=o.num("off_s", 60.0, positive=True),
        )
    o.done()
    return a


def _workload(o: _Obj, model_names: list[str], duration: float) -> WorkloadSpec:
    model = o.str("model", choices=model_names)
    arrival = _arrival(o.obj("arrival", optional=False))
    inp = _length(o.raw("input", "sharegpt_input"), o.at("input"), o.src)
    out = _length(o.raw("output", "sharegpt_output"), o.at("output"), o.src)
    so = o.obj("sessions")
    sessions = None
    if so is not None:
        sessions = SessionSpec(
            so.num("turns_mean", 4.0, min=1), so.num("think_s", 10.0, min=0), so.int("max_context", 32768, min=2)
        )
        so.done()
    idle = []
    for p, w in o.list("idle", []):
        if (
            not isinstance(w, list)
            or len(w) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in w)
            or w[1] < w[0]
        ):
            raise ScenarioError(f"{o.src}: {p}: expected [start_s, end_s] with end >= start, got {w!r}")
        idle.append((float(w[0]), float(w[1])))
    start = o.num("start_s", 0.0, min=0)
    end = o.num("end_s", None, min=0)
    w = WorkloadSpec(
        model, arrival, inp, out, sessions, o.int("system_prompt_tokens", 0, min=0), start, end, tuple(idle)
    )
    o.done()
    return w


def _model(o: _Obj, n_gpus: int) -> ModelEntry:
    name = o.str("name")
    mb = o.int("max_batched_tokens", 2048, min=1)
    slo = o.obj("slo")
    ttft = tpot = float("inf")
    if slo is not None:
        ttft = slo.num("ttft_s", float("inf"), positive=True)
        tpot = slo.num("tpot_s", float("inf"), positive=True)
        slo.done()
    sched = o.obj("scheduler")
    kind, opts = "continuous", {}
    if sched is not None:
        kind = sched.str("kind", "continuous", sorted(registry.SCHEDULERS))
        opts = sched.raw("options", {})
        if not isinstance(opts, dict) or not all(isinstance(k, str) for k in opts):
            sched.fail("options", "a mapping of option names to values", opts)
        sched.done()
    hooks = []
    for p, h in o.list("hooks", []):
        ho = _Obj(h, p, o.src)
        hk = ho.str("kind", choices=sorted(registry.HOOKS))
        hopts = ho.raw("options", {})
        if not isinstance(hopts, dict):
            ho.fail("options", "a mapping of option names to values", hopts)
        ho.done()
        hooks.append((hk, dict(hopts)))
    e = ModelEntry(
        name=name,
        model=o.str("model", choices=list(MODELS)),
        gpu=o.int("gpu", 0, min=0, max=n_gpus - 1),
        weight_dtype=o.str("weight_dtype", "bf16", _DTYPES),
        kv_dtype=o.str("kv_dtype", "bf16", _DTYPES),
        block_size=o.int("block_size", 16, min=1),
        max_batched_tokens=mb,
        max_running=o.int("max_running", 256, min=1),
        prefix_caching=o.bool("prefix_caching", True),
        overhead_s=o.num("overhead_s", 5e-4, min=0),
        share=o.num("share", 1.0, positive=True, max=1),
        kv_memory_gb=o.num("kv_memory_gb", None, positive=True),
        activation_tokens=o.int("activation_tokens", None, min=0),
        ttft_slo_s=ttft,
        tpot_slo_s=tpot,
        scheduler=kind,
        scheduler_options=dict(opts),
        hooks=tuple(hooks),
    )
    o.done()
    return e


def parse_scenario(data: Any, src: str = "<memory>", allow_extras: bool = False) -> ScenarioSpec:
    """Validate one configuration dict. ``allow_extras``: ignore the
    file-level keys (variants, sweep, paper) handled by ``load_scenario``."""
    o = _Obj(data, "", src)
    if allow_extras:
        o.seen.update({"variants", "sweep", "paper"})
    name = o.str("name")
    duration = o.num("duration_s", positive=True)
    no = o.obj("node", optional=False)
    node = NodeSpec(
        no.str("gpu", choices=list(GPUS)),
        no.int("count", 1, min=1, max=64),
        no.str("sharing", "time_slice", list(GPU_SHARING)),
        no.num("memory_fraction", 0.9, positive=True, max=1),
        no.num("compute_eff", None, positive=True, max=1),
        no.num("memory_eff", None, positive=True, max=1),
    )
    no.done()
    models = []
    for p, m in o.list("models", nonempty=True):
        models.append(_model(_Obj(m, p, src), node.count))
    names = [m.name for m in models]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise ScenarioError(f"{src}: models[{i}].name: expected a unique name, got {n!r} (duplicate)")
    workloads = tuple(_workload(_Obj(w, p, src), names, duration) for p, w in o.list("workloads", []))
    arbiter = None
    ao = o.obj("arbiter")
    if ao is not None:
        arbiter = ArbiterSpec(
            ao.bool("share_kv", True),
            ao.num("floor_fraction", 0.25, min=0, max=1),
            ao.num("low_watermark_frac", 0.03, min=0, max=1),
            ao.num("high_watermark_frac", 0.15, min=0, max=1),
        )
        if arbiter.high_watermark_frac < arbiter.low_watermark_frac:
            ao.fail(
                "high_watermark_frac",
                f"number >= low_watermark_frac ({arbiter.low_watermark_frac})",
                arbiter.high_watermark_frac,
            )
        ao.done()
    spec = ScenarioSpec(
        name=name,
        node=node,
        models=tuple(models),
        workloads=workloads,
        duration_s=duration,
        seed=o.int("seed", 0, min=0),
        drain_s=o.num("drain_s", 600.0, min=0),
        sample_period_s=o.num("sample_period_s", 1.0, positive=True),
        description=o.str("description", ""),
        source=src,
        arbiter=arbiter,
    )
    o.done()
    return spec


_PATH_TOKEN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)|\[(\d+|\*)\]|\.")


def _split_path(path: str) -> list[Any]:
    out, pos = [], 0
    while pos < len(path):
        m = _PATH_TOKEN.match(path, pos)
        if not m:
            raise ValueError(f"bad character at {pos}")
        if m.group(1):
            out.append(m.group(1))
        elif m.group(2):
            out.append("*" if m.group(2) == "*" else int(m.group(2)))
        pos = m.end()
    if not out:
        raise ValueError("empty path")
    return out


def _set_path(doc: Any, toks: list[Any], value: Any) -> None:
    head, rest = toks[0], toks[1:]
    if isinstance(head, str) and head != "*":
        if not isinstance(doc, dict):
            raise ValueError(f"{head!r} is not inside a mapping")
        if not rest:
            doc[head] = copy.deepcopy(value)
            return
        if head not in doc:
            doc[head] = {}
        _set_path(doc[head], rest, value)
        return
    if not isinstance(doc, list):
        raise ValueError("index into something that is not a list")
    targets = range(len(doc)) if head == "*" else [head]
    for i in targets:
        if i >= len(doc):
            raise ValueError(f"index {i} out of range (list has {len(doc)})")
        if not rest:
            doc[i] = copy.deepcopy(value)
        else:
            _set_path(doc[i], rest, value)


def _read(path: Path) -> Any:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        if yaml is None:
            raise ScenarioError(f"{path}: YAML files need PyYAML, which is not installed; use .json")
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ScenarioError(f"{path}: <root>: not valid YAML: {e}") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ScenarioError(f"{path}: <root>: not valid JSON: {e}") from None
    raise ScenarioError(f"{path}: expected a .json{' or .yaml' if yaml else ''} file")


def load_scenario(path: str | Path, data: Any = None) -> Scenario:
    """Load and validate a scenario file (or ``data`` reported as ``path``).

    File-level extras: ``variants`` (list of ``{name, set: {dotted.path:
    value}}``; each is the base with those fields replaced, ``[*]`` applies to
    every list element), ``sweep.rate_scale`` (list of arrival-rate
    multipliers), ``paper`` (``figure``, ``claims``: metric -> number,
    ``notes``)."""
    path = Path(path)
    src = str(path)
    if data is None:
        if not path.exists():
            raise ScenarioError(f"{src}: file not found")
        data = _read(path)
    base = parse_scenario(data, src, allow_extras=True)
    o = _Obj(data, "", src)
    variants = []
    for p, v in o.list("variants", []):
        vo = _Obj(v, p, src)
        vname = vo.str("name")
        sets = vo.obj("set", optional=False)
        doc = copy.deepcopy({k: x for k, x in data.items() if k not in ("variants", "sweep", "paper")})
        for key in list(sets.data):
            try:
                _set_path(doc, _split_path(str(key)), sets.data[key])
            except ValueError as e:
                raise ScenarioError(f"{src}: {sets.at(repr(key))}: cannot set this path ({e})") from None
        sets.seen.update(sets.data)
        vo.done()
        try:
            spec = parse_scenario(doc, src)
        except ScenarioError as e:
            raise ScenarioError(f"{e} (in {p} {vname!r})") from None
        if any(n == vname for n, _ in variants):
            vo.fail("name", "a unique variant name", vname)
        variants.append((vname, spec))
    scales = []
    so = o.obj("sweep")
    if so is not None:
        for p, x in so.list("rate_scale", nonempty=True):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
                raise ScenarioError(f"{src}: {p}: expected number > 0, got {x!r}")
            scales.append(float(x))
        so.done()
    paper: dict[str, Any] = {}
    po = o.obj("paper")
    if po is not None:
        paper["figure"] = po.str("figure", "")
        paper["notes"] = po.str("notes", "")
        claims = po.obj("claims")
        paper["claims"] = {}
        if claims is not None:
            for k in list(claims.data):
                paper["claims"][str(k)] = claims.num(str(k))
            claims.done()
        po.done()
    return Scenario(base, variants, scales, paper, data, src)
