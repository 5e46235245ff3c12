"""Every engine's command line and environment, from the config and the placement (pure).

Invariants:

* Replicas: every replica of a model (``placement.instance_name``) is one engine with its
  own port, log and cores, keyed by its instance name (replica 0: the model's name).
* Every engine of a device gets ``--memx-elastic-kv --memx-pool <device pool>
  --memx-pool-budget-gb <device budget>`` with the same pool name and budget, so the first
  server to start creates the device's arbiter and the others join it.
* CPU devices: their cores are split among the device's servers (each server's OpenMP
  threads on its own cores; two unpinned CPU servers on shared cores run many times
  slower); with ``devices[].lend_idle_cores`` (default) and several engines on the device,
  each also gets the device's compute board (``MEMX_COMPUTE_*``): an engine with work
  computes on its idle siblings' cores too, and gives them back when they have work
  (``sglang_memx.compute_share``); on one own core its idle OpenMP threads wait passively or
  spin briefly, by the model's width (``lending_omp_wait``), unless the user set how.
  CUDA devices: ``CUDA_VISIBLE_DEVICES`` is the device's ordinal.
* A model with ``--tp N`` in its ``server_args`` (``serve.tensor_parallel``): on a CPU device its
  share of the cores is split into N rank groups and upstream stays on gloo; no compute board on
  that device (a rank's threads are its own cores'); refused on a CUDA device (one GPU) and with
  ``sleep_after_s`` (memx does not run sleep at ``--tp`` > 1).
* A model whose entry sets ``tpot_slo_ms``: its engines get ``--memx-tpot-slo-ms`` (the governor
  caps their running batch, docs/governor.md) and ``TPOT_SLO_SOURCE_ENV`` naming the field; a
  model without one gets neither (no governor: the batch grows as stock's). When such an engine
  also has a host buffer and no ``--memx-ttft-slo-ms`` of its own, the model's ``ttft_slo_ms``
  reaches it as ``--memx-ttft-slo-ms`` (``TTFT_SLO_SOURCE_ENV``): the buffer's rule needs both.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .. import compute_share
from ..compute_share import ComputeShares
from ..config import POOL_OWNER_ENV, TPOT_SLO_FLAG, TPOT_SLO_SOURCE_ENV, TTFT_SLO_FLAG, TTFT_SLO_SOURCE_ENV
from ..ports import free_port
from .config import ServeConfig, ServeConfigError
from .cores import split_cores
from .placement import GIB, Placement, instance_name
from .tensor_parallel import rank_core_env, refuse_on_cuda, tensor_parallel_size

__all__ = ["EngineSpec", "engine_specs", "default_pool_dir", "free_port", "CPU_DEFAULTS"]

CPU_DEFAULTS = {
    "--attention-backend": "torch_native",
    "--cuda-graph-backend-decode": "disabled",
    "--cuda-graph-backend-prefill": "disabled",
}


def default_pool_dir() -> str:
    """memx's own default for --memx-pool-dir ($XDG_RUNTIME_DIR/sglang-memx, else /tmp/sglang-memx-$UID)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return str(Path(runtime) / "sglang-memx") if runtime else f"/tmp/sglang-memx-{os.getuid()}"


@dataclass(frozen=True)
class EngineSpec:
    model: str
    device: str
    pool: str
    pool_dir: str
    port: int
    argv: tuple[str, ...]
    env: dict = field(hash=False)  # only the variables set on top of os.environ
    log_path: str
    replica: int = 0  # which replica of ``model`` (0 .. min_replicas - 1)

    @property
    def key(self) -> str:
        """The engine's name: ``instance_name(model, replica)`` (the model's name for replica 0)."""
        return instance_name(self.model, self.replica)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _has(args, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _config_name(config: ServeConfig) -> str:
    """The config file's name as the engines' status shows it (``models.yaml`` if it has no short, printable one)."""
    name = Path(config.source).name if config.source else ""
    return name if name and len(name) <= 100 and name.isprintable() else "models.yaml"


OMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how an idle OpenMP thread waits (libgomp reads both)


SPIN_FROM_HIDDEN = 256  # a lending engine's OpenMP threads spin briefly from this model width up (below)
SHORT_SPIN = {"GOMP_SPINCOUNT": "10000"}  # libgomp's default is 300000 spins before a thread sleeps
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


def lending_omp_wait(environ, own_cores: int, hidden_size: int) -> dict[str, str]:
    """How the idle OpenMP threads of an engine that may compute on its siblings' cores wait, when it
    owns one core and the user's environment does not say (``OMP_WAIT_ENV``); ``{}`` otherwise.

    * Models narrower than ``SPIN_FROM_HIDDEN``: ``OMP_WAIT_POLICY=PASSIVE``. Their ops are too small
      for torch to split (it parallelizes an op of at least 32,768 elements: a decode batch of 64 at
      width 32 has 2,048), so a second thread mostly waits; spinning, it takes the lent core from the
      engine's own tokenizer and detokenizer and from a sibling that wakes. Measured on the matrix's
      width-32 models (``bursty2``, docs/router.md "Idle cores"): passive kept the most requests, and
      10,000 spins gave worse TTFTs than passive in 4 rounds of 5.
    * From ``SPIN_FROM_HIDDEN`` up: ``GOMP_SPINCOUNT=10000``, a short spin, then sleep. A passive team
      pays a futex wake-up per parallel region; on the README's 135M model (width 576) that made the
      whole device cost 1.84-2.12x the own core in the lending trial, which then refused in every run
      of ``bench_serving`` (throughput 0.68x stock's); with 10,000 spins the trial lent in every run
      one night (0.86-0.92x) and refused in 4 of 5 on a slower one (1.04-2.89x), throughput 0.77-0.79x
      both nights: the passive wait's cost was mostly the trial's own blocks on the whole device.
    Widths between 32 and 576 are not measured; 256 is where a decode batch of 128 reaches torch's
    grain. On one own core the choice changes nothing while the engine does not lend (a team of one
    has no waiter); an engine owning several cores keeps libgomp's default, as stock's would.
    """
    if own_cores != 1 or any(k in environ for k in OMP_WAIT_ENV):
        return {}
    return dict(SHORT_SPIN if hidden_size >= SPIN_FROM_HIDDEN else PASSIVE)


def compute_board_path(pool: str, pool_dir: str) -> str:
    """The compute board of a CPU device's engines (``sglang_memx.compute_share``), beside its pool."""
    return str(Path(pool_dir) / f"{pool}.compute")


def _tensor_parallel(config: ServeConfig, m) -> int:
    """``m``'s tensor parallel size (``--tp`` in its server_args); sleep is refused with it above 1."""
    i = config.models.index(m)
    size = tensor_parallel_size(f"models[{i}].server_args", m.server_args)
    if size > 1 and m.sleep_after_s is not None:
        why = f"memx does not run sleep at --tp {size} yet (a wake borrows what one rank decides); drop one of the two"
        raise ServeConfigError(f"models[{i}].sleep_after_s", why)
    return size


def engine_specs(
    config: ServeConfig,
    placement: Placement,
    run_id: str,
    *,
    ports: dict[str, int] | None = None,
    python: str = sys.executable,
    log_dir: str | None = None,
    api_key: str | None = None,
) -> list[EngineSpec]:
    """The command line and environment of every engine, in config order, a model's replicas
    together (``api_key``: upstream's ``--api-key``, so the engines answer only the router;
    ``ports``: by instance name)."""
    log_root = Path(log_dir or config.launch.log_dir or "sglang-memx-serve-logs")
    pool_dir = config.launch.pool_dir or default_pool_dir()
    cuda_seen = 0
    cuda_index, shares = {}, {}
    for d in config.devices:
        if d.kind == "cuda":
            cuda_index[d.name] = d.index if d.index is not None else cuda_seen
            cuda_seen += 1
        else:
            residents = placement.devices[d.name].models
            if residents:
                cores = list(d.cores) if d.cores is not None else sorted(os.sched_getaffinity(0))
                shares.update(zip(residents, split_cores(cores, len(residents))))
    specs = []
    replicas = [
        (m, r, inst, dev) for m in config.models for r, (inst, dev) in enumerate(placement.models[m.name].replicas)
    ]
    tp_of = {inst: _tensor_parallel(config, m) for m, _, inst, _ in replicas}
    for m, replica, inst, device in replicas:
        placed = placement.models[m.name]
        dev = config.device(device)
        where = f"models[{config.models.index(m)}].server_args"
        plan = placement.devices[dev.name]
        pool = f"serve-{dev.name}-{run_id}"
        port = (ports or {}).get(inst) or free_port()
        args = [python, "-m", "sglang.launch_server", "--model-path", m.path, "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", m.name, "--device", dev.kind,
                "--max-total-tokens", str(placed.max_total_tokens)]  # fmt: skip
        if m.dtype != "auto":
            args += ["--dtype", m.dtype]
        if m.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", m.kv_cache_dtype]
        # the pool's arbiter (started by the first engine) ends when this process does
        env = {"PYTHONUNBUFFERED": "1", POOL_OWNER_ENV: str(os.getpid())}
        if dev.kind == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            for flag, value in CPU_DEFAULTS.items():
                if not _has(m.server_args, flag):
                    args += [flag, value]
            mine = shares[inst]
            env["SGLANG_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
            env["OMP_NUM_THREADS"] = str(len(mine))
            if tp_of[inst] > 1:  # a group of cores per rank
                env.update(rank_core_env(where, dev.name, mine, tp_of[inst], os.environ))
            residents = plan.models
            ranks_apart = all(tp_of[r] == 1 for r in residents)  # a rank's threads stay on its own cores
            if dev.lend_idle_cores and len(residents) > 1 and ranks_apart:  # busy: compute on idle siblings' cores
                env[compute_share.BOARD_ENV] = compute_board_path(pool, pool_dir)
                env[compute_share.SLOT_ENV] = str(residents.index(inst))
                env[compute_share.SHARES_ENV] = ComputeShares(tuple(tuple(shares[r]) for r in residents)).render()
                env.update(lending_omp_wait(os.environ, len(mine), placed.size.hidden_size))
        else:
            if tp_of[inst] > 1:
                refuse_on_cuda(where, dev.name, tp_of[inst])
            env["CUDA_VISIBLE_DEVICES"] = str(cuda_index[dev.name])
        if not _has(m.server_args, "--sleep-on-idle"):  # co-located engines share the host's cores:
            args.append("--sleep-on-idle")  # an idle one waits on its sockets instead of spinning a core
        args += ["--memx-elastic-kv", "--memx-pool", pool, "--memx-pool-budget-gb",
                 repr(plan.pool_budget_bytes / GIB), "--memx-pool-dir", pool_dir]  # fmt: skip
        if api_key:
            args += ["--api-key", api_key]
        if m.sleep_after_s is not None:  # remappable weights in the pool: what a sleeping engine releases
            args += ["--memx-weights", "remap", "--memx-sleep-after-s", repr(float(m.sleep_after_s))]
        if m.tpot_slo_ms is not None:  # the engine's governor keeps its running batch within it
            args += [TPOT_SLO_FLAG, repr(float(m.tpot_slo_ms))]
            env[TPOT_SLO_SOURCE_ENV] = f"{_config_name(config)}: models[{config.models.index(m)}].tpot_slo_ms"
            given = list(config.launch.memx_args) + list(m.server_args)
            if _has(given, "--memx-host-buffer-gb") and not _has(given, TTFT_SLO_FLAG):  # its rule needs both
                args += [TTFT_SLO_FLAG, repr(float(m.ttft_slo_ms))]
                env[TTFT_SLO_SOURCE_ENV] = f"{_config_name(config)}: models[{config.models.index(m)}].ttft_slo_ms"
        args += list(config.launch.memx_args) + list(m.server_args)
        log = log_root / f"{inst.replace('/', '_').replace('#', '.replica')}.log"
        specs.append(EngineSpec(m.name, dev.name, pool, pool_dir, port, tuple(args), env, str(log), replica))
    return specs
