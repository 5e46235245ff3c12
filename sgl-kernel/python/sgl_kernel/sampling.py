"""Top-k / top-p / min-p filtering and sampling over probability rows, in plain torch.

Shared conventions (all ops):
  * ``probs`` is ``(batch, vocab)`` of non-negative values; arithmetic in float32.
  * A per-row parameter may be a Python scalar (same for every row) or a tensor
    of shape ``(batch,)``.
  * Filtering is by value threshold, so ties are kept together: every entry
    equal to the cut-off value survives. A row can therefore keep more than
    ``k`` entries under top-k, or slightly more mass than needed under top-p,
    when probabilities tie at the boundary. The largest entry of a row always
    survives.
  * top-k: ``k <= 0`` or ``k >= vocab`` keeps the whole row.
  * top-p: a sorted entry survives when the mass of the entries strictly
    larger-ranked than it is ``< p``; ``p >= 1`` keeps the whole row.
  * min-p: an entry survives when ``prob >= min_p * max(row)``.
  * The joint top-k + top-p filter keeps entries that pass both filters, each
    computed on the original row (so it agrees with applying
    :func:`top_k_renorm_prob` and :func:`top_p_renorm_prob` separately and
    intersecting their supports).
  * Renormalised rows sum to 1; a row whose surviving mass is 0 stays all zero.
  * Sampling draws with ``torch.multinomial`` from the filtered row (optionally
    with a ``torch.Generator``) and returns ``int32`` token ids of shape
    ``(batch,)``. ``deterministic`` is accepted for signature compatibility;
    for a fixed generator state results are reproducible.
"""

from __future__ import annotations

import torch

from sgl_kernel._unsupported import define_unsupported

__all__ = [
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "top_k_top_p_sampling_from_probs",
    "min_p_sampling_from_probs",
]

Param = torch.Tensor | int | float


def _per_row(value: Param, batch: int, device, dtype) -> torch.Tensor:
    """A ``(batch, 1)`` column holding ``value`` for each row."""
    if isinstance(value, torch.Tensor):
        t = value.to(device=device, dtype=dtype).reshape(-1)
        if t.numel() == 1:
            t = t.expand(batch)
        if t.numel() != batch:
            raise ValueError(f"expected {batch} per-row values, got {t.numel()}")
        return t.reshape(batch, 1)
    return torch.full((batch, 1), value, device=device, dtype=dtype)


def _top_k_mask(p: torch.Tensor, top_k: Param) -> torch.Tensor:
    batch, vocab = p.shape
    k = _per_row(top_k, batch, p.device, torch.int64)
    no_filter = (k <= 0) | (k >= vocab)
    sorted_desc = p.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k.clamp(1, vocab) - 1))
    return no_filter | (p >= kth)


def _top_p_mask(p: torch.Tensor, top_p: Param) -> torch.Tensor:
    batch, _ = p.shape
    tp = _per_row(top_p, batch, p.device, torch.float32)
    sorted_desc = p.sort(dim=-1, descending=True).values
    mass_before = sorted_desc.cumsum(dim=-1) - sorted_desc
    keep_sorted = mass_before < tp
    keep_sorted[:, 0] = True
    # Smallest surviving value is the threshold; ties with it survive as well.
    threshold = torch.where(keep_sorted, sorted_desc, torch.full_like(sorted_desc, float("inf")))
    threshold = threshold.min(dim=-1, keepdim=True).values
    return (tp >= 1.0) | (p >= threshold)


def _min_p_mask(p: torch.Tensor, min_p: Param) -> torch.Tensor:
    batch, _ = p.shape
    mp = _per_row(min_p, batch, p.device, torch.float32)
    return p >= mp * p.max(dim=-1, keepdim=True).values


def _renorm(p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, p, torch.zeros_like(p))
    total = kept.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, kept / total.clamp_min(torch.finfo(p.dtype).tiny), kept)


def _as_rows(probs: torch.Tensor) -> torch.Tensor:
    if probs.dim() != 2:
        raise ValueError(f"probs must be (batch, vocab), got shape {tuple(probs.shape)}")
    return probs.float()


def top_k_renorm_prob(probs: torch.Tensor, top_k: Param) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (ties at the k-th value
    included), zero the rest and renormalise the row to sum to 1.

    Returns a new tensor in ``probs.dtype``; ``probs`` is not modified. See the
    module docstring for ``k <= 0`` / ``k >= vocab`` and tie handling.
    """
    p = _as_rows(probs)
    return _renorm(p, _top_k_mask(p, top_k)).to(probs.dtype)


def top_p_renorm_prob(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    """Keep the smallest high-probability prefix of each row whose mass reaches
    ``top_p`` (nucleus), zero the rest and renormalise the row to sum to 1.

    An entry (in descending order) survives when the mass ranked before it is
    ``< top_p``; ties with the last survivor also survive. Returns a new tensor
    in ``probs.dtype``.
    """
    p = _as_rows(probs)
    return _renorm(p, _top_p_mask(p, top_p)).to(probs.dtype)


# Upstream exposes both spellings.
top_k_renorm_probs = top_k_renorm_prob
top_p_renorm_probs = top_p_renorm_prob


def _select_rows(probs: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
    """Rows to sample from: ``probs`` itself, or ``probs[indices]`` (output row i
    samples from probs row ``indices[i]``; per-row parameters follow output rows)."""
    p = _as_rows(probs)
    if indices is not None:
        p = p.index_select(0, indices.reshape(-1).to(device=p.device, dtype=torch.int64))
    return p


def _check_nan(p: torch.Tensor, check_nan: bool) -> None:
    if check_nan and bool(torch.isnan(p).any()):
        raise ValueError("probs contain NaN")


def _draw(p: torch.Tensor, keep: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    weights = torch.where(keep, p, torch.zeros_like(p))
    return torch.multinomial(weights, 1, generator=generator).reshape(-1).to(torch.int32)


def top_k_top_p_sampling_from_probs(
    probs: torch.Tensor,
    top_k: Param,
    top_p: Param,
    indices: torch.Tensor | None = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
) -> torch.Tensor:
    """Sample one token per row after top-k and top-p filtering.

    ``filter_apply_order``:
      * ``"top_k_first"``: top-k filter + renormalise, then top-p on the
        renormalised row, then sample;
      * ``"joint"``: keep entries passing both the top-k and the top-p filter,
        each computed on the original row, then sample.
    Returns ``int32`` ids of shape ``(batch,)``; a returned id is never a
    filtered-out entry. ``indices`` optionally maps output rows to ``probs``
    rows. ``check_nan=True`` raises ``ValueError`` on NaN input.
    """
    p = _select_rows(probs, indices)
    _check_nan(p, check_nan)
    if filter_apply_order == "top_k_first":
        p = _renorm(p, _top_k_mask(p, top_k))
        keep = _top_p_mask(p, top_p) & (p > 0)
    elif filter_apply_order == "joint":
        keep = _top_k_mask(p, top_k) & _top_p_mask(p, top_p)
    else:
        raise ValueError(f"unknown filter_apply_order {filter_apply_order!r}")
    return _draw(p, keep, generator)


def min_p_sampling_from_probs(
    probs: torch.Tensor,
    min_p: Param,
    indices: torch.Tensor | None = None,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    check_nan: bool = False,
) -> torch.Tensor:
    """Sample one token per row among entries with ``prob >= min_p * max(row)``.

    Returns ``int32`` ids of shape ``(batch,)``. ``indices``, ``generator`` and
    ``check_nan`` as in :func:`top_k_top_p_sampling_from_probs`.
    """
    p = _select_rows(probs, indices)
    _check_nan(p, check_nan)
    return _draw(p, _min_p_mask(p, min_p), generator)


# Upstream names in this module without a portable implementation.
UNSUPPORTED = ("apply_token_bitmask_inplace_cuda",)
define_unsupported(globals(), __name__, UNSUPPORTED)
__all__ += list(UNSUPPORTED)
