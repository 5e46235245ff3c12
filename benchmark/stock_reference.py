"""Greedy probes and stock SGLang's answers to them (issue 27, item 2).

The soak and the fault suite check answers against what **stock** SGLang says, not only against
what memx said before the traffic started: before ``sglang-memx serve`` starts, one stock
``launch_server`` per model (the memx plugin filtered out, the engines' dtype and chunked
prefill) answers every probe, one request at a time, and is stopped. The memx side is then held
to those answers at every check.

Equal batching. The CPU kernels are not batch-invariant and upstream's deterministic-inference
mode refuses ``torch_native`` attention, so stock answers at batch 1 and the comparison is exact
where memx answers at batch 1 too: at quiet points (traffic drained). During the load a probe
shares its batch with the traffic; the tiny float32 models' 8 greedy tokens have held under that
in every run so far, and a mismatch there is reported like any other.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmark.e2e.router_proc import http_json

PROBES = (
    "The soak probe asks the same thing every time:",
    "Memory pages map to chunks when",
    "one two three four five",
)
PROBE_TOKENS = 8
# What ``serve`` gives every engine of soak.py's / faults.py's config; stock gets the same.
ENGINE_ARGS = ["--dtype", "float32", "--chunked-prefill-size", "64"]


def probe_answers(url: str, model: str, timeout: float) -> list[str]:
    """The greedy answers to ``PROBES`` through an OpenAI completions route, one request at a
    time (``url`` is the router, or a single server with ``model`` ``default``)."""
    out = []
    for prompt in PROBES:
        body = {"model": model, "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0}
        out.append(http_json(url + "/v1/completions", body, timeout=timeout)["choices"][0]["text"])
    return out


def stock_answers(models: dict[str, Path], timeout: float, name_prefix: str = "stock-ref") -> dict[str, list[str]]:
    """Start one stock server per model (concurrently, a core each), ask each its probes, stop
    them all; ``{model name: answers}``. Raises if a stock server does not start (the run has no
    reference then, and says so)."""
    from support.server import SGLangServer, start_all

    servers = {
        name: SGLangServer(path, name=f"{name_prefix}-{name}", stock=True, extra_args=ENGINE_ARGS)
        for name, path in models.items()
    }
    try:
        start_all(list(servers.values()))
        return {name: probe_answers(s.url, "default", timeout) for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


def mismatches(got: dict[str, list[str]], reference: dict[str, list[str]]) -> list[str]:
    """One line per probe whose answer differs from the reference (the model, the prompt, both
    answers); empty when all equal. A model missing on either side is a mismatch."""
    out = []
    for name in sorted(set(got) | set(reference)):
        mine, theirs = got.get(name), reference.get(name)
        if mine is None or theirs is None:
            out.append(f"{name}: answers {'missing' if mine is None else 'present'} here, "
                       f"{'missing' if theirs is None else 'present'} in the reference")  # fmt: skip
            continue
        for prompt, a, b in zip(PROBES, mine, theirs):
            if a != b:
                out.append(f"{name}: {prompt!r} -> {a!r}, stock {b!r}")
    return out


def reference_answers(args, models: dict[str, Path]) -> dict[str, list[str]] | None:
    """Stock SGLang's answers to the probes (``args.stock_reference == "on"``), else None."""
    if args.stock_reference == "off":
        return None
    t0 = time.monotonic()
    ref = stock_answers(models, args.request_timeout_s)
    print(f"stock reference answers in {time.monotonic() - t0:.0f} s", flush=True)
    return ref


def held_to(checker, got: dict[str, list[str]], reference: dict[str, list[str]] | None, label: str) -> None:
    """Append a ``probe`` violation to ``checker`` per answer that differs from stock's (nothing
    without a reference)."""
    if reference is not None:
        checker.violations.extend(f"{label}: probe differs from stock: {line}" for line in mismatches(got, reference))
