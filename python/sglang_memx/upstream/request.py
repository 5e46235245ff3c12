"""A scheduler request (``sglang.srt.managers.schedule_batch.Req``) and an abort
(``sglang.srt.managers.io_struct.AbortReq``), as memx reads them.

memx keeps its own per-request state in one namespace on the request
(``memx_state``), never in loose attributes.
"""

from __future__ import annotations

import types

from sglang_memx.upstream.manifest import resolve

STATE_ATTR = "_memx"


def memx_state(req) -> types.SimpleNamespace:
    """memx's per-request fields (created on first use): offload bytes, pending abort, SLO timestamps,
    ``decoding_since`` (the governor's: clock and output length when a tick first saw a token)."""
    state = vars(req).get(STATE_ATTR)
    if state is None:
        state = types.SimpleNamespace(offload_bytes=0, pending_abort=None, seen_at=None, ttft_done=False, last_out=None,
                                      decoding_since=None)  # fmt: skip
        setattr(req, STATE_ATTR, state)
    return state


def rid(req) -> str:
    return req.rid


def prompt_ids(req) -> list:
    return req.origin_input_ids


def output_ids(req) -> list:
    return req.output_ids


def prompt_len(req) -> int:
    return len(req.origin_input_ids)


def output_len(req) -> int:
    return len(req.output_ids)


def fill_len(req) -> int:
    """Tokens the next prefill of ``req`` covers from the start (prompt, untruncated)."""
    return len(req.full_untruncated_fill_ids)


def cached_prefix_len(req) -> int:
    """Tokens of ``req`` its last prefix match found cached on the device."""
    return req.prefix_len


def max_new_tokens(req) -> int:
    return int(req.sampling_params.max_new_tokens or 0)


def ignores_eos(req) -> bool:
    return bool(req.sampling_params.ignore_eos)


def remaining_new_tokens(req) -> int:
    """Remaining ``max_new_tokens``, clipped the way upstream's admission estimates it."""
    clip = resolve("sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS")
    return min(max(max_new_tokens(req) - len(req.output_ids), 0), clip)


def is_finished(req) -> bool:
    return bool(req.finished())


def kv_allocated_len(req) -> int:
    return int(req.kv.kv_allocated_len)


def holds_kv(req) -> bool:
    return bool(req.kv.holds_kv)


def req_pool_index(req):
    return req.kv.req_pool_idx


def owned_kv_len(req) -> int:
    return int(req.owned_kv_len())


def radix_key(req, tokens):
    """The radix-cache key of ``tokens`` under ``req``'s namespace (extra key, cache salt)."""
    from array import array

    radix_key_cls = resolve("sglang.srt.mem_cache.radix_cache.RadixKey")
    return radix_key_cls(array("q", tokens), req.extra_key, cache_salt=req.cache_salt)


def is_plain_text_request(req) -> bool:
    """A new plain text request: no output yet, not retracted, no logprobs, grammar, embeddings,
    images, session, beam group or LoRA (the host buffer's resume path is not exercised for those)."""
    return (
        len(req.output_ids) == 0
        and not req.is_retracted
        and not req.return_logprob
        and req.grammar is None
        and req.input_embeds is None
        and req.multimodal_inputs is None
        and req.session is None
        and req.beam_group is None
        and req.lora_id is None
        and not req.finished()
    )


def has_input_embeds(req) -> bool:
    return req.input_embeds is not None


def abort_matches(abort, req) -> bool:
    """Whether the abort request ``abort`` (an ``AbortReq``) names ``req``."""
    return bool(abort.abort_all) or req.rid.startswith(abort.rid)
