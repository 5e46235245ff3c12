"""The second embedded model: a float32 copy of the prepared bf16 SmolLM2-135M-Instruct.

``scripts/serve.sh`` co-locates two models of different KV cell sizes on one shared pool.
The second one is derived offline from the first: every bf16 tensor widened to float32
(exact: a bf16 value is the upper half of its float32), ``config.json`` saying
``float32``, tokenizer and chat template copied byte for byte. Served with
``--dtype float32`` its KV cell is twice the bf16 model's (30 layers x 3 KV heads x 64 x
2 x 4 B = 46,080 B per token against 23,040 B), its weights too, and it answers like the
bf16 model up to compute precision (same weights, no layer dropped).

Invariants:

* Derived, never downloaded: the only input is the verified bf16 directory of
  :mod:`sglang_memx.models.embedded` (prepared first if needed); numpy does the widening,
  one tensor at a time (no torch import, a few seconds).
* Lossless and checked: after writing, every float32 tensor is read back and must narrow
  to exactly the source's bf16 bits, with the same names and shapes.
* Same guarantees as the bf16 copy: written to a temporary sibling and renamed into place
  under the builders' lock, a manifest with every file's sha256 and size
  (``verify_fp32_model``), and ``derived_from`` recording the sha256 of every source file,
  so a rebuilt bf16 copy makes the float32 copy stale and it is rebuilt too.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import time
from pathlib import Path

from .embedded import (
    EMBEDDED_MODEL_NAME,
    MANIFEST_NAME,
    EmbeddedModelError,
    Log,
    _build_lock,
    _install,
    _read_manifest,
    _remove_stale_scratch,
    _scratch_prefixes,
    _write_manifest,
    memx_home,
    prepare_embedded_model,
    verify_embedded_model,
)

FP32_MODEL_NAME = f"{EMBEDDED_MODEL_NAME}-fp32"
FP32_DTYPE = "float32"
_ALIGN = 8  # safetensors headers are padded to 8 bytes so the data that follows is aligned

__all__ = ["FP32_MODEL_NAME", "FP32_DTYPE", "fp32_model_dir", "verify_fp32_model", "widen_checkpoint",
           "prepare_fp32_model"]  # fmt: skip


def fp32_model_dir(cache_root: Path | None = None) -> Path:
    """``<cache_root or memx_home()/models>/SmolLM2-135M-Instruct-fp32``."""
    root = Path(cache_root).expanduser() if cache_root is not None else memx_home() / "models"
    return root / FP32_MODEL_NAME


# --------------------------------------------------------------------------- safetensors


def _read_header(path: Path) -> tuple[dict, int]:
    """(header without ``__metadata__``, offset of the data) of a safetensors file."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise EmbeddedModelError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise EmbeddedModelError(f"{path}: safetensors header is not JSON ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def _widen_file(src: Path, dst: Path) -> None:
    """Write ``dst``: every BF16 tensor of ``src`` as F32, same names and shapes (sorted by name)."""
    import numpy as np

    header, base = _read_header(src)
    names = sorted(header)
    out_header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        entry = header[name]
        if entry.get("dtype") != "BF16":
            raise EmbeddedModelError(f"{src}: tensor {name} is {entry.get('dtype')}, expected BF16")
        begin, end = entry["data_offsets"]
        size = (end - begin) * 2
        out_header[name] = {"dtype": "F32", "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(out_header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % _ALIGN)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(struct.pack("<Q", len(blob)))
        fout.write(blob)
        for name in names:
            begin, end = header[name]["data_offsets"]
            fin.seek(base + begin)
            half = np.frombuffer(fin.read(end - begin), dtype="<u2")
            fout.write((half.astype("<u4") << 16).tobytes())


def _check_widened(src: Path, dst: Path) -> None:
    """Read ``dst`` back: same tensors and shapes as ``src``, F32 narrowing exactly to its bf16 bits."""
    import numpy as np

    sh, sbase = _read_header(src)
    dh, dbase = _read_header(dst)
    if sorted(sh) != sorted(dh):
        raise EmbeddedModelError(f"widening produced a bad {dst}: tensor names differ from {src.name}")
    with open(src, "rb") as fs, open(dst, "rb") as fd:
        for name, entry in sh.items():
            out = dh[name]
            if out["dtype"] != "F32" or out["shape"] != entry["shape"]:
                raise EmbeddedModelError(f"widening produced a bad {dst}: tensor {name} is {out['dtype']} "
                                         f"{out['shape']}, expected F32 {entry['shape']}")  # fmt: skip
            b0, b1 = entry["data_offsets"]
            o0, o1 = out["data_offsets"]
            fs.seek(sbase + b0)
            fd.seek(dbase + o0)
            half = np.frombuffer(fs.read(b1 - b0), dtype="<u2")
            full = np.frombuffer(fd.read(o1 - o0), dtype="<u4")
            if (
                full.shape != half.shape
                or not np.array_equal((full >> 16).astype("<u2"), half)
                or (full & 0xFFFF).any()
            ):
                raise EmbeddedModelError(f"widening produced a bad {dst}: tensor {name} does not narrow to the source")


def widen_checkpoint(src: Path, out: Path) -> None:
    """Write the float32 copy of the bf16 checkpoint ``src`` into the existing empty ``out``."""
    src, out = Path(src), Path(out)
    for path in sorted(src.iterdir()):
        if path.name == MANIFEST_NAME or path.name.startswith("."):
            continue
        if path.suffix == ".safetensors":
            _widen_file(path, out / path.name)
            _check_widened(path, out / path.name)
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = FP32_DTYPE  # what SGLang and transformers read first
            if "torch_dtype" in config:
                config["torch_dtype"] = FP32_DTYPE
            (out / path.name).write_text(json.dumps(config, indent=2) + "\n")
        elif path.is_file():
            shutil.copyfile(path, out / path.name)
    if not list(out.glob("*.safetensors")):
        raise EmbeddedModelError(f"{src}: no *.safetensors to widen")


# --------------------------------------------------------------------------- verify / prepare


def verify_fp32_model(model_dir: Path, source_dir: Path | None = None) -> None:
    """``verify_embedded_model`` for the float32 copy; with ``source_dir`` (the bf16 copy) it must
    also have been derived from exactly that directory's files."""
    verify_embedded_model(model_dir, FP32_DTYPE)
    if source_dir is None:
        return
    derived = _read_manifest(Path(model_dir), FP32_DTYPE).get("derived_from")
    source = {n: e["sha256"] for n, e in _read_manifest(Path(source_dir)).get("files", {}).items()}
    if not isinstance(derived, dict) or derived.get("files") != source:
        raise EmbeddedModelError(
            f"{Path(model_dir) / MANIFEST_NAME}: derived from another {EMBEDDED_MODEL_NAME} copy than {source_dir}; "
            "run `sglang-memx models prepare --fp32 --force` (or scripts/serve.sh) to rebuild it"
        )


def prepare_fp32_model(cache_root: Path | None = None, *, force: bool = False, log: Log = print) -> Path:
    """Return the verified float32 copy, preparing the bf16 copy and widening it first if needed.

    Idempotent like :func:`prepare_embedded_model` (``force=True`` rebuilds the float32 copy
    only); raises :class:`EmbeddedModelError` with what to do.
    """
    t0 = time.monotonic()
    source = prepare_embedded_model(cache_root, log=log)
    target = fp32_model_dir(cache_root)

    def valid() -> bool:
        try:
            verify_fp32_model(target, source)
            return True
        except EmbeddedModelError as exc:
            if target.exists():
                log(f"[memx] float32 model: rebuilding, because {exc}")
            return False

    if not force and valid():
        log(f"[memx] float32 model: {target} verified ({time.monotonic() - t0:.1f} s)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target, log) as locked:
        if locked and not force and valid():  # built by another process while this one waited
            log(f"[memx] float32 model: {target} was prepared by another process; using it")
            return target
        _remove_stale_scratch(target, locked)
        scratch = Path(tempfile.mkdtemp(prefix=_scratch_prefixes(target)[0], dir=target.parent))
        try:
            t = time.monotonic()
            log(f"[memx] float32 model: widening {source.name} to {FP32_DTYPE} in {scratch}")
            widen_checkpoint(source, scratch)
            for path in scratch.iterdir():
                path.chmod(0o644)
            scratch.chmod(0o755)
            source_manifest = _read_manifest(source)
            manifest = _write_manifest(
                scratch,
                {
                    "name": FP32_MODEL_NAME,
                    "dtype": FP32_DTYPE,
                    "derived_from": {
                        "name": source.name,
                        "how": "every BF16 tensor widened to F32 (exact), config dtype float32",
                        "files": {n: e["sha256"] for n, e in source_manifest["files"].items()},
                    },
                    "conversion_seconds": round(time.monotonic() - t, 1),
                },
            )
            verify_fp32_model(scratch, source)
            total = sum(entry["size"] for entry in manifest["files"].values())
            log(f"[memx] float32 model: widened + checked ({total / 2**20:.0f} MiB, {time.monotonic() - t:.1f} s)")
            _install(scratch, target, replace_valid=True, log=log, dtype=FP32_DTYPE)  # a valid but stale one too
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)
    log(f"[memx] float32 model: ready at {target} ({time.monotonic() - t0:.1f} s)")
    return target
