"""benchmark/e2e/long_prompts.py's bookkeeping, without servers: a round's host-buffer figures
are that round's own, though the server (and its counters) stays up across rounds."""

import argparse

from benchmark.e2e import long_prompts


class _MemxServer:
    """A memx server's ``/memx/status`` whose ``prefill_offloads`` counts up since its start."""

    stock, url = False, "http://memx"

    def __init__(self):
        self.offloads = 30  # warm-up and earlier rounds

    def flush_cache(self):
        pass

    def request(self, path):
        host = {"prefill_offloads": self.offloads}
        return {"schedulers": [{"elastic_kv": {"host_buffer": host}}]}


def test_prefill_offloads_per_round_not_cumulative(monkeypatch):
    server = _MemxServer()

    def play(urls, sched, new_tokens):
        server.offloads += 10  # every round offloads 10 prefills
        return [], 1.0

    monkeypatch.setattr(long_prompts, "play", play)
    args = argparse.Namespace(requests=2, prompt_words=3, new_tokens=4)
    got = [long_prompts.run_once(server, args)["prefill_offloads"] for _ in range(3)]
    assert got == [10, 10, 10]
