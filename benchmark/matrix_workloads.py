"""The workloads and static splits of the no-harm matrix (``benchmark/e2e/matrix.py``): data and pure
functions (schedules, memory plans, stock's candidate splits), no server.

Memory is counted the same way on both sides (as in ``consolidation.py``):

* a model's *need* is its weights plus the KV of ``concurrency`` whole requests
  (``concurrency x (prompt + new tokens)``, prompts tokenized with the model's tokenizer);
* the budget ``M`` is ``budget_models`` x the mean need;
* a stock split gives model i the share ``f_i x M``: its weights, and ``--max-total-tokens`` for
  the rest; stock's activations are outside the shares (upstream sizes them itself);
* memx gets one device of ``M`` plus every model's prefill activation (one chunked-prefill
  batch, memx's own profile), since in memx the pool holds the activations too.

A workload is memory-bound when ``budget_models`` is below the number of models: some split must
then starve a model during its burst.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHUNKED_PREFILL = 64  # every engine of both setups


@dataclass(frozen=True)
class Workload:
    """One row of the matrix. ``models``: names of ``consolidation.model_specs()``. Traffic comes in
    ``phases``; in phase k the model ``models[k % n]`` gets ``burst`` requests at the phase start and
    one every ``steady_s`` after; every model also gets one every ``background_s`` (0: none)."""

    name: str
    description: str
    models: tuple[str, ...]
    phases: int
    phase_s: float
    burst: int
    steady_s: float
    background_s: float
    prompt_words: int
    new_tokens: int
    concurrency: int  # requests whose KV a model's need counts
    budget_models: float
    sleep_after_s: float | None = None  # memx: idle models sleep (consolidation)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("phases", "burst", "prompt_words", "new_tokens", "concurrency"):
            if getattr(self, name) < (0 if name == "burst" else 1):
                raise ValueError(f"workload {self.name}: {name} must be >= {0 if name == 'burst' else 1}")
        if self.budget_models <= 0:
            raise ValueError(f"workload {self.name}: budget_models must be > 0")
        if not self.models:
            raise ValueError(f"workload {self.name}: models is empty")

    @property
    def memory_bound(self) -> bool:
        return self.budget_models < len(self.models)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("bursty2", "two co-located models, out-of-phase bursts, memory for 1.2 of them",
                 ("tiny-a", "tiny-c"), phases=2, phase_s=14.0, burst=10, steady_s=2.0, background_s=0.0,
                 prompt_words=24, new_tokens=32, concurrency=10, budget_models=1.2),
        Workload("steady2", "two models, steady traffic that fits stock's memory (not memory-bound)",
                 ("tiny-a", "tiny-c"), phases=2, phase_s=14.0, burst=2, steady_s=1.5, background_s=1.5,
                 prompt_words=24, new_tokens=32, concurrency=6, budget_models=3.0),
        Workload("long2", "two models, long prompts at the memory limit",
                 ("tiny-a", "tiny-c"), phases=2, phase_s=16.0, burst=4, steady_s=4.0, background_s=0.0,
                 prompt_words=300, new_tokens=32, concurrency=4, budget_models=1.2),
        Workload("consolidation3", "three models, bursty out of phase, memory for 1.5, idle models sleep",
                 ("tiny-a", "tiny-b", "tiny-c"), phases=3, phase_s=14.0, burst=10, steady_s=2.0, background_s=0.0,
                 prompt_words=24, new_tokens=32, concurrency=10, budget_models=1.5, sleep_after_s=4.0),
    )
}  # fmt: skip
# Not in the driver yet: multi-turn prefix reuse where the donor bursts (the peer tier, W1/W2), which
# needs the peer-KV servers of benchmark/e2e/peer_kv.py rather than the router.
MISSING_WORKLOADS = {"prefix_reuse": "multi-turn prefix reuse with a bursting donor: not in the driver yet"}


def prompt(phase: int, i: int, words: int) -> str:
    return f"phase {phase} request {i} " + " ".join(f"w{i}_{j}" for j in range(words))


def schedule(w: Workload) -> list[tuple[float, str, str]]:
    """``(offset s, model, prompt)`` sorted by offset; the same for every setup and round."""
    out = []
    n = len(w.models)
    for phase in range(w.phases):
        name, start = w.models[phase % n], phase * w.phase_s
        out += [(start, name, prompt(phase, b, w.prompt_words)) for b in range(w.burst)]
        k = 1
        while k * w.steady_s < w.phase_s:
            out.append((start + k * w.steady_s, name, prompt(phase, w.burst + k, w.prompt_words)))
            k += 1
    if w.background_s > 0:
        end = w.phases * w.phase_s
        for m, name in enumerate(w.models):
            k = 0
            while (t := w.background_s * (k + 0.5) + 0.1 * m) < end:
                out.append((t, name, prompt(100 + m, k, w.prompt_words)))
                k += 1
    return sorted(out, key=lambda x: x[0])


@dataclass(frozen=True)
class ModelSize:
    weight_bytes: int
    kv_bytes_per_token: int
    prompt_tokens_max: int
    activation_bytes: int


def memory_plan(w: Workload, sizes: dict[str, ModelSize]) -> dict:
    """Needs, the budget ``M`` and the memx device size (module docstring)."""
    models = {}
    for name in w.models:
        s = sizes[name]
        need_tokens = w.concurrency * (s.prompt_tokens_max + w.new_tokens)
        models[name] = {"weight_bytes": s.weight_bytes, "kv_bytes_per_token": s.kv_bytes_per_token,
                        "prompt_tokens_max": s.prompt_tokens_max, "need_tokens": need_tokens,
                        "need_bytes": s.weight_bytes + need_tokens * s.kv_bytes_per_token,
                        "activation_bytes": s.activation_bytes}  # fmt: skip
    budget = int(w.budget_models * sum(m["need_bytes"] for m in models.values()) / len(models))
    return {"models": models, "budget_bytes": budget,
            "memx_device_bytes": budget + sum(m["activation_bytes"] for m in models.values()),
            "accounting": "M = budget_models x mean need; stock: shares of M (weights + KV), activations outside; "
                          "memx: M + every model's chunked-prefill activation (its pool holds them)"}  # fmt: skip


@dataclass(frozen=True)
class Split:
    """A static configuration of stock: each model's fraction of ``M`` and how the cores are used
    (``pinned``: each server on its own core, one thread; ``shared``: every server on all cores)."""

    name: str
    fractions: dict
    cores: str = "pinned"

    def max_total_tokens(self, plan: dict) -> dict[str, int]:
        out = {}
        for name, f in self.fractions.items():
            m = plan["models"][name]
            out[name] = int((f * plan["budget_bytes"] - m["weight_bytes"]) // m["kv_bytes_per_token"])
        return out

    def feasible(self, plan: dict, new_tokens: int) -> bool:
        """Every model's share holds its weights and one whole request."""
        toks = self.max_total_tokens(plan)
        return all(toks[n] >= plan["models"][n]["prompt_tokens_max"] + new_tokens for n in toks)


def candidate_splits(w: Workload, plan: dict) -> list[Split]:
    """The splits a user could write by hand, searched per workload: equal shares (the default a user
    starts from), shares proportional to need, each model favoured (it gets half of ``M`` with two
    models, 0.5 with three; the rest equal), and the equal split with every server on all cores.
    Infeasible ones (a share below one request) are left out."""
    names = list(w.models)
    n = len(names)
    needs = {k: plan["models"][k]["need_bytes"] for k in names}
    total = sum(needs.values())
    out = [Split("equal", dict.fromkeys(names, 1 / n)), Split("need", {k: needs[k] / total for k in names})]
    big = 0.65 if n == 2 else 0.5
    for k in names:
        out.append(Split(f"favor-{k}", {m: (big if m == k else (1 - big) / (n - 1)) for m in names}))
    out.append(Split("equal-shared-cores", dict.fromkeys(names, 1 / n), cores="shared"))
    return [s for s in out if s.feasible(plan, w.new_tokens)]
