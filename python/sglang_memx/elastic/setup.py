"""Build the elastic KV of one server: backend, pool (own or shared), buffers, controller.

Shared pools (``--memx-pool NAME``): one arbiter process per pool name (i.e.
per device) listens on ``<pool dir>/NAME.sock``. The first server started with
the name spawns it, in its own session so it outlives that server, with the
budget of ``--memx-pool-budget-gb``; a ``flock`` on ``NAME.lock`` makes
concurrent first starts spawn only one. Later servers join it; a budget or
chunk size that differs from the running arbiter's is refused, naming the flag.
``sglang-memx pool stop NAME`` ends an arbiter.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from memory_ext.policy.activation import ActivationProfile
from memory_ext.pool import ChunkPool
from memory_ext.pool.arbiter_client import ArbiterError
from memory_ext.pool.layered_kv import LayeredKVBuffers, group_rows_for
from memory_ext.pool.lent_pool import LentPool
from sglang_memx.config import MemxConfig, MemxConfigError
from sglang_memx.elastic.activation import ActivationBalloon
from sglang_memx.elastic.kv import ElasticKV

logger = logging.getLogger("sglang_memx")

GB = 1 << 30


def pool_dir(config: MemxConfig) -> Path:
    if config.pool_dir:
        return Path(config.pool_dir)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "sglang-memx" if runtime else Path(f"/tmp/sglang-memx-{os.getuid()}")


def pool_socket(config: MemxConfig, name: str | None = None) -> Path:
    return pool_dir(config) / f"{name or config.pool}.sock"


def _answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(1.0)
        s.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def ensure_arbiter(config: MemxConfig, chunk_bytes: int, timeout: float = 20.0) -> Path:
    """The pool's socket, starting its arbiter if none answers (needs the budget flag)."""
    directory = pool_dir(config)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = pool_socket(config)
    with open(directory / f"{config.pool}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers(sock):
            return sock
        if config.pool_budget_gb is None:
            raise MemxConfigError(
                "--memx-pool-budget-gb", f"pool {config.pool!r} is not running ({sock}); give its budget to start it"
            )
        budget = int(config.pool_budget_gb * GB) // chunk_bytes
        if budget < 1:
            raise MemxConfigError("--memx-pool-budget-gb", f"{config.pool_budget_gb} GB is less than one chunk")
        if sock.exists():
            sock.unlink()  # stale socket of a dead arbiter
        log = open(directory / f"{config.pool}.log", "ab")
        cmd = [
            sys.executable,
            "-m",
            "memory_ext.pool.arbiter",
            "--socket",
            os.fspath(sock),
            "--budget-chunks",
            str(budget),
            "--granularity-kib",
            str(chunk_bytes >> 10),
            "--pid-file",
            os.fspath(directory / f"{config.pool}.pid"),
        ]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not _answers(sock):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the arbiter of pool {config.pool!r} exited with {proc.returncode}; "
                    f"see {directory / (config.pool + '.log')}"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the arbiter of pool {config.pool!r} did not answer within {timeout:g} s")
            time.sleep(0.05)
        logger.info(
            "memx: started the arbiter of pool %r (pid %d, budget %d chunk(s) of %d KiB) at %s",
            config.pool,
            proc.pid,
            budget,
            chunk_bytes >> 10,
            sock,
        )
        return sock


def make_backend(config: MemxConfig, device: str):
    if str(device).startswith("cuda"):
        from memory_ext.vmm import cuda_backend

        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        return cuda_backend(index)
    from memory_ext.vmm import host_backend

    return host_backend(config.chunk_kb << 10, name=f"memx-kv-{os.getpid()}")


def join_pool(config: MemxConfig, backend) -> LentPool:
    sock = ensure_arbiter(config, backend.granularity)
    try:
        lent = LentPool(sock, f"sglang-{os.getpid()}", backend)
    except ArbiterError as exc:
        if exc.field == "granularity":
            raise MemxConfigError(
                "--memx-chunk-kb", f"differs from the chunk size of pool {config.pool!r}: {exc}"
            ) from exc
        raise
    if config.pool_budget_gb is not None:
        mine = int(config.pool_budget_gb * GB) // backend.granularity
        if mine != lent.budget_chunks:
            lent.close()
            raise MemxConfigError(
                "--memx-pool-budget-gb",
                f"pool {config.pool!r} already runs with {lent.budget_chunks * backend.granularity / GB:g} GB; "
                f"give the same budget or leave the flag out to join it",
            )
    return lent


def register_server(config: MemxConfig, url: str | None) -> Path | None:
    """Leave ``<pool dir>/<pool>.server.<pid>.json`` so ``sglang-memx top`` can find this server."""
    if not config.pool or not url:
        return None
    path = pool_dir(config) / f"{config.pool}.server.{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "url": url, "pool": config.pool}))
    os.replace(tmp, path)
    return path


def activation_profile(model_config, dtype) -> ActivationProfile | None:
    """The activation profile of the served model from its shapes (None if they are not all known)."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    try:
        heads = int(hf.num_attention_heads)
        hidden = int(hf.hidden_size)
        return ActivationProfile.from_model_dims(
            hidden=hidden,
            intermediate=int(hf.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf, "head_dim", None) or hidden // heads),
            vocab=int(hf.vocab_size),
            itemsize=int(getattr(dtype, "itemsize", 2)),
        )
    except (AttributeError, TypeError, ValueError):
        return None


def max_batch_tokens(server_args) -> int:
    """The most tokens one prefill batch can hold: the chunked-prefill size, else max_prefill_tokens."""
    chunk = getattr(server_args, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        return int(chunk)
    return int(getattr(server_args, "max_prefill_tokens", None) or 16384)


def activation_arena(config: MemxConfig, backend, pool):
    """On CUDA, the arena + MemPool the forward's activations are allocated from; ``(None, None)``
    on CPU, with ``--memx-torch-activations``, or when the arena cannot be built here (logged: the
    activations then come from torch and are also counted against the pool, as before)."""
    if config.torch_activations or getattr(getattr(backend, "device", None), "type", "cpu") != "cuda":
        return None, None
    try:
        from memory_ext.pool.segment_arena import ArenaMemPool, SegmentArena, cuda_driver_hooks

        arena = SegmentArena(backend, pool.capacity_chunks, **cuda_driver_hooks())
        try:
            return arena, ArenaMemPool()
        except BaseException:
            arena.close()
            raise
    except Exception as exc:
        logger.warning(
            "memx: activation arena unavailable (%s); activations stay with torch's allocator "
            "and are counted against the pool as well",
            exc,
        )
        return None, None


def build_elastic_kv(
    config: MemxConfig,
    row_bytes: Sequence[int],
    num_rows: int,
    page_size: int,
    num_pages: int,
    device,
    server_url: str | None = None,
    profile: ActivationProfile | None = None,
    batch_tokens: int = 0,
) -> ElasticKV:
    """Everything elastic KV needs; group 0 (the padded page) is mapped on return.

    With a ``profile``, activations share the pool (``ActivationBalloon``): an own pool
    without a budget gets room for the largest prefill batch's activation on top of the
    logical KV size; a budget must hold one KV group plus that activation.
    """
    backend = make_backend(config, str(device))
    group_rows = group_rows_for(row_bytes, backend.granularity, page_size)
    chunks_per_group = sum(group_rows * rb // backend.granularity for rb in row_bytes)
    groups = -(-num_rows // group_rows)
    act_chunks = profile.chunks_for(batch_tokens, 1, backend.granularity) if profile and batch_tokens else 0
    lent = None
    if config.pool:
        lent = join_pool(config, backend)
        pool = lent.pool
        if lent.budget_chunks < chunks_per_group + act_chunks:
            lent.close()
            raise MemxConfigError(
                "--memx-pool-budget-gb",
                f"pool {config.pool!r} ({lent.budget_chunks} chunks) cannot hold one KV group "
                f"({chunks_per_group} chunks) plus the activation of a {batch_tokens}-token "
                f"prefill batch ({act_chunks} chunks); raise the budget or lower "
                f"--chunked-prefill-size",
            )
        if lent.borrow(chunks_per_group) == 0:
            lent.close()
            raise MemxConfigError(
                "--memx-pool-budget-gb",
                f"pool {config.pool!r} cannot lend even one KV group "
                f"({chunks_per_group * backend.granularity / GB:.3f} GB)",
            )
    else:
        if config.pool_budget_gb is not None:
            capacity = int(config.pool_budget_gb * GB) // backend.granularity
            if capacity < chunks_per_group + act_chunks:
                raise MemxConfigError(
                    "--memx-pool-budget-gb",
                    f"{config.pool_budget_gb} GB is less than one KV group "
                    f"({chunks_per_group * backend.granularity / GB:.6f} GB) plus the "
                    f"activation of a {batch_tokens}-token prefill batch "
                    f"({act_chunks * backend.granularity / GB:.6f} GB); raise the budget "
                    f"or lower --chunked-prefill-size",
                )
        else:
            capacity = groups * chunks_per_group + act_chunks
        pool = ChunkPool(backend, capacity)
    buffers = LayeredKVBuffers(pool, row_bytes, num_rows, page_size)
    kv = ElasticKV(buffers, page_size, num_pages, lent=lent, device=device)
    if profile is not None:
        arena, mempool = activation_arena(config, backend, pool)
        kv.activation = ActivationBalloon(pool, profile, batch_tokens, arena=arena, mempool=mempool)
    register_server(config, server_url)
    logger.info(
        "memx: elastic KV on %s: %d token rows reserved in %d groups of %d tokens (%.1f MiB each); pool %s",
        backend.__class__.__name__,
        num_rows,
        groups,
        group_rows,
        buffers.group_bytes / (1 << 20),
        f"{config.pool!r} (shared)" if lent else f"of {pool.capacity_chunks} chunks (own)",
    )
    return kv
