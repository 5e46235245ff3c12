"""The coordinator's short-allocation order (``Coordinator.cover_allocation``): an allocation
upstream already decided on borrows what the local pool cannot map (upstream's short allocation
is fatal), and only then."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_memx.coordinator import device
from sglang_memx.elastic import shared_pool


class FakeKV:
    """Free pages grow by what ``grow`` can map: ``local`` pages now, ``after_borrow`` more once borrowed."""

    def __init__(self, free: int, local: int, lent: bool):
        self.free, self.local, self.borrowed = free, local, 0
        self.lent = object() if lent else None
        self.activation = None
        self.grows: list[int] = []

    def grow(self, allocator, pages: int) -> int:
        self.grows.append(pages)
        add = min(max(0, pages - self.free), self.local)
        self.free += add
        self.local -= add
        return add


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def borrow(kv, lent, tokens, may_wait=True, urgent=False):
        seen.append((tokens, may_wait, urgent))
        kv.local += tokens  # the arbiter granted it: the next grow can map it
        return 1

    monkeypatch.setattr(shared_pool, "borrow_tokens", borrow)
    monkeypatch.setattr(shared_pool.up_kv, "free_page_count", lambda allocator: allocator.kv.free)
    monkeypatch.setattr(shared_pool.up_kv, "page_size", lambda allocator: 1)
    return seen


def test_no_borrow_when_the_local_pool_covers_it(calls):
    kv = FakeKV(free=10, local=50, lent=True)
    device.Coordinator(kv, device.components_of(kv, lent=kv.lent)).cover_allocation(SimpleNamespace(kv=kv), 47)
    assert kv.free == 47 and calls == [] and kv.grows == [47]


def test_a_shortfall_is_borrowed_urgently_and_mapped(calls):
    kv = FakeKV(free=10, local=29, lent=True)  # 39 free after the local grow, 47 wanted (the soak's crash)
    device.Coordinator(kv, device.components_of(kv, lent=kv.lent)).cover_allocation(SimpleNamespace(kv=kv), 47)
    assert calls == [(8, True, True)] and kv.grows == [47, 47] and kv.free == 47


def test_without_a_shared_pool_nothing_is_borrowed(calls):
    kv = FakeKV(free=10, local=29, lent=False)
    device.Coordinator(kv, device.components_of(kv, lent=kv.lent)).cover_allocation(SimpleNamespace(kv=kv), 47)
    assert calls == [] and kv.free == 39  # upstream then refuses, as stock would
