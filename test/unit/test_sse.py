"""``benchmark.sse.data_payloads``: the data lines' payloads in order, ``DONE`` at ``[DONE]`` (then
nothing), every other line skipped."""

from __future__ import annotations

from benchmark.sse import DONE, data_payloads


def test_payloads_in_order_then_done_and_nothing_after():
    lines = [b'data: {"a": 1}\n', b"\n", b": a comment\n", b'data:{"b": 2}\r\n', b"data: [DONE]\n", b'data: {"c": 3}\n']
    assert list(data_payloads(lines)) == [b'{"a": 1}', b'{"b": 2}', DONE]


def test_a_stream_cut_before_done_yields_what_came():
    assert list(data_payloads([b'data: {"a": 1}\n', b"\n"])) == [b'{"a": 1}']
    assert list(data_payloads([])) == []
