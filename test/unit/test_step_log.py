"""benchmark.step_log: decode step time by batch size from upstream's per-step log lines, and
bench_serving's per-round step ratios."""

from __future__ import annotations

import pytest

from benchmark.e2e import bench_serving as bs
from benchmark.step_log import read_from, summarize


def _decode(running: int, rate: float) -> str:
    return (f"[2026-12-04 23:19:53] Decode batch, #running-req: {running}, #token: 900, token usage: 0.05, "
            f"cpu graph: False, gen throughput (token/s): {rate:.2f}, #queue-req: 0")  # fmt: skip


def _prefill(seqs: int, tokens: int) -> str:
    return (f"[2026-12-04 23:19:53] Prefill batch, #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, "
            "token usage: 0.91, #running-req: 64, #queue-req: 20")  # fmt: skip


def test_only_a_decode_line_after_a_decode_line_is_a_step():
    log = "\n".join([
        _decode(2, 100.0),  # first line: no predecessor, not a step
        _decode(2, 40.0),  # 2 / 40 = 50 ms
        _prefill(1, 300),
        _decode(3, 10.0),  # after a prefill forward: the gap holds it, not a step
        _decode(3, 30.0),  # 100 ms
        "INFO: 127.0.0.1 - POST /v1/completions 200 OK",  # other lines do not break a run of steps
        _decode(10, 50.0),  # 200 ms
        _decode(10, 0.0),  # no rate: not a step
    ])  # fmt: skip
    got = summarize([log])
    assert got["prefill_batches"] == 1 and got["prefill_tokens"] == 300 and got["decode_steps"] == 3
    assert got["by_batch"]["1-8"] == {"steps": 2, "step_ms_p50": pytest.approx(75.0), "mean_batch": 2.5}
    assert got["by_batch"]["9-16"] == {"steps": 1, "step_ms_p50": pytest.approx(200.0), "mean_batch": 10}
    assert set(got["by_batch"]) == {"1-8", "9-16"}


def test_each_log_is_read_on_its_own():
    """A decode line ending one engine's log does not make the first line of another a step."""
    got = summarize([_decode(1, 10.0), _decode(1, 20.0)])
    assert got["decode_steps"] == 0 and got["by_batch"] == {}
    assert summarize([_decode(100, 10.0) + "\n" + _decode(100, 20.0)])["by_batch"]["97+"]["steps"] == 1


def test_read_from_returns_what_the_log_gained(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("before\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("during\n")
    assert read_from(log, offset) == "during\n"
    log.write_text("new\n")  # rotated (shorter than the offset): the whole log
    assert read_from(log, offset) == "new\n"


def test_step_ratios_per_bin_over_the_rounds_with_enough_steps():
    def run(ms: float, steps: int = 5) -> dict:
        return {"steps": {"by_batch": {"49-64": {"steps": steps, "step_ms_p50": ms, "mean_batch": 60}}}}

    rounds = [
        {"stock": run(100.0), "memx": run(110.0)},
        {"stock": run(100.0), "memx": run(90.0)},
        {"stock": run(100.0), "memx": run(300.0, steps=4)},  # too few steps in the bin: not counted
        {"stock": run(100.0), "memx": {"steps": {"by_batch": {}}}},  # no step in the bin
    ]
    got = bs.step_ratios(rounds, "memx")
    assert list(got) == ["49-64"]
    assert got["49-64"]["values"] == pytest.approx([1.1, 0.9])
    assert got["49-64"]["median"] == pytest.approx(1.0) and got["49-64"]["max"] == pytest.approx(1.1)


@pytest.mark.parametrize(
    "flags, want",
    [("--decode-log-interval 1", True), ("--decode-log-interval=1", True), ("--decode-log-interval 40", False),
     ("", False), ("--chunked-prefill-size 1 --decode-log-interval 1", True)],
)  # fmt: skip
def test_steps_are_recorded_only_when_every_step_is_logged(flags, want):
    assert bs.logs_every_step(flags) is want
