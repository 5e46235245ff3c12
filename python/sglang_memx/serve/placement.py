"""Which model runs on which device: sizes from the checkpoints, FineServe Alg. 1 to choose.

``read_model_size`` reads a checkpoint directory (weight file sizes, ``config.json``);
``plan_placement`` turns the config and those sizes into
``memory_ext.policy.placement.ModelDemand`` / ``GpuCandidate`` and calls ``place_models``,
the same procedure the simulator's FineServe placement runs.

Invariants:

* Nothing is started or loaded: only file sizes and ``config.json`` are read.
* Every model is placed, or ``ServeConfigError`` names ``models[i]`` with the bytes it
  needs and what the devices have.
* A device's pool budget is its memory minus the weights placed on it (the weights are
  outside the pool; the pool holds KV and activations of all its models), and each
  model's base footprint fits within its device.

READINGS (the paper's profiled inputs, approximated from the checkpoint):

* F_M = weights in the serving dtype + ``kv_reserve_tokens`` tokens of KV. Activations
  are not charged: with elastic KV they come from the same pool as KV, on demand.
* mu = 1 / KV bytes per token (tokens of extra KV a byte buys); a model with smaller KV
  cells gains more from leftover memory.
* A model pinned with ``device:`` is charged to that device first; the others go through
  Alg. 1 over what is left.
* Replicas (``min_replicas``): each replica is its own instance (``instance_name``: the
  model's name for replica 0, ``<name>#<r>`` after) with the model's F_M and mu, placed by
  the same Alg. 1 with ``spread`` (replicas of one model prefer devices apart); a pinned
  model's replicas all go to its device. Every replica is placed or the config fails:
  replica 0 names ``models[i]``, a later one ``models[i].min_replicas``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memory_ext.policy.kv_format import KVLayout, KVPrecision, token_kv_bytes
from memory_ext.policy.placement import GpuCandidate, ModelDemand, PlacementResult, place_models

from .config import ServeConfig, ServeConfigError

__all__ = [
    "GIB",
    "ModelSize",
    "read_model_size",
    "PlacedModel",
    "DevicePlan",
    "Placement",
    "plan_placement",
    "instance_name",
]

GIB = 1 << 30
MAX_DEFAULT_TOTAL_TOKENS = 65536  # default logical KV tokens (reserved address space with elastic KV)

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8_e5m2": 1, "fp8_e4m3": 1}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelSize:
    """What placement needs from a checkpoint, in bytes, for the serving dtypes."""

    weight_bytes: int
    kv_bytes_per_token: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_elem_bytes: int
    hidden_size: int = 0  # the model's width (``config.json``); 0 when it does not say


def _hf_text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def read_model_size(path: str | Path, dtype: str = "auto", kv_cache_dtype: str = "auto") -> ModelSize:
    """Weights and KV cell size of the checkpoint at ``path`` when served in ``dtype``.

    Weight bytes are the weight files' sizes (safetensors, else .bin / .pt), rescaled from
    the checkpoint's ``torch_dtype`` to ``dtype``. KV per token = layers x KV heads x
    head_dim x 2 (K and V) x element bytes (``kv_cache_dtype``, else the serving dtype).
    """
    root = Path(path)
    try:
        cfg = _hf_text_config(json.loads((root / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{root}/config.json: cannot read: {exc}") from None
    files = [p for p in root.iterdir() if p.is_file() and p.suffix == ".safetensors"]
    if not files:
        files = [p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES]
    if not files:
        raise ValueError(f"{root}: no weight files (*.safetensors, *.bin, *.pt)")
    on_disk = sum(p.stat().st_size for p in files)
    ckpt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    ckpt_bytes = _DTYPE_BYTES.get(ckpt, 2)
    serve_bytes = ckpt_bytes if dtype == "auto" else _DTYPE_BYTES[dtype]
    weights = on_disk * serve_bytes // ckpt_bytes
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{root}/config.json: no KV geometry ({exc!r} missing or not a number)") from None
    kv_elem = serve_bytes if kv_cache_dtype == "auto" else _DTYPE_BYTES[kv_cache_dtype]
    layout = KVLayout(layers, kv_heads, head_dim, precision=KVPrecision(f"b{kv_elem}", kv_elem))
    hidden = cfg.get("hidden_size")
    width = int(hidden) if isinstance(hidden, int | float) and hidden > 0 else 0
    return ModelSize(weights, token_kv_bytes(layout, per_layer=False), layers, kv_heads, head_dim, kv_elem, width)


def instance_name(model: str, replica: int) -> str:
    """The placement / engine key of one replica: the model's name for replica 0 (so a
    one-replica config is keyed as before), ``<name>#<r>`` after (``#`` is not allowed in
    model names, so keys never collide)."""
    return model if replica == 0 else f"{model}#{replica}"


@dataclass(frozen=True)
class PlacedModel:
    name: str
    device: str  # replica 0's device
    size: ModelSize
    footprint_bytes: int  # of one replica
    max_total_tokens: int
    replica_devices: tuple[str, ...] = ()  # device of each replica (instance_name(name, r)); () = (device,)

    @property
    def replicas(self) -> tuple[tuple[str, str], ...]:
        """(instance name, device) of every replica, replica 0 first."""
        devs = self.replica_devices or (self.device,)
        return tuple((instance_name(self.name, r), d) for r, d in enumerate(devs))


@dataclass(frozen=True)
class DevicePlan:
    name: str
    kind: str
    models: tuple[str, ...]  # instances (``instance_name``) in placement order
    weight_bytes: int
    pool_budget_bytes: int  # memory - weights outside the pool: KV + activations (+ sleepers' weights)

    @property
    def pool_budget_gb(self) -> float:
        return self.pool_budget_bytes / GIB


@dataclass(frozen=True)
class Placement:
    models: dict[str, PlacedModel]  # config order
    devices: dict[str, DevicePlan]  # config order; a device may hold no model
    alg1: PlacementResult  # the decision over the models placed by Alg. 1 (pinned ones excluded)

    def describe(self) -> str:
        lines = []
        for d in self.devices.values():
            names = ", ".join(d.models) or "-"
            lines.append(
                f"{d.name} ({d.kind}): {names}; weights {d.weight_bytes / GIB:.4f} GB, pool {d.pool_budget_gb:.4f} GB"
            )
        return "\n".join(lines)


def plan_placement(config: ServeConfig, sizes: dict[str, ModelSize] | None = None) -> Placement:
    """Place every model of ``config`` (``sizes`` by model name; read from the checkpoints if None)."""
    index = {m.name: i for i, m in enumerate(config.models)}
    if sizes is None:
        sizes = {}
        for i, m in enumerate(config.models):
            try:
                sizes[m.name] = read_model_size(m.path, m.dtype, m.kv_cache_dtype)
            except ValueError as exc:
                raise ServeConfigError(f"models[{i}].path", str(exc)) from None
    mem = {d.name: d.memory_gb * GIB for d in config.devices}
    footprint = {m.name: sizes[m.name].weight_bytes + m.kv_reserve_tokens * sizes[m.name].kv_bytes_per_token
                 for m in config.models}  # fmt: skip

    def unfit(m, where: str, free: float, replica: int = 0):
        s = sizes[m.name]
        need = (f"{m.name!r} needs {footprint[m.name] / GIB:.4f} GB (weights {s.weight_bytes / GIB:.4f} GB + "
                f"{m.kv_reserve_tokens} KV tokens x {s.kv_bytes_per_token} B)")  # fmt: skip
        if replica == 0:
            return ServeConfigError(f"models[{index[m.name]}]", f"{need} and {where} has {free / GIB:.4f} GB")
        return ServeConfigError(
            f"models[{index[m.name]}].min_replicas",
            f"replica {replica + 1} of {m.min_replicas}: {need} per replica and {where} has {free / GIB:.4f} GB",
        )

    instances = [(m, r, instance_name(m.name, r)) for m in config.models for r in range(m.min_replicas)]
    assignment: dict[str, str] = {}  # instance -> device
    left = dict(mem)
    for m, r, inst in instances:
        if m.device is not None:
            if footprint[m.name] > left[m.device]:
                raise unfit(m, f"its device {m.device!r}", left[m.device], r)
            left[m.device] -= footprint[m.name]
            assignment[inst] = m.device
    free = [(m, r, inst) for m, r, inst in instances if m.device is None]
    candidates = [GpuCandidate(d, left[d]) for d in left if left[d] > 0]
    demands = [ModelDemand(inst, footprint[m.name], 1.0 / sizes[m.name].kv_bytes_per_token) for m, _, inst in free]
    if demands and not candidates:
        raise unfit(free[0][0], "no device", 0.0, free[0][1])
    spread = {inst: m.name for m, _, inst in free}
    result = place_models(demands, candidates, spread=spread) if demands else PlacementResult((), {}, {}, {}, ())
    of_instance = {inst: (m, r) for m, r, inst in instances}
    for inst in sorted(result.unplaced, key=lambda n: (index[of_instance[n][0].name], of_instance[n][1])):
        m, r = of_instance[inst]
        best = max(left.values())
        raise unfit(m, "no device: the largest free", best, r)
    assignment.update(result.assignment)

    sleepers = {m.name: m.sleep_after_s is not None for m in config.models}
    devices = {}
    for d in config.devices:
        names = tuple(inst for m, _, inst in instances if assignment[inst] == d.name and m.device is not None)
        names += tuple(n for n in result.residents.get(d.name, ()) if n not in names)
        weights = sum(sizes[of_instance[n][0].name].weight_bytes for n in names)
        in_pool = sum(sizes[of_instance[n][0].name].weight_bytes for n in names
                      if sleepers[of_instance[n][0].name])  # fmt: skip  # remappable: inside the pool
        devices[d.name] = DevicePlan(d.name, d.kind, names, weights, int(mem[d.name] - weights + in_pool))
    models = {}
    for m in config.models:
        s = sizes[m.name]
        devs = tuple(assignment[instance_name(m.name, r)] for r in range(m.min_replicas))
        pool_tokens = min(devices[d].pool_budget_bytes for d in devs) // s.kv_bytes_per_token
        tokens = m.max_total_tokens or max(16, min(MAX_DEFAULT_TOTAL_TOKENS, pool_tokens))
        models[m.name] = PlacedModel(m.name, devs[0], s, footprint[m.name], tokens, devs)
    return Placement(models, devices, result)
