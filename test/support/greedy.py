"""Greedy requests and memx status reads shared by the integration modules that compare a memx
server's answers with stock's (elastic KV, families, tensor parallel)."""

from __future__ import annotations

import time


def greedy(server, text, n: int = 24, ignore_eos: bool = True):
    """``/generate`` of a text (or a batch of texts) with greedy sampling, ``n`` new tokens."""
    return server.request(
        "/generate",
        {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": ignore_eos}},
    )


def output_ids(out) -> list:
    """The output token ids of one answer, or of each answer of a batch."""
    return [r["output_ids"] for r in out] if isinstance(out, list) else out["output_ids"]


def elastic_status(server) -> dict:
    """The first scheduler's ``elastic_kv`` section of ``/memx/status``."""
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]


def flush_until_one_group_mapped(server, timeout_s: float = 30.0) -> dict:
    """Flush the radix cache, then poll until only group 0 (the padded page) stays mapped or
    ``timeout_s`` passes; the last ``elastic_kv`` status read."""
    server.request_text("/flush_cache")
    deadline = time.time() + timeout_s
    while True:
        st = elastic_status(server)
        if st["groups_mapped"] == 1 or time.time() >= deadline:
            return st
        time.sleep(0.5)


PROMPTS = ["The capital of France is", "Pages map to chunks", "one two three four five", "Elastic memory for serving"]


def assert_batch_prefix_hits_and_chunked_prefill_match(stock, memx) -> None:
    """A batch of ``PROMPTS``, two prompts sharing a 40-word prefix (the second hits the cache), and
    a prompt of many 16-token chunks: ``memx``'s greedy answers are ``stock``'s."""
    assert output_ids(greedy(memx, PROMPTS)) == output_ids(greedy(stock, PROMPTS))
    prefix = " ".join(f"shared{i}" for i in range(40))
    want = [output_ids(greedy(stock, prefix + tail)) for tail in (" alpha", " beta")]
    first, second = greedy(memx, prefix + " alpha"), greedy(memx, prefix + " beta")
    assert [first["output_ids"], second["output_ids"]] == want
    assert second["meta_info"]["cached_tokens"] > 0
    long_prompt = " ".join(f"w{i % 37}x{i}" for i in range(60))
    want = greedy(stock, long_prompt, 16)
    assert want["meta_info"]["prompt_tokens"] > 128
    assert greedy(memx, long_prompt, 16)["output_ids"] == want["output_ids"]
