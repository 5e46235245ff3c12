"""The router's activity publisher (``serve.activity.ActivityPublisher``): what goes out when."""

import asyncio

import pytest

from sglang_memx.serve.activity import ActivityPublisher


def _doc(queued=0, inflight=0, rate=0.0, tokens=0):
    return {"queued": queued, "inflight": inflight, "arrival_rate": rate, "queued_tokens": tokens,
            "since_arrival_s": None}  # fmt: skip


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _publisher(docs: dict, engines=("http://e1",)):
    clock = _Clock()
    pub = ActivityPublisher(["m"], lambda model: docs["m"], lambda model: list(engines), clock=clock)
    return pub, clock


class _Client:
    def __init__(self):
        self.posts = []

    async def post(self, url, json, headers, timeout):
        self.posts.append((url, json))
        return type("R", (), {"status_code": 200, "text": ""})()


def _round(pub, client) -> int:
    return asyncio.run(pub.publish_once(client))


@pytest.mark.parametrize(
    "before, after, sent",
    [
        (
            _doc(inflight=3, rate=4.0),
            _doc(inflight=5, rate=4.0),
            False,
        ),  # more in flight: the engines' view is the same
        (_doc(inflight=3, rate=4.0), _doc(inflight=0, rate=4.0), True),  # in-flight work ended
        (_doc(inflight=0, rate=4.0), _doc(inflight=1, rate=4.0), True),  # ... or started
        (_doc(queued=1, tokens=64), _doc(queued=2, tokens=128), True),  # the queue grew
        (_doc(queued=2, tokens=64), _doc(queued=2, tokens=96), True),  # its tokens changed
        (_doc(), _doc(), False),  # nothing changed, nothing held: silence
    ],
)
def test_a_message_goes_out_when_what_the_engines_act_on_changed(before, after, sent):
    docs = {"m": before}
    pub, clock = _publisher(docs)
    client = _Client()
    assert _round(pub, client) == 1  # the first numbers always go out
    docs["m"], clock.now = after, 0.2  # one interval later, well before the refresh
    assert _round(pub, client) == int(sent)
    assert len(client.posts) == 1 + int(sent)


def test_while_work_is_held_the_exact_numbers_refresh_then_one_zero_message_ends_it():
    docs = {"m": _doc(inflight=3, rate=4.0)}
    pub, clock = _publisher(docs, engines=("http://e1", "http://e2"))
    client = _Client()
    assert _round(pub, client) == 2  # to both engines
    docs["m"], clock.now = _doc(inflight=7, rate=4.0), 0.5
    assert _round(pub, client) == 0
    clock.now = 1.0  # refresh_s after the last message: the exact count goes out
    assert _round(pub, client) == 2 and client.posts[-1][1]["inflight"] == 7
    docs["m"], clock.now = _doc(), 1.2
    assert _round(pub, client) == 2 and client.posts[-1][1]["inflight"] == 0  # work ended
    clock.now = 5.0
    assert _round(pub, client) == 0  # idle and the last message was zero: nothing more
    assert pub.status()["m"]["sent"] == 6
