"""What one server's remappable weights are: the store, the pipeline, the measured times.

Invariant: ``streamed`` layers are exactly ``store.streamed()``; lent layers
(``alpha``) = streamed layers - staging slots.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from memory_ext.weights import LayerPipeline, WeightStore

EMA = 0.2  # weight of a new sample in the step-time averages
SAMPLES = 64  # recent samples kept per batch size (the profile command reads their median)


@dataclass
class WeightsState:
    mode: str
    store: WeightStore
    pipeline: LayerPipeline
    layer_keys: list
    layer_bytes: int  # bytes of the largest layer's parameters
    link_bytes_per_s: float  # measured host -> pool copy bandwidth (first copies in)
    idle_after_s: float = 30.0
    tbt_slo_s: float | None = None
    tbt_slo_source: str | None = None  # the flag the step SLO came from (weights/attach.step_slo)
    copies_share_compute: bool = False  # the copies run on the compute's cores (a CPU device)
    depth: int | None = None
    decode_step_s: float | None = None  # EMA of decode forwards
    prefill_step_s: float | None = None  # EMA of extend forwards
    decode_layer_s: float | None = None  # EMA of one layer's compute in a decode step (t_c)
    last_decode_batch: int = 1
    decode_layer_by_batch: dict = field(default_factory=dict)  # batch -> recent per-layer decode samples
    prefill_layer_per_token: list = field(default_factory=list)  # recent (tokens, per-layer s per token) prefills
    profile: object = None  # LayerProfile from --memx-weights-profile, or None
    arbiter_free: int = 0  # shared pool: chunks the arbiter could lend at the last poll
    arbiter_polled_at: float = 0.0
    lent_to_peers: int = 0  # shared pool: layers released to answer the arbiter's reclaims
    # tensor parallel ranks on a shared pool (a lockstep pool): chunks a restore waits for from the next
    # tick's "give back, borrow" (0: none), and whether that step has borrowed for it since
    restore_ask_chunks: int = 0
    restore_ask_tried: bool = False
    restore_asks: int = 0  # restores that waited for such a borrow
    last_busy: float = field(default_factory=time.monotonic)
    decisions: dict = field(default_factory=lambda: {"remap": 0, "restore": 0, "hold": 0})
    controller: object = None  # the OneirosController (remap only), built on the first step
    link_demand: object = None  # shared pool + TBT SLO: the GpuDemand last sent to the arbiter (LINK)
    link: dict | None = None  # the arbiter's LINKED answer to it (None: not asked / no answer)
    link_layers: int | None = None  # layers that answer lets stream per iteration
    link_asked_at: float = 0.0
    sleep_after_s: float | None = None  # --memx-sleep-after-s (see weights/sleep.py)
    sleeping: bool = False
    slept_at: float | None = None
    sleeps: int = 0
    wakes: int = 0
    last_wake_s: float | None = None
    last_wake_full: bool | None = None
    last_reason: str = ""

    @property
    def n_layers(self) -> int:
        return len(self.layer_keys)

    @property
    def alpha(self) -> int:
        """Layers lent to the KV cache (streamed beyond the staging slots)."""
        return max(0, len(self.store.streamed()) - self.store.num_slots)

    @property
    def layer_transfer_s(self) -> float:
        """T_T: one layer's copy: the profile's, else at the bandwidth the store's own copies
        reach (measured at attach, then over every fetch and restore)."""
        if self.profile is not None:
            return self.profile.layer_transfer_s
        measured = self.store.copy_bytes_per_s()  # on every tick: not the whole status
        return self.layer_bytes / (measured or self.link_bytes_per_s)

    def note_forward(self, decode: bool, seconds: float, layer_seconds: float, tokens: int, batch: int) -> None:
        """One forward's wall time and time inside the decoder layers (``tokens`` / ``batch`` of it)."""
        self._ema("decode_step_s" if decode else "prefill_step_s", seconds)
        per_layer = layer_seconds / self.n_layers
        if decode and batch > 0:
            self._ema("decode_layer_s", per_layer)
            self.last_decode_batch = batch
            samples = self.decode_layer_by_batch.setdefault(batch, [])
            samples.append(per_layer)
            del samples[:-SAMPLES]
        elif not decode and tokens > 0:
            self.prefill_layer_per_token.append((tokens, per_layer / tokens))
            del self.prefill_layer_per_token[:-SAMPLES]

    def _ema(self, name: str, value: float) -> None:
        old = getattr(self, name)
        setattr(self, name, value if old is None else (1 - EMA) * old + EMA * value)

    def min_held_chunks(self) -> int:
        """Chunks the weights hold at the least: remap never lends a whole model (one layer
        stays, two staging slots); static holds what it holds now."""
        if self.mode == "static":
            return self.store.held_chunks()
        return self.store.slot_chunks * (1 + (self.depth or 2))

    def sleep_status(self) -> dict | None:
        """``--memx-sleep-after-s``: awake or sleeping, counts, the last wake's time."""
        if self.sleep_after_s is None:
            return None
        return {"state": "sleeping" if self.sleeping else "awake", "sleep_after_s": self.sleep_after_s,
                "sleeps": self.sleeps, "wakes": self.wakes,
                "last_wake_s": None if self.last_wake_s is None else round(self.last_wake_s, 4),
                "last_wake_full": self.last_wake_full}  # fmt: skip

    def status(self) -> dict:
        return {
            "mode": self.mode,
            "layers": self.n_layers,
            "lent_layers": self.alpha,
            "layer_bytes": self.layer_bytes,
            "link_bytes_per_s": round(self.link_bytes_per_s),
            "layer_transfer_s": round(self.layer_transfer_s, 6),
            "decode_step_s": None if self.decode_step_s is None else round(self.decode_step_s, 6),
            "prefill_step_s": None if self.prefill_step_s is None else round(self.prefill_step_s, 6),
            "tbt_slo_s": self.tbt_slo_s,
            "tbt_slo_source": self.tbt_slo_source,
            "copies_share_compute": self.copies_share_compute,
            "decode_layer_s": None if self.decode_layer_s is None else round(self.decode_layer_s, 7),
            "decode_layer_s_by_batch": {
                b: round(statistics.median(v), 7) for b, v in sorted(self.decode_layer_by_batch.items())
            },
            "prefill_layer_s_per_token": None
            if not self.prefill_layer_per_token
            else round(max(self.prefill_layer_per_token)[1], 9),  # the largest recent prefill
            "profile": None if self.profile is None else self.profile.model,
            "decisions": dict(self.decisions),
            "released_for_peers": self.lent_to_peers,
            "restore_ask_chunks": self.restore_ask_chunks,
            "restore_asks": self.restore_asks,
            "sleep": self.sleep_status(),
            "link": None if self.link is None else dict(self.link, layers=self.link_layers),
            "last_reason": self.last_reason,
            "streamed": sorted(self.store.streamed()),
            "forwards": self.pipeline.forwards,
            **self.store.status(),
        }
