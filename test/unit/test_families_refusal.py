"""Served shapes memx refuses (issue 28 item 5): a KV pool elastic KV does not back (the hybrid
linear-attention pool), the flags not written for the MLA pool and for a hybrid sliding-window model's
SWAKVPool, and tensor / pipeline parallel size above 1, refused naming the flag, the model class and
the pool class; in the launcher (upstream's real parser, a checkpoint's
config.json) and when a scheduler's KV configurator opens the pool build. Gemma2's decoder layers
are found without start_layer / end_layer."""

from __future__ import annotations

import argparse
import json
import threading
from types import SimpleNamespace

import pytest
import torch

sglang_server_args = pytest.importorskip("sglang.srt.server_args")

from sglang_memx.config import MemxConfig, MemxConfigError, add_memx_arguments  # noqa: E402
from sglang_memx.coordinator import pool_build  # noqa: E402
from sglang_memx.families import ServedShape, check_served_shape, pool_class_for  # noqa: E402
from sglang_memx.hooks.server_args import _validating_parse_args, check_namespace  # noqa: E402
from sglang_memx.upstream.server_args import CONFIG_ATTR  # noqa: E402

ON = MemxConfig(elastic_kv=True)


def _refusal(config, shape) -> str:
    with pytest.raises(MemxConfigError) as info:
        check_served_shape(config, shape)
    assert info.value.flag == "--memx-elastic-kv"
    return str(info.value)


def test_one_mha_pool_at_parallel_size_one_is_served():
    check_served_shape(ON, ServedShape("Gemma2ForCausalLM", "MHATokenToKVPool"))
    check_served_shape(ON, ServedShape("LlamaForCausalLM", None))  # pool not known yet: the build checks


def test_without_elastic_kv_nothing_is_refused():
    for config in (MemxConfig(), MemxConfig(disabled=True)):
        check_served_shape(config, ServedShape("MellumForCausalLM", "SWAKVPool", tp_size=2))


def test_on_the_cpu_the_hybrid_sliding_window_pool_is_refused_with_upstreams_reason():
    msg = _refusal(ON, ServedShape("MellumForCausalLM", "SWAKVPool", device="cpu"))
    assert msg.startswith("argument --memx-elastic-kv: MellumForCausalLM is served from upstream's SWAKVPool")
    assert "reads the sliding-window sub-pool at full-pool slots" in msg and "--disable-hybrid-swa-memory" in msg


def test_the_hybrid_sliding_window_pool_serves_elastic_kv_and_refuses_the_rest_naming_flag_model_and_pool():
    check_served_shape(ON, ServedShape("MellumForCausalLM", "SWAKVPool"))
    check_served_shape(MemxConfig(elastic_kv=True, pool_budget_gb=0.5, chunk_kb=4), ServedShape("M", "SWAKVPool"))
    for config, flag in (
        (MemxConfig(elastic_kv=True, host_buffer_gb=1.0, ttft_slo_ms=500.0, tpot_slo_ms=50.0), "--memx-host-buffer-gb"),
        (MemxConfig(elastic_kv=True, pool="dev0"), "--memx-pool"),
    ):
        with pytest.raises(MemxConfigError) as info:
            check_served_shape(config, ServedShape("MellumForCausalLM", "SWAKVPool"))
        msg = str(info.value)
        assert info.value.flag == flag and msg.startswith(
            f"argument {flag}: MellumForCausalLM is served from upstream's SWAKVPool (a full-attention and a sliding"
        )
        assert "not written for two KV spaces yet" in msg and f"; run without {flag}" in msg


def test_tensor_parallel_runs_elastic_kv_and_refuses_the_rest_naming_flag_model_and_pool():
    check_served_shape(ON, ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=2))
    check_served_shape(MemxConfig(elastic_kv=True, pool_budget_gb=0.5, chunk_kb=4),
                       ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=4))  # fmt: skip
    agreed = MemxConfig(elastic_kv=True, pool_budget_gb=0.5, host_buffer_gb=1.0, ttft_slo_ms=500.0, tpot_slo_ms=50.0,
                        weights="remap")  # fmt: skip
    check_served_shape(agreed, ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=2))
    # a shared pool runs (the ranks agree on it), with the host buffer and the governor
    check_served_shape(MemxConfig(elastic_kv=True, pool="dev0", host_buffer_gb=1.0, tpot_slo_ms=50.0),
                       ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=2))  # fmt: skip
    config = MemxConfig(elastic_kv=True, pool="dev0", peer_kv="borrow", host_buffer_gb=1.0)
    with pytest.raises(MemxConfigError) as info:
        check_served_shape(config, ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=2))
    assert info.value.flag == "--memx-peer-kv"
    msg = str(info.value)
    assert "LlamaForCausalLM at tensor parallel size 2 builds one MHATokenToKVPool per rank" in msg
    assert "rank must schedule the same batch; --memx-peer-kv decides from what one rank measures" in msg
    assert msg.endswith("run with --tp 1 or without --memx-peer-kv")  # the pool and the host buffer run
    # remappable weights run on a shared pool too (a restore borrows in the ranks' tick); sleep does not
    check_served_shape(MemxConfig(elastic_kv=True, pool="dev0", weights="remap"),
                       ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=2))  # fmt: skip
    with pytest.raises(MemxConfigError) as info:
        check_served_shape(MemxConfig(elastic_kv=True, pool="dev0", weights="remap", sleep_after_s=30.0),
                           ServedShape("LlamaForCausalLM", "MHATokenToKVPool", tp_size=2))  # fmt: skip
    assert info.value.flag == "--memx-sleep-after-s" and "a sleeping model's wake-up" in str(info.value)
    for shape in (ServedShape("LlamaForCausalLM", None, pp_size=3), ServedShape("LlamaForCausalLM", None, 2, 2)):
        msg = _refusal(ON, shape)
        assert "at pipeline parallel size" in msg and "needs --pp 1" in msg
    # the pool class is still checked at --tp 2
    assert "served from upstream's HybridLinearKVPool" in _refusal(ON, ServedShape("Q", "HybridLinearKVPool", 2))


def test_the_flags_that_need_elastic_kv_are_named_with_it():
    config = MemxConfig(elastic_kv=True, pool_budget_gb=1.0, weights="static", weights_streamed=0.5)
    msg = _refusal(config, ServedShape("Qwen3NextForCausalLM", "HybridLinearKVPool"))
    assert "(and with it --memx-pool-budget-gb, --memx-weights, --memx-weights-streamed)" in msg


@pytest.mark.parametrize(
    "traits,pool",
    [({"hybrid_swa": True, "mla": True}, "SWAKVPool"), ({"hybrid_swa": False, "mla": True}, "MLATokenToKVPool"),
     ({"hybrid_swa": False, "linear": True}, "HybridLinearKVPool"), ({"hybrid_swa": False}, "MHATokenToKVPool")],
)  # fmt: skip
def test_pool_class_for(traits, pool):
    assert pool_class_for(**traits) == pool


# ------------------------------------------------------------------ the launcher, on upstream's parser
def _parser():
    parser = argparse.ArgumentParser()
    sglang_server_args.ServerArgs.add_cli_args(parser)
    add_memx_arguments(parser)
    return parser


def _checkpoint(tmp_path, architecture, **fields):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **fields}))
    return str(tmp_path)


def _check(argv):
    return check_namespace(_parser().parse_args(argv))


def test_the_launcher_serves_elastic_kv_on_a_hybrid_swa_checkpoint_on_a_gpu_only(tmp_path):
    model = _checkpoint(tmp_path, "MellumForCausalLM", layer_types=["sliding_attention", "full_attention"])
    gpu = ["--model-path", model, "--device", "cuda", "--memx-elastic-kv"]
    assert _check(gpu + ["--memx-pool-budget-gb", "1"]).elastic_kv
    with pytest.raises(MemxConfigError, match="MellumForCausalLM is served from upstream's SWAKVPool") as e:
        _check(gpu + ["--memx-pool", "dev0"])
    assert e.value.flag == "--memx-pool"
    with pytest.raises(MemxConfigError, match="at full-pool slots") as e:
        _check(["--model-path", model, "--device", "cpu", "--memx-elastic-kv"])
    assert e.value.flag == "--memx-elastic-kv"
    _check(["--model-path", model])  # no memx KV feature: upstream's business
    _check(["--model-path", model, "--memx-elastic-kv", "--disable-hybrid-swa-memory"])  # one full-length pool


def test_the_launcher_serves_gemma2_whose_window_is_a_mask(tmp_path):
    model = _checkpoint(tmp_path, "Gemma2ForCausalLM", layer_types=["sliding_attention", "full_attention"])
    assert _check(["--model-path", model, "--memx-elastic-kv"]).elastic_kv


def test_the_launcher_serves_elastic_kv_at_tensor_parallel_two_and_refuses_the_rest(tmp_path):
    model = _checkpoint(tmp_path, "LlamaForCausalLM")
    assert _check(["--model-path", model, "--tp", "2", "--memx-elastic-kv", "--memx-pool-budget-gb", "1"]).elastic_kv
    assert _check(["--model-path", model, "--tp", "2", "--memx-elastic-kv", "--memx-pool-budget-gb", "1",
                   "--memx-weights", "remap", "--memx-tpot-slo-ms", "50"]).governed  # fmt: skip
    assert _check(["--model-path", model, "--tp", "2", "--memx-elastic-kv", "--memx-pool", "dev0"]).pool == "dev0"
    assert _check(["--model-path", model, "--tp", "2", "--memx-elastic-kv", "--memx-pool", "dev0", "--memx-weights",
                   "remap"]).weights == "remap"  # fmt: skip
    with pytest.raises(MemxConfigError, match="--memx-sleep-after-s decides from what one rank"):
        _check(["--model-path", model, "--tp", "2", "--memx-elastic-kv", "--memx-pool", "dev0", "--memx-weights",
                "remap", "--memx-sleep-after-s", "30"])  # fmt: skip
    with pytest.raises(MemxConfigError, match="LlamaForCausalLM at tensor parallel size 2 .* MHATokenToKVPool ") as e:
        _check(["--model-path", model, "--tp", "2", "--memx-elastic-kv", "--memx-pool", "dev0",
                "--memx-peer-kv", "borrow"])  # fmt: skip
    assert e.value.flag == "--memx-peer-kv"
    with pytest.raises(MemxConfigError, match="this model at tensor parallel size 2 .* one KV pool per rank"):
        _check(["--model-path", str(tmp_path / "no-such-dir"), "--tp", "2", "--memx-elastic-kv",
                "--memx-peer-kv", "borrow", "--memx-pool", "dev0"])  # fmt: skip
    with pytest.raises(MemxConfigError, match="pipeline parallel size 2"):
        _check(["--model-path", model, "--pp-size", "2", "--memx-elastic-kv"])
    _check(["--model-path", model, "--tp", "2"])


def test_the_launcher_serves_elastic_kv_on_an_mla_checkpoint_and_refuses_the_rest_by_name(tmp_path):
    model = _checkpoint(tmp_path, "DeepseekV2ForCausalLM", kv_lora_rank=32)
    assert _check(["--model-path", model, "--memx-elastic-kv"]).elastic_kv
    assert _check(["--model-path", model, "--memx-elastic-kv", "--memx-pool", "dev0", "--memx-host-buffer-gb", "1",
                   "--memx-ttft-slo-ms", "500", "--memx-tpot-slo-ms", "50"]).governed  # fmt: skip
    for flags, named in ((["--memx-pool-budget-gb", "1", "--memx-weights", "remap"], "--memx-weights"),
                         (["--memx-pool", "dev0", "--memx-peer-kv", "borrow"], "--memx-peer-kv")):  # fmt: skip
        with pytest.raises(MemxConfigError, match="DeepseekV2ForCausalLM is served from upstream's MLATokenTo") as e:
            _check(["--model-path", model, "--memx-elastic-kv", *flags])
        assert e.value.flag == named and f"run without {named}" in str(e.value)


def test_the_server_parser_exits_2_naming_the_flag_model_and_pool(tmp_path, capsys):
    model = _checkpoint(tmp_path, "MellumForCausalLM")
    parser = _parser()
    parser.parse_args = _validating_parse_args(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(
            [
                "--model-path",
                model,
                "--device",
                "cpu",
                "--memx-elastic-kv",
                "--memx-host-buffer-gb",
                "0.01",
                "--memx-ttft-slo-ms",
                "500",
                "--memx-tpot-slo-ms",
                "50",
            ]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --memx-elastic-kv: MellumForCausalLM is served from upstream's SWAKVPool, and on the CPU" in err


# ------------------------------------------------------------------ the scheduler's pool build
def _configurator(*, tp=1, pp=1, hybrid_swa=False, mla=False, mamba=None, arch="MellumForCausalLM", config=ON,
                  device="cuda"):  # fmt: skip
    server_args = SimpleNamespace(tp_size=tp, pp_size=pp, chunked_prefill_size=16, max_prefill_tokens=None,
                                  device=device)  # fmt: skip
    setattr(server_args, CONFIG_ATTR, config.to_dict())
    hf = SimpleNamespace(num_attention_heads=4, hidden_size=64, intermediate_size=128, vocab_size=512)
    model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch]), hf_text_config=hf)
    return SimpleNamespace(server_args=server_args, model_config=model_config, model_dtype=torch.float32,
                           is_draft_worker=False, is_hybrid_swa=hybrid_swa, use_mla_backend=mla,
                           mambaish_config=mamba)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,named",
    [({"hybrid_swa": True, "config": MemxConfig(elastic_kv=True, weights="remap", pool_budget_gb=1.0)},
      "MellumForCausalLM is served from upstream's SWAKVPool"),
     ({"mla": True, "config": MemxConfig(elastic_kv=True, pool_budget_gb=1.0, weights="remap")},
      "upstream's MLATokenToKVPool .*--memx-weights (is|are) not written for it"),
     ({"mamba": object()}, "upstream's HybridLinearKVPool"),
     ({"hybrid_swa": True, "device": "cpu"}, "SWAKVPool, and on the CPU upstream's CPU attention"),
     ({"pp": 2}, "at pipeline parallel size 2 builds one MHATokenToKVPool per stage"),
     ({"tp": 2, "hybrid_swa": True, "config": MemxConfig(elastic_kv=True, pool="dev0")},
      "MellumForCausalLM is served from upstream's SWAKVPool"),
     ({"tp": 2, "config": MemxConfig(elastic_kv=True, pool="dev0", peer_kv="borrow")},
      "at tensor parallel size 2 builds one MHATokenToKVPool per rank and every rank must schedule the same")],
)  # fmt: skip
def test_the_pool_build_refuses_before_building(kwargs, named):
    with pytest.raises(MemxConfigError, match=named) as info:
        with pool_build.scope(_configurator(**kwargs)):
            raise AssertionError("the build must not open")
    flag = {"peer_kv": "--memx-peer-kv", "weights": "--memx-weights", "pool": "--memx-pool"}
    want = next(
        (f for k, f in flag.items() if getattr(kwargs.get("config"), k, "off") not in ("off", None)),
        "--memx-elastic-kv",
    )
    assert info.value.flag == want
    assert pool_build.current() is None


def test_the_pool_build_at_tensor_parallel_two_balloons_without_the_arena():
    """At --tp 2 the build opens with the activation profile (ballooning: measured peaks are agreed
    across ranks, ``elastic.forward``) and its rank count (``finish`` adds the ranks' check); on CUDA
    the activation arena stays off (it maps chunks while a forward runs, as each rank's allocator asks)."""
    from sglang_memx.elastic.build import activation_arena

    with pool_build.scope(_configurator(tp=2, arch="LlamaForCausalLM")) as build:
        assert build.tp_size == 2 and build.profile is not None
    cuda_backend = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert activation_arena(ON, cuda_backend, pool=None, ranks=2) == (None, None)


def test_the_pool_build_opens_for_one_mha_pool():
    with pool_build.scope(_configurator(arch="Gemma2ForCausalLM")) as build:
        assert build is not None and build.model_class == "Gemma2ForCausalLM"
    assert pool_build.current() is None


def test_the_pool_build_opens_for_the_mla_pool():
    config = MemxConfig(elastic_kv=True, host_buffer_gb=0.5, ttft_slo_ms=500.0, tpot_slo_ms=50.0)
    with pool_build.scope(_configurator(arch="DeepseekV2ForCausalLM", mla=True, config=config)) as build:
        assert build is not None and build.model_class == "DeepseekV2ForCausalLM"
    assert pool_build.current() is None


def test_a_second_mha_pool_in_one_build_is_refused(monkeypatch):
    """A pool of MHA sub-pools reaching the buffers hook anyway: never back only the first one."""
    memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    pool = object.__new__(memory_pool.MHATokenToKVPool)
    for name, value in {"quant_method": memory_pool.UnquantizedKVCacheMethod(), "post_capture_active": False,
                        "kv_cache_layout": "nhd", "enable_custom_mem_pool": False}.items():  # fmt: skip
        setattr(pool, name, value)
    current = threading.local()
    current.build = pool_build.Build(ON, SimpleNamespace(), None, 16, kv=object())
    monkeypatch.setattr(pool_build, "_current", current)
    with pytest.raises(MemxConfigError, match="this pool build makes another") as info:
        pool_build.make_elastic(pool)
    assert info.value.flag == "--memx-elastic-kv"


# ------------------------------------------------------------------ remappable weights: layer discovery
def test_gemma2_decoder_layers_are_every_layer_of_its_body():
    gemma2 = pytest.importorskip("sglang.srt.models.gemma2")
    from sglang_memx.upstream.model import NotHookable, decoder_layers

    lm = object.__new__(gemma2.Gemma2ForCausalLM)
    torch.nn.Module.__init__(lm)
    lm.model = torch.nn.Module()
    lm.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    assert [i for i, _ in decoder_layers(lm)] == [0, 1, 2]
    lm.model.layers = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(NotHookable, match="not a ModuleList"):
        decoder_layers(lm)
