"""``sglang-memx profile``: measure a model's layer profile on this machine with real SGLang.

Starts ``python -m sglang.launch_server`` with the model's decoder layers in the pool and
none streamed (``--memx-weights static --memx-weights-streamed 0``), so the layer pipeline
times every decoder layer of every forward; runs decode steps at each batch size and one
long prefill; reads the per-layer medians and the store's measured copy bandwidth from
``/memx/status``; writes a ``LayerProfile`` (``memx.layer_profile/1`` JSON). The server is
stopped whatever happens.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

from memory_ext.policy.layer_profile import LayerProfile
from sglang_memx.ports import free_port

CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native",
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]  # fmt: skip
POOL_ARGS = ["--memx-elastic-kv", "--memx-weights", "static", "--memx-weights-streamed", "0",
             "--memx-pool-budget-gb", "4096"]  # a budget is required; chunks are only created as used  # fmt: skip
WORD = "memory "


def _post(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _weights_status(url: str) -> dict:
    with urllib.request.urlopen(url + "/memx/status", timeout=30) as r:
        return json.load(r)["schedulers"][0]["elastic_kv"]["weights"]


def _wait_healthy(proc, url: str, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server was not healthy within {timeout} s; see {log_path}")


def _generate(url: str, n_requests: int, prompt_words: int, new_tokens: int, timeout: float) -> None:
    payload = {"text": WORD * prompt_words,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
        for f in [pool.submit(_post, url + "/generate", dict(payload, text=f"{i} " + payload["text"]), timeout)
                  for i in range(n_requests)]:  # fmt: skip
            f.result()


def _stop(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def profile(model_path: str, out: str, *, batch_sizes=(1, 2, 4, 8), decode_tokens: int = 32,
            prompt_words: int = 16, prefill_words: int = 256, device: str = "cpu", extra_args=(),
            log_path: str = "sglang-memx-profile.log", timeout: float = 900.0) -> LayerProfile:  # fmt: skip
    """Measure and write the profile (see the module docstring); returns it."""
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
            "--port", str(port), *(CPU_ARGS if device == "cpu" else []), *POOL_ARGS, *extra_args]  # fmt: skip
    env = dict(os.environ, **({"SGLANG_USE_CPU_ENGINE": "1"} if device == "cpu" else {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_healthy(proc, url, timeout, log_path)
            for b in sorted(set(batch_sizes)):
                _generate(url, b, prompt_words, decode_tokens, timeout)
            _generate(url, 1, prefill_words, 1, timeout)
            w = _weights_status(url)
        finally:
            _stop(proc)
    by_batch = {int(b): s for b, s in w["decode_layer_s_by_batch"].items() if int(b) in set(batch_sizes)}
    dtype = extra_args[list(extra_args).index("--dtype") + 1] if "--dtype" in extra_args else "auto"
    record = LayerProfile(
        model=os.path.basename(os.path.normpath(model_path)),
        device=device,
        dtype=dtype,
        n_layers=w["layers"],
        layer_bytes=w["layer_bytes"],
        link_bytes_per_s=float(w["link_bytes_per_s"]),
        decode_layer_s=by_batch,
        prefill_layer_s_per_token=w["prefill_layer_s_per_token"],
        seq_len=prompt_words + decode_tokens // 2,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join(
            [
                "sglang-memx",
                "profile",
                "--model-path",
                model_path,
                "--out",
                out,
                "--batch-sizes",
                ",".join(map(str, batch_sizes)),
                "--device",
                device,
                "--",
                *extra_args,
            ]
        ),
    )
    record.save(out)
    return record
