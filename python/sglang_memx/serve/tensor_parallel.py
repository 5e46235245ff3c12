"""A served model at tensor parallel size > 1 (``--tp N`` in its ``server_args``): its size, read
with upstream's spellings, and on a CPU device the ranks' cores.

Upstream's CPU engine runs ``--tp N`` with one group of cores per rank
(``SGLANG_CPU_OMP_THREADS_BIND``, groups separated by ``|``) and gloo for the all-reduce; it does
so only when PyNccl stays off, i.e. when its NCCL library fails to load (docs/models.md, "Tensor
parallel 2 runs, with two settings"). The launcher gives such an engine its share of the device's
cores split into N groups and the NCCL path below, unless the user's environment sets it.

Invariants: a size is an int >= 1 (bad values name the field); every rank gets at least one core of
its own (fewer cores than ranks is refused, naming the field, rather than started many times slower);
a CUDA device is one GPU, so ``--tp`` > 1 there is refused (serve places a model on one device).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .config import ServeConfigError
from .cores import split_cores

TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size")  # what upstream's parser takes for tp_size
NCCL_PATH_ENV = "SGLANG_NCCL_SO_PATH"
NO_NCCL = "/nonexistent/libnccl.so.2"  # a path that fails to load: upstream's PyNccl stays off, gloo runs


def tensor_parallel_size(path: str, args: Sequence[str]) -> int:
    """The last ``--tp`` / ``--tp-size`` / ``--tensor-parallel-size`` in ``args`` (``path``: the field
    they came from, for errors), 1 when none."""
    size = 1
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in TP_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            size = int(value)
        except ValueError:
            raise ServeConfigError(f"{path}[{i}]", f"{flag} needs an integer, got {value!r}") from None
        if size < 1:
            raise ServeConfigError(f"{path}[{i}]", f"{flag} must be at least 1, got {size}")
    return size


def rank_core_env(path: str, device: str, cores: Sequence[int], size: int, environ: Mapping[str, str]) -> dict:
    """The CPU settings of an engine of ``size`` ranks on ``cores`` (its share of ``device``): the
    cores split into ``size`` near-equal contiguous groups, one per rank, and the NCCL path that keeps
    upstream on gloo (the user's own ``SGLANG_NCCL_SO_PATH`` wins)."""
    if len(cores) < size:
        share = f"{len(cores)} core(s) ({', '.join(map(str, cores))})"
        raise ServeConfigError(path, f"--tp {size} runs a rank on cores of its own; this engine's share of device "
                                     f"{device!r} is {share}: give the device more cores (devices[].cores), fewer "
                                     "models, or a smaller --tp")  # fmt: skip
    groups = split_cores(cores, size)
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups),
           "OMP_NUM_THREADS": str(min(len(g) for g in groups))}  # fmt: skip
    if NCCL_PATH_ENV not in environ:
        env[NCCL_PATH_ENV] = NO_NCCL
    return env


def refuse_on_cuda(path: str, device: str, size: int) -> None:
    raise ServeConfigError(path, f"--tp {size} needs {size} GPUs and serve places a model on one device "
                                 f"({device!r}); run it with python -m sglang.launch_server --tp {size}")  # fmt: skip
