"""The ``--memx-*`` flags as data: ``MEMX_FLAGS`` is the single table (option, the
``MemxConfig`` field it fills, help, type, default). ``config`` parses and validates them.

Invariant: every ``MemxFlag.dest`` is a ``MemxConfig`` field (``test_config.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memory_ext.policy.default_slo import DEFAULT_SCALE


@dataclasses.dataclass(frozen=True)
class MemxFlag:
    """One ``--memx-*`` flag. ``dest`` is the MemxConfig field it fills."""

    option: str
    dest: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    action: str | None = None
    metavar: str | None = None

    def add_to(self, group) -> None:
        kwargs: dict[str, Any] = {"dest": f"memx_{self.dest}", "default": self.default, "help": self.help}
        if self.action:
            kwargs["action"] = self.action
        else:
            kwargs["type"] = self.type
            kwargs["metavar"] = self.metavar
        group.add_argument(self.option, **kwargs)


MEMX_FLAGS: tuple[MemxFlag, ...] = (
    MemxFlag(
        "--memx-disable",
        "disabled",
        action="store_true",
        default=False,
        help="Load the plugin but leave every memx behaviour off (stock SGLang "
        "behaviour; the status endpoint is not served). Contradicts any "
        "other --memx-* flag.",
    ),
    MemxFlag(
        "--memx-status-path",
        "status_path",
        type=str,
        default="/memx/status",
        metavar="PATH",
        help="HTTP path of the JSON status endpoint (default: /memx/status).",
    ),
    MemxFlag(
        "--memx-elastic-kv",
        "elastic_kv",
        action="store_true",
        default=False,
        help="Back the MHA/GQA KV cache with a memory pool: the logical capacity "
        "(--max-total-tokens) is only reserved address space; physical chunks are "
        "mapped for pages in use and returned when pages are freed or evicted.",
    ),
    MemxFlag(
        "--memx-pool",
        "pool",
        type=str,
        default=None,
        metavar="NAME",
        help="Share one device budget with every server started with the same NAME "
        "(a per-device arbiter process is started by the first one). Needs "
        "--memx-elastic-kv.",
    ),
    MemxFlag(
        "--memx-pool-budget-gb",
        "pool_budget_gb",
        type=float,
        default=None,
        metavar="GB",
        help="Physical memory budget of the KV pool in GB: of this server alone, or of "
        "the shared pool when --memx-pool starts its arbiter (default: the KV "
        "logical capacity; required to start a shared pool).",
    ),
    MemxFlag(
        "--memx-pool-dir",
        "pool_dir",
        type=str,
        default=None,
        metavar="DIR",
        help="Directory of the shared pools' sockets (default: $XDG_RUNTIME_DIR/sglang-memx or /tmp/sglang-memx-$UID).",
    ),
    MemxFlag(
        "--memx-chunk-kb",
        "chunk_kb",
        type=int,
        default=64,
        metavar="KB",
        help="Physical chunk size of the host (CPU) backend in KiB, a power of two "
        ">= 4 (default 64). CUDA uses the device's granularity (2 MiB).",
    ),
    MemxFlag(
        "--memx-torch-activations",
        "torch_activations",
        action="store_true",
        default=False,
        help="On CUDA, leave the forward's activation tensors to torch's own allocator "
        "(they are then counted against the pool and also allocated by torch) instead of "
        "the pool's activation arena behind torch.cuda.MemPool. No effect on CPU, where "
        "activations are accounting only. Needs --memx-elastic-kv.",
    ),
    MemxFlag(
        "--memx-host-buffer-gb",
        "host_buffer_gb",
        type=float,
        default=None,
        metavar="GB",
        help="CPU elastic buffer (eLLM E3), up to GB of host memory: a new request refused "
        "for want of KV reservation prefills anyway and its KV waits here until it can "
        "decode; a retracted request's KV waits here instead of being recomputed. Both "
        "are fetched back before their decode. Needs --memx-elastic-kv and the radix cache.",
    ),
    MemxFlag(
        "--memx-ttft-slo-ms",
        "ttft_slo_ms",
        type=float,
        default=None,
        metavar="MS",
        help="TTFT SLO driving the host buffer's logical size (eLLM Alg. 2: TTFT "
        "violations grow it). Needs --memx-host-buffer-gb and --memx-tpot-slo-ms.",
    ),
    MemxFlag(
        "--memx-tpot-slo-ms",
        "tpot_slo_ms",
        type=float,
        default=None,
        metavar="MS",
        help="TPOT SLO per request. The governor lets a new request join the running batch only "
        "while the predicted decode step (learned online) stays within it; a refused request waits, "
        "never dropped (docs/governor.md). With --memx-host-buffer-gb it also drives the buffer's "
        "logical size (eLLM Alg. 2: TPOT violations shrink it), together with --memx-ttft-slo-ms. "
        "Needs --memx-elastic-kv.",
    ),
    MemxFlag(
        "--memx-governor",
        "governor",
        action="store_true",
        default=False,
        help="The governor without a TPOT SLO: every memx admission verdict passes its do-no-harm "
        "rules (a refusal or a parking stock would not make stands only where admitting is predicted "
        "to preempt a running request; otherwise upstream's own admission decides), with no batch "
        "cap until it has measured the solo decode step, then with the default TPOT SLO "
        "(--memx-tpot-slo-scale; docs/governor.md). --memx-tpot-slo-ms turns it on too, with the "
        "SLO given. Needs --memx-elastic-kv.",
    ),
    MemxFlag(
        "--memx-tpot-slo-scale",
        "tpot_slo_scale",
        type=float,
        default=DEFAULT_SCALE,
        metavar="X",
        help="The governor's TPOT SLO when none is given: X times the solo decode step measured at "
        "start (the median of the first 5 decode steps of one request alone; the start-up warm-up's "
        "usually). A batch capped there keeps at least 1 - 1/X of the decode throughput the "
        "governor's step model predicts any batch could reach (20: 95 %%). 0: no default (no cap "
        "without a TPOT SLO). Needs --memx-governor; contradicts --memx-tpot-slo-ms.",
    ),
    MemxFlag(
        "--memx-weights",
        "weights",
        type=str,
        default="off",
        metavar="MODE",
        help="Remappable weights (Oneiros): 'remap' moves the decoder layers into the pool; under "
        "KV pressure layers are released to the KV cache and streamed back from a host copy "
        "just before they run, and restored when the pressure is gone. 'static' streams a fixed "
        "--memx-weights-streamed fraction of the layers from the start. 'off' (default). Needs "
        "--memx-elastic-kv and a physical budget (--memx-pool-budget-gb or --memx-pool).",
    ),
    MemxFlag(
        "--memx-weights-streamed",
        "weights_streamed",
        type=float,
        default=None,
        metavar="FRACTION",
        help="With --memx-weights static: the fraction (0..1) of decoder layers streamed from host "
        "memory, evenly spaced.",
    ),
    MemxFlag(
        "--memx-prefetch-depth",
        "prefetch_depth",
        type=int,
        default=None,
        metavar="N",
        help="Staging slots the streamed layers rotate through (N layers fetched ahead). Default: "
        "the controller's choice (Oneiros Eq. 4: 1, Eq. 5: 2); 2 with --memx-weights static.",
    ),
    MemxFlag(
        "--memx-tbt-slo-ms",
        "tbt_slo_ms",
        type=float,
        default=None,
        metavar="MS",
        help="With --memx-weights remap: time-between-tokens SLO; the active model streams only as "
        "many layers as keep a decode step within it (measured step time + copy time per layer).",
    ),
    MemxFlag(
        "--memx-weights-profile",
        "weights_profile",
        type=str,
        default=None,
        metavar="PATH",
        help="With --memx-weights remap: the layer profile of this model on this machine, written by "
        "'sglang-memx profile' (per-layer step times by batch, copy bandwidth); without it the "
        "server uses the times it measures itself.",
    ),
    MemxFlag(
        "--memx-weights-idle-after-s",
        "weights_idle_after_s",
        type=float,
        default=30.0,
        metavar="S",
        help="With --memx-weights remap: a model without requests for S seconds is inactive: its "
        "layers are released first and more of them may stream (default 30).",
    ),
    MemxFlag(
        "--memx-sleep-after-s",
        "sleep_after_s",
        type=float,
        default=None,
        metavar="S",
        help="With --memx-weights remap and --memx-pool: a model without requests for S seconds sleeps: "
        "its KV cache and all but one staging slot of its weights go back to the pool; the first "
        "request wakes it (wake time in /memx/status). Default: never sleeps.",
    ),
    # peer KV tier (issue 16, docs/peer-kv.md)
    MemxFlag(
        "--memx-peer-kv",
        "peer_kv",
        type=str,
        default="off",
        metavar="MODE",
        help="Peer KV tier (SwiftCache): 'donate' lends idle KV capacity to co-located servers of the "
        "same --memx-pool, 'borrow' spills evicted prefix KV into their donations and loads it back on "
        "a hit, 'both', or 'off' (default). Needs --memx-pool and the radix cache; CPU servers only, "
        "without --enable-hierarchical-cache. Not available yet: any mode but 'off' is refused after "
        "validation (docs/peer-kv.md).",
    ),
    MemxFlag(
        "--memx-peer-donate-max-gb",
        "peer_donate_max_gb",
        type=float,
        default=None,
        metavar="GB",
        help="With --memx-peer-kv donate or both: at most GB of KV capacity lent to peers at any time "
        "(default: half of its KV capacity; within the cap it lends what its own load leaves idle, "
        "SwiftCache Alg. 1).",
    ),
    MemxFlag(
        "--memx-peer-layer-stream",
        "peer_layer_stream",
        action="store_true",
        default=False,
        help="With --memx-peer-kv borrow: the layer stream cache (SwiftCache W2). Some layers' KV lives in "
        "a donor's memory (a pinned lease, never reclaimed while this server runs) and is streamed "
        "through one local staging layer around each of those layers' attention, so the same local KV "
        "memory holds a longer context: the KV capacity upstream sizes (--max-total-tokens or "
        "--mem-fraction-static) becomes the local budget and the server holds as many tokens as "
        "plan_lsc (Eq. 1-5) allows with the donation it gets at start-up (docs/peer-kv.md).",
    ),
)
