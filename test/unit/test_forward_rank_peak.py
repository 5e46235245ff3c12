"""A measured forward's activation peak under tensor parallel (``elastic.forward.run_forward``'s
``agree``): the ranks record the same peak, the largest rank's, and a meter that failed on any rank
stops the measuring on every rank (each rank still makes exactly one collective call)."""

from __future__ import annotations

import pytest

from sglang_memx.elastic import forward as fwd

torch = pytest.importorskip("torch")


class Balloon:
    mempool = None

    def __init__(self):
        self.recorded: list[tuple[int, int, int]] = []
        self.stopped = False

    def wants_measurement(self, tokens: int) -> bool:
        return not self.stopped

    def record_measurement(self, tokens: int, seqs: int, peak: int) -> None:
        self.recorded.append((tokens, seqs, peak))

    def stop_measuring(self) -> None:
        self.stopped = True


def _forward():
    return torch.ones(256, 64).sum()


def test_the_recorded_peak_is_the_largest_ranks():
    balloon, calls = Balloon(), []

    def agree(peak: int) -> int:
        calls.append(peak)
        return max(peak, 10_000_000)  # the other rank measured more

    fwd.run_forward(balloon, "cpu", (16, 2), _forward, agree=agree)
    assert len(calls) == 1 and 0 < calls[0] < 10_000_000  # this rank's own peak went into the collective
    assert balloon.recorded == [(16, 2, 10_000_000)] and not balloon.stopped


def test_without_ranks_the_own_peak_is_recorded():
    balloon = Balloon()
    fwd.run_forward(balloon, "cpu", (16, 0), _forward)
    assert len(balloon.recorded) == 1 and balloon.recorded[0][:2] == (16, 1) and balloon.recorded[0][2] > 0


@pytest.mark.parametrize("own_meter_fails", [True, False])
def test_a_failed_meter_on_any_rank_stops_measuring_on_every_rank(monkeypatch, own_meter_fails):
    class Broken(fwd.PeakMeter):
        def __enter__(self):
            raise RuntimeError("no meter here")

    if own_meter_fails:
        monkeypatch.setattr(fwd, "PeakMeter", Broken)
    balloon, calls = Balloon(), []

    def agree(peak: int) -> int:
        calls.append(peak)
        return fwd.METER_FAILED  # this rank's failure, or the other rank's

    out = fwd.run_forward(balloon, "cpu", (16, 1), _forward, agree=agree)
    assert float(out) == 256 * 64  # the forward itself ran
    assert len(calls) == 1 and (calls[0] == fwd.METER_FAILED) == own_meter_fails
    assert balloon.stopped and balloon.recorded == []
