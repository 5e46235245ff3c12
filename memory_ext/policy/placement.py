"""FineServe F3: global placement of model instances on GPUs (Algorithm 1, Eq. 3 of section 6.2).

``place_models`` sorts instances by base footprint F_M (descending) and gives each the
feasible candidate with the highest Eq. 3 score; the router (``sglang_memx.serve.placement``)
and the simulator call this same function. Plain numbers in, decisions out; only stdlib.

Invariants: a placed instance's F_M fits its candidate after every earlier placement
(``k_rem >= 0``); an instance no candidate can hold is in ``unplaced``, never assigned.
Readings of the paper where it is not explicit are marked "READING:".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from ._checks import check_name as _name
from ._checks import check_num as _num

__all__ = [
    "ModelDemand",
    "GpuCandidate",
    "CandidateScore",
    "PlacementResult",
    "PlacementInfeasible",
    "placement_score",
    "place_models",
]


@dataclass(frozen=True)
class ModelDemand:
    """A model instance to place. ``base_footprint`` is F_M (bytes: weights +
    profiled average activations + KV); ``mu`` its profiled marginal memory
    efficiency (generated tokens per byte of extra KV, any consistent unit).
    DP replicas are passed as separate ModelDemand entries (paper §6.2)."""

    name: str
    base_footprint: float
    mu: float

    def __post_init__(self):
        _name("name", self.name)
        _num("base_footprint", self.base_footprint, 0.0)
        _num("mu", self.mu, 0.0)


@dataclass(frozen=True)
class GpuCandidate:
    """A placement candidate (one GPU, or one TP group); ``total_memory`` = T_G."""

    name: str
    total_memory: float

    def __post_init__(self):
        _name("name", self.name)
        _num("total_memory", self.total_memory, 0.0, strict=True)


@dataclass(frozen=True)
class CandidateScore:
    gpu: str
    feasible: bool
    k_rem: float  # K_rem(G') after charging M
    mean_mu: float  # mean mu over G'
    score: float  # mean_mu * k_rem, or -inf when infeasible


@dataclass(frozen=True)
class PlacementResult:
    order: tuple[str, ...]  # models in placement order (F_M desc)
    assignment: dict[str, str]  # model -> gpu, placed models only
    residents: dict[str, tuple[str, ...]]  # gpu -> models, in placement order
    k_rem: dict[str, float]  # gpu -> contested memory left
    unplaced: tuple[str, ...]  # models no candidate could hold
    scores: dict[str, tuple[CandidateScore, ...]] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return not self.unplaced

    def raise_if_infeasible(self) -> PlacementResult:
        if self.unplaced:
            raise PlacementInfeasible(self.unplaced)
        return self


class PlacementInfeasible(RuntimeError):
    def __init__(self, unplaced: Sequence[str]):
        self.unplaced = tuple(unplaced)
        super().__init__(f"no candidate GPU can hold base footprint of: {', '.join(self.unplaced)}")


MuFn = Callable[[str, tuple[str, ...]], float]
_NO_GROUP = object()  # the spread group of an instance that has none (equal to nothing)


def placement_score(
    total_memory: float,
    resident_footprints: Sequence[float],
    resident_mus: Sequence[float],
    new_footprint: float,
    new_mu: float,
) -> tuple[bool, float, float, float]:
    """Eq. 3 for one candidate: returns (feasible, k_rem, mean_mu, score).

    score(G|M) = (1/|G'|) * sum_{m in G'} mu_m * K_rem(G'), where G' = G + M
    and K_rem(G') = T_G - sum_{m in G'} F_m.

    READING: Alg. 1 line 5 writes K_rem(G) over the current residents, but
    Eq. 3 and its text use K_rem(G') "after charging base footprints"; we
    follow Eq. 3 (M's own F_M is charged). A candidate whose K_rem(G') < 0
    is infeasible (the paper requires placements within memory budgets);
    K_rem(G') == 0 is feasible with score 0.
    """
    _num("total_memory", total_memory, 0.0, strict=True)
    _num("new_footprint", new_footprint, 0.0)
    _num("new_mu", new_mu, 0.0)
    if len(resident_footprints) != len(resident_mus):
        raise ValueError("resident_footprints and resident_mus must have equal length")
    fs = [_num("resident_footprints", f, 0.0) for f in resident_footprints] + [new_footprint]
    mus = [_num("resident_mus", m, 0.0) for m in resident_mus] + [new_mu]
    k_rem = total_memory - sum(fs)
    mean_mu = sum(mus) / len(mus)
    if k_rem < 0:
        return False, k_rem, mean_mu, -math.inf
    return True, k_rem, mean_mu, mean_mu * k_rem


def place_models(
    models: Sequence[ModelDemand],
    gpus: Sequence[GpuCandidate],
    mu_fn: MuFn | None = None,
    spread: Mapping[str, Hashable] | None = None,
) -> PlacementResult:
    """Algorithm 1. Models sorted by F_M descending (ties keep input order);
    each goes to the feasible candidate with the highest Eq. 3 score (ties go
    to the earlier candidate in ``gpus``). A model no candidate can hold is
    listed in ``unplaced`` and placement continues with the next model.

    ``mu_fn(model_name, group_names)`` may supply mu_m(G') when the profile
    depends on the co-located set; otherwise each model's ``mu`` is used.

    ``spread`` (instance name -> group, e.g. the DP replicas of one model, which
    §6.2 places as separate instances): a feasible candidate holding no instance
    of the same group beats one that does, whatever their scores; among equals
    Eq. 3 decides. With one candidate, or when every feasible candidate already
    holds a sibling, replicas co-locate. Instances not in ``spread`` are unaffected.
    """
    models = list(models)
    gpus = list(gpus)
    if not gpus:
        raise ValueError("gpus must name at least one candidate")
    for m in models:
        if not isinstance(m, ModelDemand):
            raise ValueError(f"models must hold ModelDemand, got {m!r}")
    for g in gpus:
        if not isinstance(g, GpuCandidate):
            raise ValueError(f"gpus must hold GpuCandidate, got {g!r}")
    if len({m.name for m in models}) != len(models):
        raise ValueError("models names must be unique")
    if len({g.name for g in gpus}) != len(gpus):
        raise ValueError("gpus names must be unique")

    by_name = {m.name: m for m in models}
    spread = dict(spread or {})

    def apart(name: str, gpu: str) -> bool:
        """True when ``gpu`` holds no other instance of ``name``'s spread group."""
        if name not in spread:
            return True
        return all(spread.get(r, _NO_GROUP) != spread[name] for r in residents[gpu])

    def mu_of(name: str, group: tuple[str, ...]) -> float:
        if mu_fn is None:
            return by_name[name].mu
        return _num(f"mu_fn({name!r})", mu_fn(name, group), 0.0)

    ordered = sorted(models, key=lambda m: -m.base_footprint)  # stable
    residents: dict[str, list[str]] = {g.name: [] for g in gpus}
    assignment: dict[str, str] = {}
    unplaced: list[str] = []
    all_scores: dict[str, tuple[CandidateScore, ...]] = {}

    for m in ordered:
        best: CandidateScore | None = None
        row = []
        for g in gpus:
            group = tuple(residents[g.name]) + (m.name,)
            ok, k_rem, mean_mu, score = placement_score(
                g.total_memory,
                [by_name[r].base_footprint for r in residents[g.name]],
                [mu_of(r, group) for r in residents[g.name]],
                m.base_footprint,
                mu_of(m.name, group),
            )
            cs = CandidateScore(g.name, ok, k_rem, mean_mu, score)
            row.append(cs)
            if ok and (best is None or (apart(m.name, cs.gpu), cs.score) > (apart(m.name, best.gpu), best.score)):
                best = cs
        all_scores[m.name] = tuple(row)
        if best is None:
            unplaced.append(m.name)
            continue
        residents[best.gpu].append(m.name)
        assignment[m.name] = best.gpu

    k_left = {g.name: g.total_memory - sum(by_name[r].base_footprint for r in residents[g.name]) for g in gpus}
    return PlacementResult(
        order=tuple(m.name for m in ordered),
        assignment=assignment,
        residents={k: tuple(v) for k, v in residents.items()},
        k_rem=k_left,
        unplaced=tuple(unplaced),
        scores=all_scores,
    )
