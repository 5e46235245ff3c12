"""The router's activity publisher: what it holds for each model, pushed to the model's engines.

Every ``interval_s`` the publisher reads each model's numbers from the admission gate
(``AdmissionGate.activity``: queued, in flight, arrival rate, the queued requests' estimated
KV tokens, seconds since the last arrival) and ``POST``s them to ``<engine>/memx/activity``
of each of the model's engines (with the router's API key) when they changed in a way the
engines act on (``_changed``), and at least every ``refresh_s`` while they are non-zero
(anything queued or in flight, or an arrival rate of at least ``MIN_RATE``), with ``ttl_s``
so that an engine forgets them when the router stops (dies) sending. The engines turn them into their memory decisions
(``sglang_memx.router_activity``, ``memory_ext.policy.router_activity``).

Token estimate: a request's body size in bytes / ``BYTES_PER_TOKEN`` (4: about one token per
4 bytes of English text; the JSON around the prompt makes it an over-estimate, and the
output tokens are not counted).

Invariants: publishing never delays a request (its own task; each POST bounded by
``timeout_s``); a failed POST is only counted (the next change or refresh sends again);
engines that are dead get nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

__all__ = ["ActivityPublisher", "estimate_tokens", "BYTES_PER_TOKEN", "ACTIVITY_PATH"]

logger = logging.getLogger("sglang_memx.serve")

ACTIVITY_PATH = "/memx/activity"
BYTES_PER_TOKEN = 4
MIN_RATE = 0.01  # requests/s below which an idle model's rate counts as zero (no refresh needed)


def estimate_tokens(body: bytes) -> int:
    """A request's prompt in KV tokens, estimated from its body size."""
    return -(-len(body) // BYTES_PER_TOKEN)


def _changed(a: dict | None, b: dict) -> bool:
    """A change the engines act on: the queue (its length, its tokens) or in-flight work starting or
    ending. The in-flight count itself changes with every arrival and completion under load, and
    the engines use it only as "any in flight" (``memory_ext.policy.router_activity``): the exact
    number goes out with the next refresh (``refresh_s``) and is not worth a message per 0.2 s."""
    if a is None:
        return True
    return any(a[k] != b[k] for k in ("queued", "queued_tokens")) or (a["inflight"] > 0) != (b["inflight"] > 0)


def _nonzero(doc: dict) -> bool:
    return doc["queued"] > 0 or doc["inflight"] > 0 or doc["arrival_rate"] >= MIN_RATE


class ActivityPublisher:
    """See the module docstring. ``snapshot(model)``: the gate's numbers; ``engines(model)``: the
    base URLs to post to (empty: skip, e.g. the engine is dead)."""

    def __init__(self, models, snapshot: Callable[[str], dict], engines: Callable[[str], list[str]],
                 api_key: str | None = None, interval_s: float = 0.2, refresh_s: float = 1.0, ttl_s: float = 5.0,
                 timeout_s: float = 2.0, clock=time.monotonic):  # fmt: skip
        if not ttl_s > refresh_s > 0 or not interval_s > 0:
            raise ValueError(f"need ttl_s > refresh_s > 0 and interval_s > 0, got {ttl_s}, {refresh_s}, {interval_s}")
        self.models = list(models)
        self.snapshot = snapshot
        self.engines = engines
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval_s, self.refresh_s, self.ttl_s, self.timeout_s = interval_s, refresh_s, ttl_s, timeout_s
        self.clock = clock
        self._last: dict[str, dict] = {}  # model -> the numbers last sent
        self._sent_at: dict[str, float] = {}
        self.counters = {m: {"sent": 0, "failed": 0} for m in self.models}
        self._warned: set[tuple[str, int]] = set()

    def due(self, model: str, doc: dict, now: float) -> bool:
        """Whether ``doc`` must go out now: it changed, or it (or the last one sent) is non-zero
        and ``refresh_s`` passed (one last zero message follows the activity)."""
        last = self._last.get(model)
        if _changed(last, doc):
            return True
        stale = now - self._sent_at.get(model, float("-inf")) >= self.refresh_s
        return stale and (_nonzero(doc) or _nonzero(last))

    def message(self, model: str, doc: dict) -> dict:
        return {"model": model, "queued": doc["queued"], "inflight": doc["inflight"],
                "arrival_rate": round(doc["arrival_rate"], 6), "queued_tokens": doc["queued_tokens"],
                "since_arrival_s": None if doc["since_arrival_s"] is None else round(doc["since_arrival_s"], 3),
                "ttl_s": self.ttl_s}  # fmt: skip

    async def _post(self, client: httpx.AsyncClient, model: str, url: str, body: dict) -> bool:
        try:
            r = await client.post(url + ACTIVITY_PATH, json=body, headers=self.headers, timeout=self.timeout_s)
            ok = r.status_code < 300
            if not ok and (url, r.status_code) not in self._warned:  # once per engine and status
                self._warned.add((url, r.status_code))
                logger.warning("router activity for %s refused by %s: %d %s", model, url, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            logger.debug("router activity for %s not delivered to %s: %s", model, url, exc)
            ok = False
        self.counters[model]["sent" if ok else "failed"] += 1
        return ok

    async def publish_once(self, client: httpx.AsyncClient) -> int:
        """One round over every model; returns the messages delivered."""
        now = self.clock()
        posts = []
        for model in self.models:
            doc = self.snapshot(model)
            if not self.due(model, doc, now):
                continue
            urls = self.engines(model)
            if not urls:
                continue
            self._last[model], self._sent_at[model] = doc, now
            body = self.message(model, doc)
            posts += [self._post(client, model, url, body) for url in urls]
        return sum(await asyncio.gather(*posts)) if posts else 0

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                await self.publish_once(client)
            except Exception:  # never let the publisher die with the router up
                logger.exception("router activity publisher")
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict:
        return {m: dict(self.counters[m], last=self._last.get(m)) for m in self.models}
