"""Oneiros O3 (section 5.2): what the engine reports of a model, the alpha it may reach now, and
the order in which models give up layers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .._checks import check_int as _int
from ._inputs import number as _num
from ._inputs import positive as _pos
from .layer_plan import BufferMode, max_feasible_alpha, max_layers_by_compute


@dataclass(frozen=True)
class ModelState:
    """What the engine reports about one model at one step.

    name            unique id
    n_layers        decoder layers
    layer_transfer_s  T_T, profiled CPU->GPU time of one layer
    compute_s       T_compute measured at run time: decode step if
                    ``active``, prefill if inactive; None = not measured yet
                    (then the model is not remapped further)
    active          currently generating tokens
    cap             profiled per-model maximum of remapped layers; clamped to
                    n_layers - 1 (never a whole model)
    remapped        alpha currently applied by the engine
    blocks_per_layer  KV blocks gained by releasing one layer's weights
    priority        scheduler priority, larger = more important (remapped
                    later); None = scheduler gave none
    last_activated  time/sequence of the model's latest activation (MRU)
    lent_free_blocks  KV blocks not in use (free, or holding only
                    unreferenced prefix cache) of the pool that holds this
                    model's most recently lent layer; None = that pool is the
                    observed one, read ``free_kv_blocks`` (the restore rule,
                    Alg. 1 l. 6-12)
    starved         requests wait for KV and none of this model's runs: no
                    step runs that copies could slow, so the hiding bounds
                    (O4, O5) do not bind (a head that fits only with layers
                    lent would otherwise wait for ever); the plan then streams
                    through two slots whether or not Eq. 4/5 hold
    """

    name: str
    n_layers: int
    layer_transfer_s: float
    compute_s: float | None
    active: bool
    cap: int
    remapped: int = 0
    blocks_per_layer: int = 1
    priority: float | None = None
    last_activated: float = 0.0
    lent_free_blocks: int | None = None
    starved: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        _int("n_layers", self.n_layers, 1)
        _pos("layer_transfer_s", self.layer_transfer_s)
        if self.compute_s is not None:
            _pos("compute_s", self.compute_s)
        if not isinstance(self.active, bool):
            raise ValueError(f"active must be a bool, got {self.active!r}")
        _int("cap", self.cap, 0)
        _int("remapped", self.remapped, 0)
        if self.remapped >= self.n_layers:
            raise ValueError(f"remapped must be < n_layers ({self.n_layers}), got {self.remapped}")
        _int("blocks_per_layer", self.blocks_per_layer, 1)
        if self.priority is not None:
            _num("priority", self.priority)
        _num("last_activated", self.last_activated)
        if self.lent_free_blocks is not None:
            _int("lent_free_blocks", self.lent_free_blocks, 0)
        if not isinstance(self.starved, bool):
            raise ValueError(f"starved must be a bool, got {self.starved!r}")


def model_limit(model: ModelState, mode: BufferMode = BufferMode.AUTO) -> tuple[int, str]:
    """Largest alpha allowed for ``model`` now, and which rule bounds it.

    limit = min(n - 1, cap, O4 bound, O5 bound) with T_c = T_compute / n; a starved model's
    limit is min(n - 1, cap) (no step runs that the copies could slow).
    """
    bounds = [(model.n_layers - 1, "never a whole model"), (model.cap, "profiled cap")]
    if not model.starved:
        bounds += _hiding_bounds(model, mode)
    return min(bounds, key=lambda b: b[0])


def _hiding_bounds(model: ModelState, mode: BufferMode) -> list[tuple[int, str]]:
    """O4 and O5: the layers whose copies hide behind the measured compute (none unmeasured)."""
    if model.compute_s is None:
        return [(0, "no T_compute measured")]
    t_layer = model.compute_s / model.n_layers
    return [
        (max_layers_by_compute(model.layer_transfer_s, model.compute_s), "O4 T_T*N <= T_compute"),
        (max_feasible_alpha(model.n_layers, model.layer_transfer_s, t_layer, mode), "O5 Eq. 4/5"),
    ]


def remap_order(models: Iterable[ModelState]) -> list[str]:
    """O3 (section 5.2): the order in which models give up layers.

    Inactive models first, then active ones (inactive-before-active holds
    even without priorities; see the reading note below). Within each group:
    if every model of the group has a priority, lowest priority first (ties:
    most recently activated first); if none has one, most recently activated
    first (MRU, the round-robin default). A group mixing priorities and None
    raises ValueError. Remaining ties break by name, so the order is total.

    Reading: section 5.2 says "if the scheduler does not specify priorities
    or all models are active ... round-robin with MRU". Taken literally MRU
    over all models would pick the running model first, contradicting the
    section's first rule (inactive before active). We keep inactive-first and
    apply MRU inside each group. The round robin itself is the scheduler's
    serving order; MRU is the controller's consequence of it.
    """
    models = list(models)
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"name must be unique per model, got {names}")
    order: list[str] = []
    for group in ([m for m in models if not m.active], [m for m in models if m.active]):
        given = [m.priority is not None for m in group]
        if any(given) and not all(given):
            raise ValueError("priority must be given for all models of a group or for none")
        if group and all(given):
            key = lambda m: (m.priority, -m.last_activated, m.name)  # noqa: E731
        else:
            key = lambda m: (-m.last_activated, m.name)  # noqa: E731
        order += [m.name for m in sorted(group, key=key)]
    return order
