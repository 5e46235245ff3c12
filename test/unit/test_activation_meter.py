"""PeakMeter on the host: peak of tensors allocated inside the block, inputs and views not counted."""

import torch

from memory_ext.pool.activation_meter import PeakMeter


def test_host_meter_sees_the_live_peak_of_new_tensors_only():
    w = torch.randn(512, 2048)
    x = torch.randn(100, 512)
    with PeakMeter("cpu") as meter:
        h = x @ w  # 100 x 2048 floats = 819,200 B
        g = torch.nn.functional.gelu(h)  # another 819,200 B while h is alive
        del h
        v = g[:10]  # a view: nothing new
        g.mul_(2)  # in place: nothing new
        out = g.sum()  # 4 B
        del g, v
    assert meter.peak_bytes == 2 * 819_200  # h and g together; the 4-byte sum came after h was gone
    assert out.item() != 0


def test_host_meter_counts_nothing_for_a_block_without_allocations():
    a = torch.ones(4)
    with PeakMeter("cpu") as meter:
        a.add_(1)
    assert meter.peak_bytes == 0
