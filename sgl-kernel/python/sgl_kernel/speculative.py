"""CPU helpers upstream's scheduler and speculative decoding call on the CPU path.

Each implemented helper is the torch equivalent of the Triton kernel upstream
runs on GPUs at the same call site. Shared notation: ``req_to_token`` is the
request-to-token table; ``pool_len`` its row length (upstream passes
``req_to_token.shape[1]``), so request ``r``'s slot ``j`` is
``req_to_token[r, j]``. Batches are described by per-request tensors; request
``i``'s segment in a packed output starts at the sum of the lengths of the
requests before it. All writes are in place and convert to the destination dtype.

Tree-building / tree-verification and the AMX attention metadata helper are
not implemented (see ``UNSUPPORTED``).
"""

from __future__ import annotations

import torch

from sgl_kernel._unsupported import define_unsupported

__all__ = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
]


def _table(req_to_token: torch.Tensor, pool_len: int) -> torch.Tensor:
    if req_to_token.dim() == 2 and req_to_token.shape[1] == pool_len:
        return req_to_token
    return req_to_token.view(-1, pool_len)


def _segments(start_offset: torch.Tensor, end_offset: torch.Tensor, device):
    """(row_of_each_element, column_of_each_element, total) for per-request
    half-open ranges ``[start, end)`` packed one after another."""
    start = start_offset.reshape(-1).to(device=device, dtype=torch.int64)
    lengths = (end_offset.reshape(-1).to(device=device, dtype=torch.int64) - start).clamp_min(0)
    total = int(lengths.sum()) if lengths.numel() else 0
    which = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    cols = start[which] + torch.arange(total, device=device) - first[which]
    return which, cols, total


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write newly allocated KV slots into the request table.

    For request ``i`` (row ``r = req_pool_indices[i]``, length
    ``n_i = end_offset[i] - start_offset[i]``):
    ``req_to_token[r, start_offset[i] + j] = out_cache_loc[o_i + j]`` for
    ``j < n_i``, where ``o_i = n_0 + ... + n_{i-1}``.
    """
    table = _table(req_to_token, pool_len)
    which, cols, total = _segments(start_offset, end_offset, table.device)
    rows = req_pool_indices.reshape(-1).to(device=table.device, dtype=torch.int64)[which]
    table[rows, cols] = out_cache_loc.reshape(-1)[:total].to(device=table.device, dtype=table.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather slots out of the request table (the inverse of
    :func:`assign_req_to_token_pool_cpu`): ``out_cache_loc[o_i + j] =
    req_to_token[req_pool_indices[i], start_offset[i] + j]``."""
    table = _table(req_to_token, pool_len)
    which, cols, total = _segments(start_offset, end_offset, table.device)
    rows = req_pool_indices.reshape(-1).to(device=table.device, dtype=torch.int64)[which]
    out = out_cache_loc.view(-1)
    out[:total] = table[rows, cols].to(device=out.device, dtype=out.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Copy each request's ``topk * num_steps`` draft slots, which start at its
    current length: ``out_cache_loc[i * w + j] = req_to_token[req_pool_indices[i],
    seq_lens[i] + j]`` for ``j < w = topk * num_steps``."""
    width = int(topk) * int(num_steps)
    table = _table(req_to_token, pool_len)
    start = seq_lens.reshape(-1).to(device=table.device, dtype=torch.int64)
    rows = req_pool_indices.reshape(-1).to(device=table.device, dtype=torch.int64)
    cols = start[:, None] + torch.arange(width, device=table.device)[None, :]
    values = table[rows[:, None].expand_as(cols), cols].reshape(-1)
    out = out_cache_loc.view(-1)
    out[: values.numel()] = values.to(device=out.device, dtype=out.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the KV slots of accepted draft tokens.

    Walking ``accept_index`` in flat order and skipping ``-1`` entries, the
    ``m``-th accepted entry ``a`` writes ``accept_out_cache_loc[m] =
    out_cache_loc[a]``. Entries of ``accept_out_cache_loc`` past the accepted
    count are left as they are.
    """
    flat = accept_index.reshape(-1)
    accepted = flat[flat != -1].to(device=out_cache_loc.device, dtype=torch.int64)
    values = out_cache_loc.reshape(-1).index_select(0, accepted)
    out = accept_out_cache_loc.view(-1)
    out[: values.numel()] = values.to(device=out.device, dtype=out.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Pick each request's last accepted token (the bonus token).

    ``accept_tokens`` holds ``accept_stride`` slots per request (flat order) and
    ``accept_lens[i]`` counts request ``i``'s accepted tokens including the
    bonus one: ``bonus_tokens[i] = accept_tokens.flat[accept_stride * i +
    accept_lens[i] - 1]``.
    """
    lens = accept_lens.reshape(-1).to(device=accept_tokens.device, dtype=torch.int64)
    pos = torch.arange(lens.numel(), device=lens.device) * int(accept_stride) + lens - 1
    values = accept_tokens.reshape(-1).index_select(0, pos)
    out = bonus_tokens.view(-1)
    out[: values.numel()] = values.to(device=out.device, dtype=out.dtype)


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Shift each request's ids left by one and append its new token, in place.

    For request ``i`` with segment ``[s, s + n)`` (``s = extend_start_loc[i]``,
    ``n = extend_seq_lens[i]``): ``input_ids[s + j] = old input_ids[s + j + 1]``
    for ``j < n - 1``; then, if ``n > 0``, ``input_ids[q] = topk_index[i]`` with
    ``q = select_index[i]`` when given, else ``q = s + n - 1``.
    """
    ids = input_ids.view(-1)
    device = ids.device
    start = extend_start_loc.reshape(-1).to(device=device, dtype=torch.int64)
    lens = extend_seq_lens.reshape(-1).to(device=device, dtype=torch.int64)
    _, cols, _ = _segments(start, start + (lens - 1).clamp_min(0), device)
    ids[cols] = ids[cols + 1]  # advanced indexing reads a copy before writing
    has_tokens = lens > 0
    if select_index is not None:
        last = select_index.reshape(-1).to(device=device, dtype=torch.int64)
    else:
        last = start + lens - 1
    new_tokens = topk_index.reshape(-1).to(device=device, dtype=ids.dtype)
    ids[last[has_tokens]] = new_tokens[: lens.numel()][has_tokens]


UNSUPPORTED = (
    "build_tree_kernel_efficient",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy",
    "verify_tree_greedy_cpu",
    "tree_speculative_sampling_target_only",
    "reconstruct_indices_from_tree_mask",
    "build_draft_decode_metadata_cpu",
)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ += list(UNSUPPORTED)
