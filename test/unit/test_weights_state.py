"""The server-side weights state and controller glue, without a server: the profile flag's
checks, T_T from the profile, the TBT cap through IntervalManager."""

from __future__ import annotations

import json

import pytest
import torch

from memory_ext.policy.layer_profile import LayerProfile
from memory_ext.pool import ChunkPool
from memory_ext.vmm import host_backend
from memory_ext.weights import LayerPipeline, WeightStore
from sglang_memx.config import MemxConfigError
from sglang_memx.weights.attach import load_profile
from sglang_memx.weights.remap import tbt_cap
from sglang_memx.weights.state import WeightsState


def _profile(n_layers=8, layer_bytes=1 << 20, bw=1e9, t_c=1e-3) -> LayerProfile:
    return LayerProfile(model="m", device="cpu", dtype="float32", n_layers=n_layers, layer_bytes=layer_bytes,
                        link_bytes_per_s=bw, decode_layer_s={1: t_c, 8: 2 * t_c}, prefill_layer_s_per_token=1e-5,
                        seq_len=32, measured_at="2026-11-25T00:00:00+00:00", command="sglang-memx profile")  # fmt: skip


def _state(n_layers=8, **kw) -> WeightsState:
    store = WeightStore(ChunkPool(host_backend(1 << 16), 64))
    for i in range(n_layers):
        store.add_layer(i, [torch.zeros(1000)])
    return WeightsState("remap", store, LayerPipeline(store, list(range(n_layers))), list(range(n_layers)),
                        layer_bytes=1 << 20, link_bytes_per_s=1e9, **kw)  # fmt: skip


def test_profile_of_another_model_or_broken_file_is_refused_naming_the_flag(tmp_path):
    good = tmp_path / "p.json"
    _profile().save(good)
    assert load_profile(str(good), 8).n_layers == 8
    with pytest.raises(MemxConfigError, match="--memx-weights-profile.*profiles 8 decoder layers.*has 30"):
        load_profile(str(good), 30)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "memx.layer_profile/1", "model": "x"}))
    with pytest.raises(MemxConfigError, match="--memx-weights-profile.*layer profile field"):
        load_profile(str(bad), 8)
    with pytest.raises(MemxConfigError, match="--memx-weights-profile"):
        load_profile(str(tmp_path / "missing.json"), 8)


def test_transfer_time_comes_from_the_profile_when_given():
    w = _state()
    assert w.layer_transfer_s == pytest.approx((1 << 20) / 1e9)
    w.profile = _profile(bw=2e9)
    assert w.layer_transfer_s == pytest.approx((1 << 20) / 2e9)


def test_tbt_cap_follows_the_interval_manager():
    w = _state(tbt_slo_s=None)
    assert tbt_cap(w) == 7  # no SLO: never a whole model
    w = _state(tbt_slo_s=0.1)
    assert tbt_cap(w) == 0  # nothing measured yet: nothing lent
    w.decode_layer_s, w.decode_step_s = 1e-3, 8e-3
    # T_T ~1.05 ms, two slots: m layers take max(8 ms, m T_T) <= 100 ms -> all 8 stream; lend 8 - 2
    assert tbt_cap(w) == 6
    w.tbt_slo_s = 0.0085  # 8 layers of compute + a little: m T_T <= 8.5 ms -> 8 layers... minus slots
    assert tbt_cap(w) == 6
    w.tbt_slo_s = 0.005  # compute alone misses the SLO: nothing may stream
    assert tbt_cap(w) == 0
    w.tbt_slo_s, w.profile = 0.1, _profile(bw=1e8)  # slow link: 10.5 ms a layer -> 9 fit, capped at n - 1
    assert tbt_cap(w) == 6
    w.tbt_slo_s = 0.05  # 4 layers' copies within 50 ms: lend 4 - 2
    assert tbt_cap(w) == 2


def test_a_model_not_shaped_like_llama_cannot_be_hooked():
    from sglang_memx.upstream.model import NotHookable, decoder_layers

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])

    class LlamaLike(torch.nn.Module):
        start_layer, end_layer = 1, 3

        def __init__(self):
            super().__init__()
            self.model = Body()

    assert [i for i, _ in decoder_layers(LlamaLike())] == [1, 2]
    with pytest.raises(NotHookable, match="Linear is not shaped like LlamaForCausalLM"):
        decoder_layers(torch.nn.Linear(2, 2))
    odd = LlamaLike()
    odd.model.layers = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(NotHookable, match="not a ModuleList"):
        decoder_layers(odd)


def test_admission_closed_at_the_request_limit_is_no_kv_pressure():
    """Upstream closes admission both for want of KV and at --max-running-requests; only the
    first is Oneiros's signal (a release would not admit anyone at the request limit)."""
    from sglang_memx.weights.remap import admission_denied
    from support.fakes import FakeScheduler

    def scheduler(max_running):
        s = FakeScheduler(waiting=[object()], running=[object(), object()], max_running=max_running)
        s.running_batch.batch_is_full = True
        return s

    assert admission_denied(scheduler(max_running=4))
    assert not admission_denied(scheduler(max_running=2))
    open_ = scheduler(max_running=4)
    open_.running_batch.batch_is_full = False
    assert not admission_denied(open_)


def test_on_cpu_the_copies_add_to_the_step_and_lend_fewer_layers():
    """A CPU device's copies take the compute's cores: m streamed layers cost 8 ms + m T_T, not
    max(8 ms, m T_T) as beside a GPU's copy engine, so the same SLO lends fewer layers."""
    t_tr = (1 << 20) / 1e9  # ~1.05 ms a layer
    overlapped = _state(tbt_slo_s=0.0125)
    shared = _state(tbt_slo_s=0.0125, copies_share_compute=True)
    for w in (overlapped, shared):
        w.decode_layer_s, w.decode_step_s = 1e-3, 8e-3
    assert tbt_cap(overlapped) == 6  # max(8, 8 * 1.05) = 8.4 ms: all 8 stream, lend 8 - 2
    m = int((0.0125 - 0.008) / t_tr)  # 4 copies fit in the 4.5 ms left after the compute
    assert m == 4 and tbt_cap(shared) == m - 2
    shared.tbt_slo_s = 0.0085  # room for no copy beside the compute: nothing lent
    assert tbt_cap(shared) == 0
    assert shared.status()["copies_share_compute"] is True and overlapped.status()["copies_share_compute"] is False


@pytest.mark.parametrize(
    "tbt,tpot,env,want",
    [(None, None, {}, (None, None)),  # no SLO: Oneiros lends as the paper does
     (40.0, None, {}, (40.0, "--memx-tbt-slo-ms")),
     (None, 80.0, {}, (80.0, "--memx-tpot-slo-ms")),  # the governor's TPOT SLO bounds a step too
     (None, 80.0, {"SGLANG_MEMX_TPOT_SLO_SOURCE": "m.yaml: models[0].tpot_slo_ms"},
      (80.0, "m.yaml: models[0].tpot_slo_ms")),
     (40.0, 80.0, {}, (40.0, "--memx-tbt-slo-ms"))],  # the per-step SLO given for the weights wins
)  # fmt: skip
def test_the_step_slo_is_the_tbt_flag_else_the_governors_tpot(monkeypatch, tbt, tpot, env, want):
    from types import SimpleNamespace

    from sglang_memx.weights.attach import step_slo

    monkeypatch.delenv("SGLANG_MEMX_TPOT_SLO_SOURCE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert step_slo(SimpleNamespace(tbt_slo_ms=tbt, tpot_slo_ms=tpot)) == want


def test_a_starved_queue_is_not_held_to_the_step_slo():
    """Nothing runs and requests wait: no step runs at all, so the SLO cap (0 here: compute alone is
    over it) gives way to the controller's own limit; with a request running it holds again."""
    from types import SimpleNamespace

    from memory_ext.policy.oneiros import model_limit
    from sglang_memx.weights.remap import model_state, starved
    from support.fakes import FakeReq, FakeScheduler

    w = _state(tbt_slo_s=1e-5)
    w.decode_layer_s, w.decode_step_s = 1e-3, 8e-3
    kv = SimpleNamespace(buffers=SimpleNamespace(chunks_per_group=1))
    waiting_only = FakeScheduler(waiting=[FakeReq()])
    waiting_only.last_batch = None
    running = FakeScheduler(waiting=[FakeReq()], running=[FakeReq()])
    idle = FakeScheduler()
    idle.last_batch = None
    assert (starved(waiting_only), starved(running), starved(idle)) == (True, False, False)
    assert model_state(w, kv, None, True, starving=False).cap == 0
    assert model_state(w, kv, None, True, starving=True).cap == 7
    # copies far slower than a step (the hiding bounds would allow no layer): starved, the state
    # says so and the controller's limit is n - 1 (CI: a head that fit only with layers lent
    # waited past its 300 s timeout under load)
    w.link_bytes_per_s = w.layer_bytes / 1.0  # one layer's copy: a second (nothing copied yet)
    assert w.layer_transfer_s == pytest.approx(1.0)
    busy, hungry = model_state(w, kv, None, True), model_state(w, kv, None, True, starving=True)
    assert (busy.starved, hungry.starved) == (False, True)
    assert model_limit(busy)[0] == 0 and model_limit(hungry) == (7, "never a whole model")


def test_a_restore_past_the_hiding_bounds_gives_back_one_layer(monkeypatch):
    """Layers lent while a head starved (copies a step cannot hide), the head served: the lent
    memory is empty, so the controller restores, but no plan for one layer fewer meets Eq. 4/5.
    The restore gives back one layer (the rest still stream through two slots) instead of asking
    for every layer at once, which waits until all of them fit."""
    from types import SimpleNamespace

    from memory_ext.policy.oneiros import Action
    from sglang_memx.weights import remap
    from support.fakes import FakeScheduler

    w = _state()
    w.decode_layer_s, w.decode_step_s, w.prefill_step_s = 1e-3, 8e-3, 8e-3
    w.link_bytes_per_s = w.layer_bytes / 1.0  # a layer's copy: a second
    w.store.set_streamed([0, 2, 4, 6, 7], 2)  # 3 layers lent, 5 rotating through 2 slots
    assert w.alpha == 3
    kv = SimpleNamespace(buffers=SimpleNamespace(chunks_per_group=1))
    monkeypatch.setattr(remap, "free_kv_groups", lambda *args: 100)  # nothing waits, the lent memory is empty
    idle = FakeScheduler()
    idle.last_batch = None
    action, streamed, slots = remap.decide(w, kv, None, None, idle, None, None, busy=False)
    assert action is Action.RESTORE and (len(streamed), slots) == (4, 2), (streamed, slots, w.last_reason)
    assert w.last_reason.startswith("lent layer empty")


def test_a_deeper_prefetch_streams_the_controllers_plan(monkeypatch):
    """``--memx-prefetch-depth 3``: the controller plans in DOUBLE mode (``buffer_mode``), the layers
    streamed are its plan's, and they rotate through the 3 slots asked for. Here no step is
    measured yet and the head starves, so its plan is the unhidden one (no timing condition)."""
    from types import SimpleNamespace

    from memory_ext.policy.oneiros import Action, BufferMode, unhidden_plan
    from sglang_memx.weights import remap
    from support.fakes import FakeReq, FakeScheduler

    w = _state(depth=3)
    kv = SimpleNamespace(buffers=SimpleNamespace(chunks_per_group=1))
    monkeypatch.setattr(remap, "free_kv_groups", lambda *args: 0)  # the head waits for KV
    head_waits = FakeScheduler(waiting=[FakeReq()])
    head_waits.last_batch = None
    assert w.decode_step_s is None and w.prefill_step_s is None
    action, streamed, slots = remap.decide(w, kv, None, None, head_waits, None, None, busy=False)
    assert action is Action.REMAP, w.last_reason
    assert w.controller.mode is BufferMode.DOUBLE
    plan = w.controller.decide().plan
    assert plan.reason.startswith("starved") and plan.alpha == 1
    assert streamed == [w.layer_keys[j] for j in unhidden_plan(w.n_layers, 1, "").shared_layers] == [0, 2, 5]
    assert slots == 3
