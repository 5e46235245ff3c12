"""Converting the embedded model's GGUF into a bf16 Hugging Face checkpoint, in a child process.

``_run_conversion`` starts the child, which loads *this file* by path (``_CHILD_BOOT``) and runs
``_child_convert``; ``_check_converted`` checks what it wrote. Split from ``embedded`` (which
finds, verifies, installs and locks the prepared directory) so each stays small.

Invariant: this module imports only the standard library at import time and nothing of its
package (the child loads it standalone, torch and transformers inside ``_child_convert`` only).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

DTYPE = "bfloat16"
CHAT_START = "<|im_start|>"
CHAT_END = "<|im_end|>"

# Files every prepared directory must have (besides at least one *.safetensors).
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

_CHILD_MARK = "@@memx-convert "
_CONVERT_TIMEOUT_S = 1800.0

Log = Callable[[str], None]


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be found, verified or prepared; the message says what to do."""


def _safetensors_dtypes(path: Path) -> dict:
    """``{tensor name: dtype string}`` from a safetensors header (no torch needed)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _added_token_id(tokenizer_json: dict, content: str) -> int | None:
    for token in tokenizer_json.get("added_tokens", []):
        if token.get("content") == content:
            return token.get("id")
    return tokenizer_json.get("model", {}).get("vocab", {}).get(content)


def _as_id_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_converted(model_dir: Path) -> None:
    """Structural checks of a freshly converted directory; raises naming the first problem."""

    def bad(name: str, why: str) -> EmbeddedModelError:
        return EmbeddedModelError(f"conversion produced a bad {model_dir / name}: {why}")

    for name in REQUIRED_FILES:
        if not (model_dir / name).is_file():
            raise bad(name, "file is missing")
    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise bad("config.json", "still has a quantization_config")
    if config.get("dtype", config.get("torch_dtype")) != DTYPE:
        raise bad("config.json", f"dtype is {config.get('dtype', config.get('torch_dtype'))!r}, not {DTYPE}")
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise bad("*.safetensors", "no safetensors weights were written")
    for shard in shards:
        dtypes = set(_safetensors_dtypes(shard).values())
        if dtypes != {"BF16"}:
            raise bad(shard.name, f"tensor dtypes are {sorted(dtypes)}, expected only BF16")
    stray = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".gguf")]
    if stray:
        raise bad(stray[0], "unexpected weight file")
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if tok_config.get("eos_token") != CHAT_END:
        raise bad("tokenizer_config.json", f"eos_token is {tok_config.get('eos_token')!r}, not {CHAT_END}")
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
    if not isinstance(template, str) or CHAT_START not in template or CHAT_END not in template:
        raise bad("chat_template.jinja", "no ChatML chat template was saved")
    end_id = _added_token_id(json.loads((model_dir / "tokenizer.json").read_text()), CHAT_END)
    if end_id is None:
        raise bad("tokenizer.json", f"has no {CHAT_END} token")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    if end_id not in _as_id_list(gen.get("eos_token_id")):
        raise bad(
            "generation_config.json",
            f"eos_token_id {gen.get('eos_token_id')!r} does not stop at {CHAT_END} (id {end_id})",
        )
    if end_id not in _as_id_list(config.get("eos_token_id")):
        raise bad("config.json", f"eos_token_id {config.get('eos_token_id')!r} is not {CHAT_END} (id {end_id})")


# --------------------------------------------------------------------------- conversion (child process)


def _child_convert(gguf_path: str, out_dir: str) -> None:
    """Runs in the conversion child: GGUF -> bf16 safetensors checkpoint in ``out_dir``."""

    def emit(step: str, since: float, **extra) -> None:
        record = {"step": step, "seconds": round(time.monotonic() - since, 2), **extra}
        print(_CHILD_MARK + json.dumps(record), flush=True)

    t = time.monotonic()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: GGUF weights are always dequantized
        GgufConfig = None
    emit("import torch + transformers", t)

    gguf = Path(gguf_path)
    out = Path(out_dir)
    t = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    emit("load tokenizer from GGUF", t)

    t = time.monotonic()
    # dequantize=True: plain nn.Linear weights instead of packed GGUF blocks, even where a
    # GGUF matmul kernel would be available.
    extra = {} if GgufConfig is None else {"quantization_config": GgufConfig(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **extra)
    emit("load + dequantize weights", t)

    t = time.monotonic()
    # Drop every trace of the GGUF quantizer so save_pretrained writes a plain checkpoint.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    with contextlib.suppress(AttributeError):
        model.is_quantized = False
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            for attr in ("quantization_config", "_is_quantized"):
                with contextlib.suppress(AttributeError):
                    delattr(module.config, attr)
    packed = [n for n, m in model.named_modules() if type(m).__name__ == "GgufLinear"]
    if packed:
        raise RuntimeError(f"weights still packed as GGUF blocks: {packed[:3]}")
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.bfloat16})
    if wrong:
        raise RuntimeError(f"parameters not in bfloat16: {wrong}")

    # Generation must stop at <|im_end|> (ChatML end of turn).
    end_id = tokenizer.convert_tokens_to_ids(CHAT_END)
    if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
        raise RuntimeError(f"the GGUF tokenizer has no {CHAT_END} token")
    if tokenizer.eos_token != CHAT_END:
        tokenizer.eos_token = CHAT_END
    if tokenizer.pad_token is None:
        tokenizer.pad_token = CHAT_END
    model.config.eos_token_id = end_id
    model.generation_config.eos_token_id = end_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF has no chat template")
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len and (tokenizer.model_max_length or 0) > max_len:
        tokenizer.model_max_length = max_len
    emit("clear quantizer state", t)

    t = time.monotonic()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    emit(
        "save bf16 safetensors + tokenizer",
        t,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
    )


_CHILD_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_memx_embedded_convert', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(mod)\n"
    "mod._child_convert(sys.argv[2], sys.argv[3])\n"
)


def _child_env() -> dict:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TQDM_DISABLE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _run_conversion(gguf: Path, out_dir: Path, log: Log) -> dict:
    """Convert in a child process (offline, memory returned when it exits). Returns the
    ``extra`` fields the child reported (library versions)."""
    cmd = [sys.executable, "-c", _CHILD_BOOT, str(Path(__file__).resolve()), str(gguf), str(out_dir)]
    tail: deque = deque(maxlen=40)
    info: dict = {}
    proc = subprocess.Popen(
        cmd,
        cwd=str(out_dir),
        env=_child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    timed_out = threading.Event()

    def kill_on_timeout() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(_CONVERT_TIMEOUT_S, kill_on_timeout)
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(_CHILD_MARK):
                try:
                    record = json.loads(line[len(_CHILD_MARK) :])
                    step, seconds = record.pop("step"), float(record.pop("seconds"))
                except (ValueError, KeyError, TypeError):
                    tail.append(line)
                    continue
                info.update(record)
                log(f"[memx] embedded model: convert: {step} ({seconds:.1f} s)")
            else:
                tail.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    if rc != 0:
        why = f"timed out after {_CONVERT_TIMEOUT_S:.0f} s" if timed_out.is_set() else f"exited with status {rc}"
        output = "\n".join(tail)
        raise EmbeddedModelError(
            f"converting {gguf} to a bf16 checkpoint failed: the conversion process {why} "
            f"(needs torch, transformers, gguf and accelerate in {sys.executable}). Last output:\n{output}"
        )
    return info
