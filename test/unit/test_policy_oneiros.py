"""Oneiros remap policy (O2-O5): paper examples, edge cases, bad inputs."""

import pytest

from memory_ext.policy.oneiros import (
    Action,
    BufferMode,
    ModelState,
    OneirosController,
    max_feasible_alpha,
    max_layers_by_compute,
    model_limit,
    plan_layers,
    remap_order,
    unhidden_plan,
    uniform_interval_layers,
)


def _model(name, **kw):
    base = dict(n_layers=8, layer_transfer_s=1.0, compute_s=8.0, active=False, cap=4)
    base.update(kw)
    return ModelState(name=name, **base)


# ---------------------------------------------------------------- §5.4 example


def test_paper_8_layer_example_layers_1_and_5():
    # Model-C, 8 layers, one layer remapped: paper layers 1 and 5 (1-based)
    # share one slot, the other 6 stay resident. T_T = T_c: Eq. 4 is
    # 1*2 <= 1*6, so the single-slot rule applies.
    plan = plan_layers(8, 1, t_transfer=1.0, t_layer_compute=1.0)
    assert plan.feasible
    assert (plan.alpha, plan.beta, plan.m) == (1, 1, 2)
    assert [i + 1 for i in plan.shared_layers] == [1, 5]
    assert plan.resident_layers == 6
    assert plan.min_gap == 4
    # GPU holds n - alpha layers' worth: 6 resident + 1 slot
    assert plan.resident_layers + plan.beta == 8 - 1


def test_paper_8_layer_counterexample_1_and_8_has_smaller_gap():
    # Layers 1 and 8 leave a single layer of compute (the wrap-around gap) to
    # reload layer 1; uniform spacing leaves four.
    from memory_ext.policy.oneiros.layer_plan import _min_gap

    assert _min_gap(8, (0, 7)) == 1
    assert _min_gap(8, uniform_interval_layers(8, 2)) == 4


# ---------------------------------------------------------------- §7.5 example

# Reading: the paper states that for n = 40 double buffering pays off from
# alpha >= 9 "based on Equations 4 and 5" without giving T_T / T_c. Eq. 4
# holds for alpha = 8 and fails for alpha = 9 exactly when
# 3 = 30/10 < T_T/T_c <= 31/9 ~= 3.444; we test several ratios in that band.


@pytest.mark.parametrize("ratio", [3.01, 3.2, 3.44])
def test_paper_n40_crossover_at_alpha_9(ratio):
    betas = {a: plan_layers(40, a, ratio, 1.0).beta for a in range(1, 10)}
    assert all(betas[a] == 1 for a in range(1, 9))
    assert betas[9] == 2
    p9 = plan_layers(40, 9, ratio, 1.0)
    assert p9.m == 11 and len(p9.shared_layers) == 11 and p9.resident_layers == 29


def test_paper_n40_ratio_3_2_numbers():
    # T_T = 3.2, T_c = 1: Eq.4 alpha=8: 28.8 <= 31; alpha=9: 32 > 30.
    # Eq.5 alpha=9: 35.2 <= 40; alpha=10: 38.4 <= 40; alpha=11: 41.6 > 40.
    assert plan_layers(40, 8, 3.2, 1.0).beta == 1
    assert plan_layers(40, 9, 3.2, 1.0).beta == 2
    assert plan_layers(40, 10, 3.2, 1.0).beta == 2
    p11 = plan_layers(40, 11, 3.2, 1.0)
    assert not p11.feasible and p11.m == 0 and p11.shared_layers == ()
    assert "infeasible" in p11.reason
    assert max_feasible_alpha(40, 3.2, 1.0) == 10
    assert max_feasible_alpha(40, 3.2, 1.0, BufferMode.SINGLE) == 8  # config (A)
    assert max_feasible_alpha(40, 3.2, 1.0, BufferMode.DOUBLE) == 10  # config (B)
    assert plan_layers(40, 1, 3.2, 1.0, BufferMode.DOUBLE).m == 3


def test_n40_boundaries_are_inclusive():
    # ratio exactly 3: Eq. 4 at alpha=9 is 30 <= 30 (holds), crossover moves to 10
    assert plan_layers(40, 9, 3.0, 1.0).beta == 1
    assert plan_layers(40, 10, 3.0, 1.0).beta == 2
    # ratio just above 31/9: Eq. 4 fails already at alpha = 8
    assert plan_layers(40, 8, 3.45, 1.0).beta == 2


def test_uniform_interval_gaps_differ_by_at_most_one():
    layers = uniform_interval_layers(40, 11)
    gaps = [b - a for a, b in zip(layers, layers[1:])] + [layers[0] + 40 - layers[-1]]
    assert sum(gaps) == 40 and max(gaps) - min(gaps) <= 1
    assert uniform_interval_layers(8, 2, offset=1) == (1, 5)


# ---------------------------------------------------------------- O4


def test_o4_layers_by_compute():
    assert max_layers_by_compute(1.5, 10.0) == 6
    assert max_layers_by_compute(2.0, 10.0) == 5  # T_T*N == T_compute allowed
    assert max_layers_by_compute(0.1, 0.3) == 3  # float boundary kept
    assert max_layers_by_compute(11.0, 10.0) == 0


def test_model_limit_binding_rules():
    # n=8, T_T=1, T_compute=8 -> T_c=1: O4 allows 8, Eq.4 alpha<=3, Eq.5 alpha<=6
    assert model_limit(_model("a", cap=4)) == (4, "profiled cap")
    assert model_limit(_model("a", cap=100)) == (6, "O5 Eq. 4/5")
    assert model_limit(_model("a", cap=100), BufferMode.SINGLE) == (3, "O5 Eq. 4/5")
    assert model_limit(_model("a", compute_s=None)) == (0, "no T_compute measured")
    assert model_limit(_model("a", n_layers=1, compute_s=1.0)) == (0, "never a whole model")


def test_never_a_whole_model_even_with_free_transfers():
    lim, _ = model_limit(_model("a", cap=100, layer_transfer_s=1e-9))
    assert lim <= 7
    with pytest.raises(ValueError, match="alpha"):
        plan_layers(8, 8, 1e-9, 1.0)
    # alpha = n - 1 would need all n layers in one slot with zero compute slack
    assert not plan_layers(8, 7, 1e-9, 1.0).feasible


# ---------------------------------------------------------------- O3


def test_o3_phase2_lowest_priority_inactive_first():
    a = _model("A", active=True, priority=5, last_activated=10)
    b = _model("B", priority=3, last_activated=2)
    c = _model("C", priority=1, last_activated=1)
    assert remap_order([a, b, c]) == ["C", "B", "A"]


def test_o3_no_priorities_mru():
    models = [_model("X", last_activated=5), _model("Y", last_activated=9), _model("Z", active=True, last_activated=12)]
    assert remap_order(models) == ["Y", "X", "Z"]
    # all active (spatial sharing): MRU among all
    act = [_model("P", active=True, last_activated=1), _model("Q", active=True, last_activated=2)]
    assert remap_order(act) == ["Q", "P"]


# ---------------------------------------------------------------- O2 controller


def _run_to_hold(ctrl, free, models, max_steps=100):
    """Apply decisions like an engine would; return the sequence of models remapped."""
    models = {m.name: m for m in models}
    seq = []
    for _ in range(max_steps):
        ctrl.observe(free, list(models.values()))
        d = ctrl.decide()
        if d.action is Action.HOLD:
            return seq, d, models
        m = models[d.model]
        assert d.plan is not None and d.plan.feasible and d.plan.alpha == d.target_remapped
        models[d.model] = ModelState(**{**m.__dict__, "remapped": d.target_remapped})
        seq.append((d.action.value, d.model, d.target_remapped))
    raise AssertionError("controller did not settle")


def test_controller_phase2_order_and_caps():
    # Pool stays exhausted (free 0): C to its cap, then B, then active A.
    models = [
        _model("A", active=True, priority=5, cap=2, compute_s=80.0),
        _model("B", priority=3, cap=2),
        _model("C", priority=1, cap=3),
    ]
    ctrl = OneirosController(low_watermark=4, high_watermark=16)
    seq, last, final = _run_to_hold(ctrl, 0, models)
    assert [s[1] for s in seq] == ["C"] * 3 + ["B"] * 2 + ["A"] * 2
    assert {n: m.remapped for n, m in final.items()} == {"A": 2, "B": 2, "C": 3}
    assert last.action is Action.HOLD and "no model can remap further" in last.reason
    assert ctrl.remap_enabled


def test_controller_restores_in_reverse_order_and_stops():
    models = [
        _model("A", active=True, priority=5, remapped=1, blocks_per_layer=10),
        _model("C", priority=1, remapped=2, blocks_per_layer=10),
    ]
    ctrl = OneirosController(low_watermark=4, high_watermark=16)
    seq, last, final = _run_to_hold(ctrl, 100, models)
    assert seq == [("restore", "A", 0), ("restore", "C", 1), ("restore", "C", 0)]
    assert not ctrl.remap_enabled and last.reason == "KV pool within watermarks"


def test_controller_hysteresis_holds_between_watermarks():
    ctrl = OneirosController(low_watermark=4, high_watermark=16)
    ctrl.observe(20, [_model("C", priority=1, remapped=1, blocks_per_layer=10)])
    d = ctrl.decide()  # 20 - 10 < 16: giving the layer back would dip below high
    assert d.action is Action.HOLD and d.model is None
    ctrl.observe(26, [_model("C", priority=1, remapped=1, blocks_per_layer=10)])
    assert ctrl.decide().action is Action.RESTORE


def test_controller_infeasible_gives_no_remap_with_reason():
    # T_T = 10 per layer, decode step 1: no layer can be hidden
    ctrl = OneirosController(low_watermark=4, high_watermark=4)
    ctrl.observe(0, [_model("A", active=True, layer_transfer_s=10.0, compute_s=1.0), _model("B", compute_s=None)])
    d = ctrl.decide()
    assert d.action is Action.HOLD and d.plan is None
    assert "no model can remap further" in d.reason
    assert "O4" in d.reason and "no T_compute measured" in d.reason
    assert d.limits["A"][0] == 0 and d.limits["B"][0] == 0


@pytest.mark.parametrize("compute_s", [1.0, None])  # copies ten times a step; nothing measured
def test_a_starved_model_lends_past_the_hiding_bounds_with_an_unhidden_plan(compute_s):
    # requests wait and none runs: no step to slow, so only n - 1 and the cap bound alpha
    ctrl = OneirosController(low_watermark=4, high_watermark=4)
    ctrl.observe(0, [_model("A", active=True, layer_transfer_s=10.0, compute_s=compute_s, cap=7, starved=True)])
    d = ctrl.decide()
    assert d.action is Action.REMAP and d.target_remapped == 1 and d.limits["A"] == (7, "never a whole model")
    plan = d.plan
    assert plan.feasible and (plan.alpha, plan.beta, plan.m) == (1, 2, 3) and len(plan.shared_layers) == 3
    assert plan.reason.startswith("starved: no step runs to hide copies behind")
    # the same model with a request running: the bounds hold again (no further layer)
    ctrl.observe(0, [_model("A", active=True, layer_transfer_s=10.0, compute_s=compute_s, cap=7, remapped=1)])
    assert ctrl.decide().action is Action.HOLD
    # a starved model whose copies do hide keeps the paper's plan (one slot, Eq. 4)
    ctrl.observe(0, [_model("A", active=True, cap=7, starved=True)])
    assert ctrl.decide().plan.reason == "Eq. 4 (single slot) holds"


@pytest.mark.parametrize("alpha, beta", [(1, 2), (6, 2), (7, 1), (0, 0)])
def test_unhidden_plan_streams_alpha_plus_its_slots_evenly(alpha, beta):
    plan = unhidden_plan(8, alpha, "why")
    assert (plan.alpha, plan.beta, plan.m, plan.feasible) == (alpha, beta, alpha + beta, True)
    assert plan.shared_layers == (uniform_interval_layers(8, alpha + beta) if alpha else ())
    assert plan.resident_layers + plan.beta == 8 - alpha


def test_controller_limit_drop_is_no_restore_signal():
    # T_compute dropped (re-measured): alpha 5 no longer hideable, limit is 3.
    # Not in Alg. 1: the model is not remapped further, but nothing comes back
    # while its lent KV memory is in use (pool exhausted) ...
    ctrl = OneirosController(low_watermark=4, high_watermark=16, mode="single")
    ctrl.observe(0, [_model("C", cap=7, remapped=5)])
    d = ctrl.decide()
    assert d.action is Action.HOLD and d.limits["C"][0] == 3
    assert "no model can remap further" in d.reason
    # ... another model below its limit is remapped instead ...
    ctrl.observe(0, [_model("C", cap=7, remapped=5, last_activated=9), _model("D", cap=7, last_activated=1)])
    d = ctrl.decide()
    assert d.action is Action.REMAP and d.model == "D" and d.target_remapped == 1
    # ... and between the watermarks it holds: the lent layer is not empty
    ctrl.observe(20, [_model("C", cap=7, remapped=5, blocks_per_layer=10)])
    d = ctrl.decide()
    assert d.action is Action.HOLD and d.reason == "lent KV memory still in use"


def test_controller_restores_an_over_limit_model_when_its_layer_is_empty():
    ctrl = OneirosController(low_watermark=4, high_watermark=16, mode="single")
    ctrl.observe(26, [_model("C", cap=7, remapped=5, blocks_per_layer=10)])
    d = ctrl.decide()
    assert d.action is Action.RESTORE and d.target_remapped == 4 and "lent layer empty" in d.reason
    # alpha 4 is still over the limit: one layer comes back and the other four keep streaming
    # (unhidden, through two slots) instead of a plan no engine can apply but by restoring all
    assert d.plan == ctrl.restore_plan(_model("C", cap=7, remapped=5, blocks_per_layer=10), 4)
    assert d.plan.feasible and (d.plan.alpha, d.plan.beta, len(d.plan.shared_layers)) == (4, 2, 6)
    assert d.plan.reason.startswith("restore one layer: infeasible"), d.plan.reason


def test_restore_plan_is_the_o5_plan_where_it_holds_and_unhidden_where_not():
    ctrl = OneirosController(low_watermark=4, mode="single")
    fast = _model("C", remapped=2)
    assert ctrl.restore_plan(fast, 1) == ctrl._plan(fast, 1) and ctrl.restore_plan(fast, 1).feasible
    assert ctrl.restore_plan(fast, 0).alpha == 0 and ctrl.restore_plan(fast, 0).shared_layers == ()
    unmeasured = _model("C", remapped=2, compute_s=None)
    plan = ctrl.restore_plan(unmeasured, 1)
    assert plan.feasible and plan.alpha == 1 and "no T_compute measured" in plan.reason


def test_controller_default_is_alg1_without_hysteresis():
    # high watermark defaults to the low one: a layer comes back as soon as its
    # blocks are free and the pool keeps the low watermark (no re-trigger)
    ctrl = OneirosController(low_watermark=4)
    assert ctrl.high_watermark == 4
    m = _model("C", priority=1, remapped=1, blocks_per_layer=10)
    ctrl.observe(13, [m])
    assert ctrl.decide().action is Action.HOLD  # 13 - 10 < 4: would run short again at once
    ctrl.observe(14, [m])
    d = ctrl.decide()
    assert d.action is Action.RESTORE and d.target_remapped == 0
    # after the restore the pool has 4 free blocks: no remap is triggered
    ctrl.observe(4, [_model("C", priority=1, remapped=0, blocks_per_layer=10)])
    assert ctrl.decide().action is Action.HOLD and not ctrl.remap_enabled


def test_controller_restores_any_empty_lent_layer_in_reverse_order():
    # Alg. 1 "foreach tensor": A (active, restored first) lent a big layer that
    # does not fit the free blocks yet; C's small one does
    a = _model("A", active=True, priority=5, remapped=1, blocks_per_layer=50)
    c = _model("C", priority=1, remapped=1, blocks_per_layer=10)
    ctrl = OneirosController(low_watermark=4)
    ctrl.observe(30, [a, c])
    d = ctrl.decide()
    assert d.action is Action.RESTORE and d.model == "C"
    ctrl.observe(60, [a, c])
    assert ctrl.decide().model == "A"


def test_controller_reads_the_pool_that_holds_the_lent_layer():
    # the observed pool is roomy, but C's layer went to another pool that is full
    ctrl = OneirosController(low_watermark=4)
    ctrl.observe(100, [_model("C", remapped=1, blocks_per_layer=10, lent_free_blocks=5)])
    assert ctrl.decide().action is Action.HOLD
    ctrl.observe(100, [_model("C", remapped=1, blocks_per_layer=10, lent_free_blocks=14)])
    d = ctrl.decide()
    assert d.action is Action.RESTORE and "14 free blocks" in d.reason


def test_decide_before_observe():
    with pytest.raises(RuntimeError):
        OneirosController(1, 2).decide()


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: plan_layers(0, 0, 1.0, 1.0), "n_layers"),
        (lambda: plan_layers(8, -1, 1.0, 1.0), "alpha"),
        (lambda: plan_layers(8, 1, 0.0, 1.0), "t_transfer"),
        (lambda: plan_layers(8, 1, 1.0, float("nan")), "t_layer_compute"),
        (lambda: plan_layers(8, 1, 1.0, 1.0, mode="triple"), "mode"),
        (lambda: plan_layers(True, 1, 1.0, 1.0), "n_layers"),
        (lambda: uniform_interval_layers(8, 9), "m"),
        (lambda: max_layers_by_compute(1.0, -2.0), "t_compute"),
        (lambda: _model("a", cap=-1), "cap"),
        (lambda: _model("a", remapped=8), "remapped"),
        (lambda: _model("a", blocks_per_layer=0), "blocks_per_layer"),
        (lambda: _model("a", compute_s=0), "compute_s"),
        (lambda: _model("a", active=1), "active"),
        (lambda: _model("a", lent_free_blocks=-1), "lent_free_blocks"),
        (lambda: _model("a", starved=1), "starved"),
        (lambda: unhidden_plan(8, 8, "x"), "alpha"),
        (lambda: _model(""), "name"),
        (lambda: _model("a", priority="high"), "priority"),
        (lambda: remap_order([_model("a"), _model("a")]), "name"),
        (lambda: remap_order([_model("a", priority=1), _model("b")]), "priority"),
        (lambda: OneirosController(5, 4), "high_watermark"),
        (lambda: OneirosController(-1, 4), "low_watermark"),
        (lambda: OneirosController(1, 4, mode="x"), "mode"),
        (lambda: OneirosController(1, 4).observe(-3, []), "free_kv_blocks"),
        (lambda: OneirosController(1, 4).observe(3, [object()]), "models"),
    ],
)
def test_bad_inputs_name_the_field(call, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        call()
