"""``support.model_modules``: the test servers skip upstream's model modules no test model needs."""

from support.model_modules import disabled_model_modules


def test_the_modules_of_the_tests_architectures_stay_and_the_others_go():
    off = set(disabled_model_modules().split(","))
    assert {"llama", "qwen2", "qwen3", "gemma2", "deepseek_v2", "gpt_oss", "mellum", "qwen3_next"}.isdisjoint(off)
    assert {"grok", "mixtral", "falcon_mamba"} <= off  # models no test builds
    only_llama = set(disabled_model_modules(keep_archs=("LlamaForCausalLM",)).split(","))
    assert "llama" not in only_llama and "qwen2" in only_llama
