"""Upstream's server arguments (``sglang.srt.server_args.ServerArgs``) as memx reads them,
and the MemxConfig that rides on them into every SGLang process.

The config travels on the ServerArgs record (attribute ``_memx_config``, a plain dict,
pickled by upstream into its subprocesses). A record built without the CLI
(``sgl.Engine(...)``) has none and gets the defaults.
"""

from __future__ import annotations

from sglang_memx.config import MemxConfig

CONFIG_ATTR = "_memx_config"
GRAPH_DISABLED = "disabled"  # upstream's CUDA-graph backend name for "no capture"
DEFAULT_MAX_PREFILL_TOKENS = 16384  # upstream's documented default of --max-prefill-tokens


def attach_config(server_args, config: MemxConfig) -> None:
    setattr(server_args, CONFIG_ATTR, config.to_dict())


def config_of(server_args) -> MemxConfig:
    data = vars(server_args).get(CONFIG_ATTR) if server_args is not None else None
    return MemxConfig() if data is None else MemxConfig.from_dict(dict(data))


def radix_cache_disabled(args) -> bool:
    """``--disable-radix-cache`` of a parsed namespace or a ServerArgs record."""
    return bool(args.disable_radix_cache)


def hierarchical_cache(args) -> bool:
    """``--enable-hierarchical-cache`` (HiCache's host tier) of a namespace or a ServerArgs record."""
    return bool(args.enable_hierarchical_cache)


def device(args) -> str:
    """``--device`` (None until upstream resolves it: then CUDA when there is one)."""
    return args.device


def model_path(server_args) -> str:
    return str(server_args.model_path)


def parallel_sizes(args) -> tuple[int, int]:
    """(tensor parallel size, pipeline parallel size) of a namespace or a ServerArgs record."""
    return int(args.tp_size), int(args.pp_size)


def hybrid_swa_memory_disabled(args) -> bool:
    """``--disable-hybrid-swa-memory``: a hybrid sliding-window model keeps full-length KV in one pool."""
    return bool(args.disable_hybrid_swa_memory)


def _phase_disabled(args, phase: str) -> bool:
    """Whether a CUDA-graph phase ("decode" / "prefill") was switched off on the command
    line: ``--disable-cuda-graph``, ``--disable-<phase>-cuda-graph``,
    ``--cuda-graph-backend-<phase> disabled`` or ``--cuda-graph-config``'s phase backend."""
    if args.disable_cuda_graph or getattr(args, f"disable_{phase}_cuda_graph"):
        return True
    config = args.cuda_graph_config
    if config is not None:
        entry = config.get(phase) if isinstance(config, dict) else getattr(config, phase, None)
        backend = entry.get("backend") if isinstance(entry, dict) else getattr(entry, "backend", None)
        if backend is not None:
            return str(backend) == GRAPH_DISABLED
    return str(getattr(args, f"cuda_graph_backend_{phase}")) == GRAPH_DISABLED


def device_kind(args) -> str:
    """``--device`` of a namespace or a ServerArgs record, or what upstream auto-detects when absent
    (``cuda`` when a GPU answers, else ``cpu``)."""
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(device).split(":")[0]


def cuda_graphs_possible(args) -> bool:
    """Whether upstream may capture CUDA graphs: a CUDA device (``--device`` given, or
    auto-detected when absent) and a decode or prefill phase not switched off."""
    if device_kind(args) != "cuda":
        return False
    return not (_phase_disabled(args, "decode") and _phase_disabled(args, "prefill"))


def server_url(server_args) -> str:
    return f"http://{server_args.host}:{server_args.port}"


def max_prefill_batch_tokens(server_args) -> int:
    """The most tokens one prefill batch can hold: the chunked-prefill size, else max_prefill_tokens."""
    chunk = server_args.chunked_prefill_size
    if chunk is not None and chunk > 0:
        return int(chunk)
    return int(server_args.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS)


def page_size(server_args) -> int:
    """Tokens of one KV page (upstream's default when unset: 1)."""
    return int(server_args.page_size or 1)
