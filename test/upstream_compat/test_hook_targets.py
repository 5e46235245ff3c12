"""Every upstream target that memx hooks exists in the pinned SGLang with the
parameters the hook relies on, and the upstream state the hooks read is still
there. A pin bump that breaks a hook fails here."""

import inspect
import pkgutil
import re
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest

from sglang_memx.hooks import HOOK_MODULES, all_hook_specs

SPECS = all_hook_specs()


def _resolve(target: str):
    """Resolve a dotted target the way HookRegistry does, keeping static/class methods raw."""
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    if isinstance(raw, (staticmethod, classmethod)):
        return owner, raw.__func__
    return owner, getattr(owner, attr)


def test_upstream_pin_is_the_one_we_build_against():
    assert version("sglang") == "0.5.23"


def test_plugin_is_registered_as_entry_point():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("memx") == "sglang_memx.plugin:load"


def test_one_hook_module_per_subsystem_and_each_declares_hooks():
    import importlib

    assert len(set(HOOK_MODULES)) == len(HOOK_MODULES)
    for name in HOOK_MODULES:
        mod = importlib.import_module(name)
        assert mod.HOOKS, f"{name} declares no hooks"
        assert mod.__doc__ and "Upstream subsystem" in mod.__doc__


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.target)
def test_target_exists_with_expected_parameters(spec):
    _, fn = _resolve(spec.target)
    fn = inspect.unwrap(fn)
    assert callable(fn)
    params = list(inspect.signature(fn).parameters)
    assert params[: len(spec.expects)] == list(spec.expects), (
        f"{spec.target} now takes {params}, hook expects leading {spec.expects}"
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.target)
def test_hook_function_accepts_the_call_shape(spec):
    sig = inspect.signature(spec.fn)
    leading = {"before": 0, "after": 1, "around": 1, "replace": 0}[spec.kind]
    # HookRegistry calls fn(result|original?, *target_args, **target_kwargs).
    sig.bind(*([None] * (leading + len(spec.expects))))
    sig.bind(*([None] * (leading + len(spec.expects) + 3)), extra=None)


def _source(obj) -> str:
    return inspect.getsource(obj)


def test_scheduler_state_read_by_status_is_assigned_upstream():
    from sglang.srt.managers import scheduler as sched_mod
    from sglang.srt.managers.scheduler_components import pool_stats_observer

    src = Path(sched_mod.__file__).read_text()
    for attr in (
        "server_args",
        "page_size",
        "max_total_num_tokens",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "running_batch",
        "waiting_queue",
    ):
        assigned = re.search(rf"self\.{attr}\s*(:[^=\n]+)?=[^=]", src) or re.search(
            rf"\(\s*self\.{attr},", src
        )  # tuple-unpacking assignment
        assert assigned, f"Scheduler.{attr} no longer assigned"
    # Upstream's own usage formula, which kv_pool_status reproduces.
    obs = Path(pool_stats_observer.__file__).read_text()
    assert "self.max_total_num_tokens - (available_size + evictable_size)" in obs


def test_internal_state_plumbing_exists():
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin

    assert GetInternalStateReqOutput(internal_state={"a": 1}).internal_state == {"a": 1}
    assert "self.scheduler = scheduler" in _source(SchedulerInternalStateController.__init__)
    assert inspect.iscoroutinefunction(TokenizerControlMixin.get_internal_state)


def test_http_server_exposes_app_and_global_state():
    from fastapi import FastAPI
    from sglang.srt.entrypoints import http_server

    assert isinstance(http_server.app, FastAPI)
    assert callable(http_server.get_global_state)
    assert "tokenizer_manager" in http_server._GlobalState.__dataclass_fields__


def test_kv_pool_exposes_what_status_reads():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    src = _source(MHATokenToKVPool)
    for attr in ("k_buffer", "v_buffer"):
        assert f"self.{attr}" in src
    parents = "".join(_source(c) for c in MHATokenToKVPool.__mro__[1:3] if c is not object)
    for attr in ("dtype", "store_dtype", "device", "layer_num"):
        assert f"self.{attr}" in src + parents, attr


def test_server_args_record_carries_private_attributes_through_pickle():
    import pickle

    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy")
    args._memx_config = {"status_path": "/memx/status", "disabled": False}
    clone = pickle.loads(pickle.dumps(args))
    assert clone._memx_config == args._memx_config


def test_host_buffer_offload_relies_on_these_upstream_internals():
    """The prefill offload (elastic.host_buffer, hooks.scheduler) drives upstream's own pieces:
    the prefill budget's two offsets, retraction's release function, the queue entry point,
    the radix cache's lock / match / insert and the admission constants."""
    from sglang.srt.managers import schedule_batch, schedule_policy
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    budget = _source(PrefillBudget)
    for line in (
        "self.total_offset +=",
        "self.current_offset +=",
        "- self.total_offset",
        "- self.current_offset",
        "total_tokens < self.remaining_total",
    ):
        assert line in budget, line
    assert "PrefillBudget(" in _source(BaseTokenToKVPoolAllocator.create_prefill_budget)
    params = inspect.signature(schedule_batch.release_req).parameters
    assert {
        "req",
        "remaing_req_count",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "hisparse_coordinator",
        "offload_kv",
    } <= set(params)
    assert list(inspect.signature(Scheduler._add_request_to_queue).parameters) == ["self", "req", "is_retracted"]
    assert isinstance(schedule_policy.CLIP_MAX_NEW_TOKENS, int)
    from sglang.srt.mem_cache.radix_cache import RadixCache

    for name in ("lock", "unlock", "match_prefix", "insert", "evictable_size"):
        assert callable(getattr(RadixCache, name)), name
    assert issubclass(RadixCache, BasePrefixCache)
    assert "key" in MatchPrefixParams.__dataclass_fields__ and "value" in InsertParams.__dataclass_fields__
    adder = _source(schedule_policy.PrefillAdder)
    for attr in (
        "self.memory_budget =",
        "self.can_run_list",
        "self.rem_input_tokens",
        "self.rem_chunk_tokens",
        "self.running_batch",
        "self.page_size",
        "self.tree_cache",
    ):
        assert attr in adder, attr
