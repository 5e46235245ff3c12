"""``elastic.admission.server_growth``: the governor's harm prediction in the server counts each
request's decode as upstream's admission estimates it (remaining ``max_new_tokens``, clipped, times
the pass's new-token ratio; all of it with ignore_eos), not the ``max_new_tokens`` upper bound."""

from __future__ import annotations

import types

import pytest

from memory_ext.policy.no_harm import Running, peak_shortfall
from sglang_memx.elastic import admission
from support.fakes import FakeBatch, FakeReq


def _adder(running, admitted=(), ratio=1.0, page=1):
    return types.SimpleNamespace(running_batch=FakeBatch(running), can_run_list=list(admitted), page_size=page,
                                 new_token_ratio=ratio)  # fmt: skip


def _req(prompt, outputs=0, max_new=16, ignore_eos=False):
    req = FakeReq(prompt=prompt, outputs=outputs, max_new=max_new)
    req.sampling_params.ignore_eos = ignore_eos
    return req


@pytest.mark.parametrize(
    "ratio,ignore_eos,expected",
    [
        # running: 10 + 2 tokens, 98 to go; candidate: 20 tokens, 40 to go, one of them its prefill's
        (1.0, False, [Running(12, 98, 110), Running(20, 39, 59)]),
        (0.5, False, [Running(12, 49, 61), Running(20, 19, 39)]),
        (0.33, False, [Running(12, 33, 45), Running(20, 13, 33)]),  # rounded up: 32.34 -> 33, 13.2 -> 14 - 1
        (0.5, True, [Running(12, 98, 110), Running(20, 39, 59)]),  # a fixed length: no estimate
    ],
)
def test_expected_decode(ratio, ignore_eos, expected):
    running = [_req(10, outputs=2, max_new=100, ignore_eos=ignore_eos)]
    candidate = _req(20, max_new=40, ignore_eos=ignore_eos)
    got, now_pages = admission.server_growth(_adder(running, ratio=ratio), candidate)
    assert got == expected
    assert now_pages == 20  # the candidate's prompt lands at once


def test_pages_and_admitted_in_this_pass():
    """Page rounding, and a request admitted earlier in the pass counts as the candidate does."""
    running = [_req(6, outputs=1, max_new=9)]  # 7 tokens, 8 to go
    earlier = _req(5, max_new=4)  # 3 to go after its prefill's token
    got, now_pages = admission.server_growth(_adder(running, [earlier], ratio=0.5, page=4), _req(9, max_new=8))
    # ceil(8 * .5) = 4 -> 11 tokens, 3 pages; ceil(4 * .5) - 1 = 1 -> 6 tokens, 2 pages; ceil(8 * .5) - 1 = 3 -> 3 pages
    assert got == [Running(7, 4, 3), Running(5, 1, 2), Running(9, 3, 3)]
    assert now_pages == 2 + 3


def test_the_estimate_is_what_separates_harm_from_none():
    """Eight chat requests asking for the context (4,096 new tokens, clipped) and a room of 20,000
    tokens: counted as exact, admitting a ninth is predicted to preempt; at upstream's floor-like
    ratio (0.3) it is not. With ignore_eos the lengths are known and the harm stands at any ratio."""

    def shortfall(ratio, ignore_eos):
        running = [_req(100, outputs=10, max_new=4096, ignore_eos=ignore_eos) for _ in range(8)]
        candidate = _req(100, max_new=4096, ignore_eos=ignore_eos)
        growth, now_pages = admission.server_growth(_adder(running, ratio=ratio), candidate)
        return peak_shortfall(20_000, growth, 1, now_pages)

    # the peak is when the eight finish: each grew 4,086 tokens, the ninth as many, its prompt 100
    assert shortfall(1.0, False) == 9 * 4086 + 100 - 20_000
    assert shortfall(0.7, False) > 0  # upstream's initial ratio: ~9 x 2,860 + 100, still over
    assert shortfall(0.3, False) <= 0  # ~9 x 1,226 + 100: within
    assert shortfall(0.1, True) == shortfall(1.0, True) == shortfall(1.0, False)
