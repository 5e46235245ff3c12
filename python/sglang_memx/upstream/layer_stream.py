"""What the layer stream cache (``--memx-peer-layer-stream``) reads and does on upstream objects:
the pool configurator's token count, the attention layer's id, the rows a forward batch reads and
writes, the abort of every request when the donor is gone, and the withholding of a step whose
streamed KV may be wrong (see ``manifest``)."""

from __future__ import annotations

from http import HTTPStatus

import torch

from sglang_memx.upstream.manifest import resolve


# ------------------------------------------------------------------ the pool build
def configurator_layers(configurator) -> int:
    return int(configurator.model_config.num_hidden_layers)


def configurator_kv_dtype(configurator) -> torch.dtype:
    return configurator.kv_cache_dtype


def pool_config_tokens(pool_config) -> int:
    return int(pool_config.max_total_num_tokens)


def set_pool_config_tokens(pool_config, tokens: int) -> None:
    pool_config.max_total_num_tokens = int(tokens)


def req_to_token_table(config_result) -> torch.Tensor:
    """``req_to_token[req_pool_index, position]`` = KV slot, as the attention backends read it."""
    req_pool = config_result.req_to_token_pool
    return req_pool.req_to_token


# ------------------------------------------------------------------ one attention call
def attn_layer_id(attn_layer) -> int:
    return int(attn_layer.layer_id)


def read_rows(forward_batch, req_to_token: torch.Tensor) -> torch.Tensor:
    """Every KV slot the batch's requests hold (positions ``[0, seq_len)``): what attention reads."""
    indices = forward_batch.req_pool_indices.tolist()
    lens = forward_batch.seq_lens.tolist()
    if not indices:
        return torch.empty(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat([req_to_token[i, :n] for i, n in zip(indices, lens)]).to(torch.int64)


def written_rows(forward_batch) -> torch.Tensor:
    """The KV slots this forward writes (its new tokens)."""
    return forward_batch.out_cache_loc.to(torch.int64)


# ------------------------------------------------------------------ the scheduler
def abort_everything(scheduler, message: str) -> None:
    """Abort every waiting and running request with ``message`` (HTTP 503 for the client)."""
    reason = resolve("sglang.srt.managers.schedule_batch.FINISH_ABORT")(message, HTTPStatus.SERVICE_UNAVAILABLE)
    abort = resolve("sglang.srt.managers.io_struct.AbortReq")(
        abort_all=True, abort_message=message, finished_reason=reason.to_json()
    )
    scheduler.abort_request(abort)


def withhold_step(scheduler, batch, message: str) -> int:
    """End every request of ``batch`` still running with ``message`` (HTTP 503) before upstream
    processes the step's results, so that no token of this step reaches a client. For each one:

    * the client gets the abort now (``send_abort_output``; it carries no token of this step);
    * ``to_finish``: upstream's result processing finishes it at this step and frees its KV, as for
      any aborted running request;
    * ``finished_output``: upstream's output stream skips a finished request whose final output is
      out, so the token that processing appends is never sent.

    Requests already finished (their outputs came from earlier, whole steps), retracted (back in the
    queue, no token this step) or already withheld are left alone. Returns how many were ended."""
    reason_type = resolve("sglang.srt.managers.schedule_batch.FINISH_ABORT")
    abort_type = resolve("sglang.srt.managers.io_struct.AbortReq")
    ended = 0
    for req in batch.reqs:
        if req.finished() or req.is_retracted or req.finished_output:
            continue
        reason = reason_type(message, HTTPStatus.SERVICE_UNAVAILABLE)
        scheduler.send_abort_output(abort_type(rid=req.rid, finished_reason=reason.to_json()), req)
        req.to_finish = reason
        req.finished_output = True
        ended += 1
    return ended
