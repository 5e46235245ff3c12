"""Stand-ins for upstream scheduler objects in unit tests.

Each carries exactly the attributes ``sglang_memx.upstream`` reads (the manifest's members
of Req, ScheduleBatch, Scheduler, ...), so memx's modules run on them unchanged; a test
sets what it needs through the constructors' keyword arguments.
"""

from __future__ import annotations

import types


class FakeMode:
    def __init__(self, decode: bool, mixed: bool = False):
        self.decode = decode and not mixed
        self.mixed = mixed

    def is_decode(self) -> bool:
        return self.decode

    def is_mixed(self) -> bool:
        return self.mixed

    def is_extend(self) -> bool:  # upstream counts a mixed batch as extend too
        return not self.decode


class FakeReq:
    _next = 0

    def __init__(self, prompt=8, outputs=0, max_new=16, rid=None, finished=False, allocated=None, **fields):
        FakeReq._next += 1
        self.rid = rid or f"r{FakeReq._next}"
        self.origin_input_ids = list(range(prompt))
        self.output_ids = [0] * outputs
        self.sampling_params = types.SimpleNamespace(max_new_tokens=max_new, ignore_eos=False)
        self.full_untruncated_fill_ids = list(range(prompt + outputs))
        self.prefix_len = 0
        self.kv = types.SimpleNamespace(
            kv_allocated_len=prompt + outputs if allocated is None else allocated, holds_kv=True, req_pool_idx=0
        )
        self.extra_key = None
        self.cache_salt = None
        self.is_retracted = False
        self.return_logprob = False
        self.grammar = None
        self.input_embeds = None
        self.multimodal_inputs = None
        self.session = None
        self.beam_group = None
        self.lora_id = None
        self._finished = finished
        for k, v in fields.items():
            setattr(self, k, v)

    def finished(self) -> bool:
        return self._finished

    def owned_kv_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)


class FakeBatch:
    def __init__(self, reqs=(), decode=True, allocator=None, mixed=False, extend_tokens=None):
        self.reqs = list(reqs)
        self.extend_num_tokens = extend_tokens
        self.forward_mode = FakeMode(decode, mixed)
        self.token_to_kv_pool_allocator = allocator
        self.req_to_token_pool = None
        self.batch_is_full = False

    def filter_batch(self, reqs_to_exclude=None):
        gone = {id(r) for r in reqs_to_exclude or ()}
        self.reqs = [r for r in self.reqs if id(r) not in gone]


class FakeScheduler:
    def __init__(self, waiting=(), running=(), decode=True, last=None, allocator=None, tree=None, page_size=1,
                 chunked_prefill_size=None, ratio=0.7, max_running=1 << 20,
                 max_prefill_tokens=16384, prefill_tokens=None):  # fmt: skip
        self.waiting_queue = list(waiting)
        self.max_running = max_running
        self.running_batch = FakeBatch(running, decode=True, allocator=allocator)
        self.last_batch = self.running_batch if last is None else last
        if last is None and not decode:
            self.last_batch = FakeBatch(running, decode=False, allocator=allocator, extend_tokens=prefill_tokens)
        self.chunked_req = None
        self.page_size = page_size
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_total_num_tokens = 1 << 20
        self.new_token_ratio_tracker = types.SimpleNamespace(current=ratio)
        self.token_to_kv_pool_allocator = allocator
        self.tree_cache = tree
        self.server_args = None
        self.max_req_len = 1 << 20
        self.max_req_input_len = 1 << 20
        self.req_to_token_pool = None
        self.hisparse_coordinator = None
        self.idle_sleeper = None

    def get_num_allocatable_reqs(self, running_bs, *args, **kwargs):
        return self.max_running - running_bs


def fake_admission_pool(available: int, buffer_tokens: int, row_bytes: int):
    """What an admission pass reads besides upstream's budget: an allocator with ``available``
    free tokens over a 4-row fake KV pool (``row_bytes`` per token), a radix tree with nothing
    evictable, and a host buffer of ``buffer_tokens`` tokens (None when 0).
    Returns ``(allocator, tree, host)``."""
    import torch

    from sglang_memx.config import MemxConfig
    from sglang_memx.elastic.host_buffer import build_host_buffer

    pool = types.SimpleNamespace(k_buffer=[torch.zeros(4, row_bytes // 2, dtype=torch.uint8)],
                                 v_buffer=[torch.zeros(4, row_bytes // 2, dtype=torch.uint8)])  # fmt: skip
    allocator = types.SimpleNamespace(page_size=1, available_size=lambda: available, get_kvcache=lambda: pool)
    tree = types.SimpleNamespace(supports_mamba=lambda: False, evictable_size=lambda: 0)
    host = None
    if buffer_tokens:
        config = MemxConfig(elastic_kv=True, host_buffer_gb=buffer_tokens * row_bytes / (1 << 30))
        host = build_host_buffer(config, row_bytes)
    return allocator, tree, host
