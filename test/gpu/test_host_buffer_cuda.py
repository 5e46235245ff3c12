"""The host buffer's park copy from a GPU pool: the rows land in pinned host memory in one copy,
equal to the pool's rows at the request's slots. Written, not run on a GPU."""

import pytest
import torch

from sglang_memx.elastic.host_buffer import rows_on_host

pytestmark = pytest.mark.gpu


def test_rows_from_a_gpu_pool_are_pinned_and_equal():
    pool = torch.randn(64, 2, 8, device="cuda")
    idx = torch.tensor([5, 1, 40, 63], device="cuda")
    rows = rows_on_host(pool, idx)
    assert rows.device.type == "cpu" and rows.is_pinned()
    assert torch.equal(rows, pool[idx].cpu())
    pool.zero_()  # the slots are reused: the parked rows are a copy
    assert rows.abs().sum() > 0
