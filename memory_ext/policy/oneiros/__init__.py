"""Oneiros remapping controller (features O2-O5) as a plain policy object.

Numbers in, decisions out: this module never touches memory, tensors or an
engine. The engine reports KV-pool occupancy and per-model timings with
``OneirosController.observe`` and applies the ``RemapDecision`` returned by
``OneirosController.decide``; it reports the applied state back on the next
``observe``. Standard library only.

Paper: "Oneiros: parameter remapping" (shared/seeds), sections 5.1-5.5, 7.5.

Vocabulary (paper symbols):
  n        layers of a model (all layers identical, paper footnote 4)
  alpha    remapped layers: their weight memory is lent to the KV cache
  beta     GPU slots (one layer each) shared by the rotating layers
  m        layers transferred CPU->GPU per token, m = alpha + beta
  T_T      transfer time of one layer, profiled offline
  T_c      compute time of one layer = T_compute / n
  T_compute  measured run time of one pass: a decode step for an active
           model, a prefill for an inactive one (section 5.3)

Invariants enforced everywhere:
  * 0 <= alpha <= n - 1: no model is ever remapped in its entirety;
  * alpha <= the model's profiled cap;
  * a REMAP is only ever offered if its plan's timing condition (Eq. 4 or
    Eq. 5) holds, or the model is starved (requests wait, none runs: no step
    to slow); otherwise the answer is "no remap" with a reason. A RESTORE
    carries the plan for the alpha left, which is infeasible (``feasible``
    False, with a reason) when the model's limit fell below it since.

Modules: ``layer_plan`` (O4, O5), ``models`` (O3), ``controller`` (O2); this package re-exports
their public names.
"""

from .controller import Action, OneirosController, RemapDecision
from .layer_plan import (
    BufferMode,
    LayerPlan,
    max_feasible_alpha,
    max_layers_by_compute,
    plan_layers,
    unhidden_plan,
    uniform_interval_layers,
)
from .models import ModelState, model_limit, remap_order

__all__ = [
    "BufferMode",
    "Action",
    "LayerPlan",
    "ModelState",
    "RemapDecision",
    "OneirosController",
    "max_layers_by_compute",
    "uniform_interval_layers",
    "plan_layers",
    "unhidden_plan",
    "max_feasible_alpha",
    "model_limit",
    "remap_order",
]
