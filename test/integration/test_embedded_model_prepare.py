"""Preparing the packaged SmolLM2 GGUF as a bf16 checkpoint, for real (a conversion takes
about half a minute of one core).

The tests share one prepared directory in a temporary cache root and run in file order.
It starts as a copy of the session's checkpoint (``scripts/test.sh`` prepares it before
pytest; it is converted here if it is missing): what a prepared directory holds, the fast
re-run, a greedy generation with transformers. Last, a corruption forces a rebuild: a
conversion from the GGUF in an empty scratch directory, the same path a first prepare takes,
whose files must equal the session checkpoint's byte for byte (the conversion is
deterministic) and which leaves nothing else in the cache root.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from sglang_memx.models import embedded as em

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class _Log(list):
    def __call__(self, line: str) -> None:
        print(line)
        self.append(line)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memx-embedded")


@pytest.fixture(scope="module")
def session_checkpoint() -> Path:
    return em.prepare_embedded_model()


@pytest.fixture(scope="module")
def prepared(cache_root, session_checkpoint):
    shutil.copytree(session_checkpoint, em.embedded_model_dir(cache_root))
    log = _Log()
    t = time.monotonic()
    path = em.prepare_embedded_model(cache_root, log=log)
    return path, log, time.monotonic() - t


def test_prepare_verifies_a_prepared_directory_without_converting(prepared, cache_root):
    path, log, seconds = prepared
    assert path == em.embedded_model_dir(cache_root)
    assert path.is_dir()
    assert any("verified" in line for line in log)
    assert not any("convert" in line for line in log)
    print(f"verifying took {seconds:.2f} s")


def test_config_has_no_quantization(prepared):
    path = prepared[0]
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_weights_are_bf16_safetensors(prepared):
    from safetensors import safe_open

    path = prepared[0]
    shards = sorted(path.glob("*.safetensors"))
    assert shards
    assert not list(path.glob("*.bin")) and not list(path.glob("*.gguf"))
    names = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():
                names.add(key)
                assert fh.get_slice(key).get_dtype() == "BF16", key
    assert "model.embed_tokens.weight" in names
    assert "model.layers.29.mlp.down_proj.weight" in names


def test_tokenizer_keeps_chat_template_and_stops_at_im_end(prepared):
    from transformers import AutoTokenizer, GenerationConfig

    path = prepared[0]
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    gen = GenerationConfig.from_pretrained(str(path))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert end_id in eos
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_manifest_records_source_and_files(prepared):
    path = prepared[0]
    manifest = json.loads((path / em.MANIFEST_NAME).read_text())
    assert manifest["source"]["gguf_sha256"] == em.GGUF_SHA256
    assert manifest["source"]["gguf_name"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert manifest["source"]["package_version"] == "0.1.2"
    assert manifest["dtype"] == "bfloat16"
    import transformers

    assert manifest["transformers_version"] == transformers.__version__
    listed = set(manifest["files"])
    on_disk = {p.name for p in path.iterdir()} - {em.MANIFEST_NAME}
    assert listed == on_disk
    for name, entry in manifest["files"].items():
        assert (path / name).stat().st_size == entry["size"]


def test_second_prepare_is_fast(prepared, cache_root):
    path = prepared[0]
    log = _Log()
    t = time.monotonic()
    again = em.prepare_embedded_model(cache_root, log=log)
    elapsed = time.monotonic() - t
    print(f"idempotent prepare took {elapsed:.2f} s")
    assert again == path
    assert elapsed < 3.0
    assert not any("convert" in line for line in log)


def test_greedy_generation_answers_paris(prepared):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(prepared[0])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    answer = tok.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"answer: {answer!r}")
    assert "Paris" in answer


def test_corrupted_file_triggers_rebuild(prepared, cache_root, session_checkpoint):
    path = prepared[0]
    victim = path / "tokenizer_config.json"
    original = victim.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x20
    victim.write_bytes(bytes(data))
    with pytest.raises(em.EmbeddedModelError, match="tokenizer_config.json"):
        em.verify_embedded_model(path)

    log = _Log()
    t = time.monotonic()
    again = em.prepare_embedded_model(cache_root, log=log)
    print(f"rebuild (a conversion) took {time.monotonic() - t:.1f} s")
    assert again == path
    assert any("rebuilding" in line and "tokenizer_config.json" in line for line in log)
    assert any("convert" in line for line in log)
    assert any("ready at" in line for line in log)
    em.verify_embedded_model(path)
    # Nothing but the model and its lock file is left in the cache root.
    assert sorted(p.name for p in cache_root.iterdir()) == sorted([path.name, f".{path.name}.lock"])
    # The conversion is deterministic: every file but the manifest (which records the conversion's
    # time) is the session checkpoint's, converted by another process.
    assert victim.read_bytes() == original
    names = {p.name for p in path.iterdir()} - {em.MANIFEST_NAME}
    assert names == {p.name for p in session_checkpoint.iterdir()} - {em.MANIFEST_NAME}
    for name in sorted(names):
        assert (path / name).read_bytes() == (session_checkpoint / name).read_bytes(), name
