"""``elastic.admission.add_one`` acts on the one verdict it asks for: on the device, offloaded to the
host buffer, or deferred, including the three situations the policy once had to be asked again for
(a parked request ahead; upstream refusing a device admission; a deferral only for the buffer's
room). Upstream's ``add_one_req`` is a stand-in that records in which mode it was asked."""

from __future__ import annotations

import types

import pytest

from sglang_memx.coordinator.components import NoActivation
from sglang_memx.elastic import admission
from sglang_memx.elastic.host_buffer import is_offloaded
from sglang_memx.upstream import scheduler as up_sched
from support.fakes import FakeBatch, FakeReq, fake_admission_pool

ROW_BYTES = 1024  # one token's KV over all layers (the fake pool's buffers below)


class Upstream:
    """Upstream's ``add_one_req`` stand-in: it reserves the request in the budget and admits it,
    unless ``refuse_on_device`` (its own request / token caps) and the budget is not in memx's
    physical mode (an offload)."""

    def __init__(self, refuse_on_device: bool):
        self.refuse_on_device = refuse_on_device
        self.modes: list[str] = []

    def __call__(self, adder, req, has_chunked_req, truncation_align_size):
        physical = adder.memory_budget.physical is not None
        self.modes.append("physical" if physical else "device")
        if self.refuse_on_device and not physical:
            return up_sched.add_result("OTHER")
        adder.memory_budget.reserve(len(req.origin_input_ids), req.sampling_params.max_new_tokens)
        adder.can_run_list.append(req)
        return up_sched.add_result("CONTINUE")


def _admission_pass(available: int, buffer_tokens: int, behind_parked: bool):
    allocator, tree, host = fake_admission_pool(available, buffer_tokens, ROW_BYTES)
    kv = types.SimpleNamespace(activation=None, host=host)
    adder = types.SimpleNamespace(token_to_kv_pool_allocator=allocator, tree_cache=tree,
                                  memory_budget=up_sched.new_physical_budget(allocator, tree, 0),
                                  can_run_list=[], running_batch=FakeBatch([]), page_size=1,
                                  rem_chunk_tokens=None, rem_input_tokens=1 << 20, new_chunked_req=None)  # fmt: skip
    up_sched.adder_state(adder).behind_parked = behind_parked
    return adder, kv


# (name, available tokens, buffer tokens, parked ahead, upstream refuses on the device, request fields,
#  expected: upstream's modes asked, admitted, offloaded, offload_no_room, result)
CASES = [
    ("fits the device", 1000, 0, False, False, {}, (["device"], True, False, 0, "CONTINUE")),
    ("fits the device, a buffer too", 1000, 1000, False, False, {}, (["device"], True, False, 0, "CONTINUE")),
    ("refused by upstream: the buffer takes it", 1000, 1000, False, True, {},
     (["device", "physical"], True, True, 0, "CONTINUE")),
    ("refused by upstream: the buffer is too small", 1000, 50, False, True, {}, (["device"], False, False, 0, "OTHER")),
    ("refused by upstream, no buffer", 1000, 0, False, True, {}, (["device"], False, False, 0, "OTHER")),
    ("parked ahead: the buffer takes it", 1000, 1000, True, False, {}, (["physical"], True, True, 0, "CONTINUE")),
    ("parked ahead: the buffer is too small", 1000, 50, True, False, {}, ([], False, False, 1, "NO_TOKEN")),
    ("parked ahead, not plain text: the device", 1000, 1000, True, False, {"return_logprob": True},
     (["device"], True, False, 0, "CONTINUE")),
    ("beyond the device: offloaded", 130, 1000, False, False, {}, (["physical"], True, True, 0, "CONTINUE")),
    ("beyond the device: the buffer is full", 130, 50, False, False, {}, ([], False, False, 1, "NO_TOKEN")),
    ("beyond the device and the physical room", 100, 1000, False, False, {}, ([], False, False, 0, "NO_TOKEN")),
]  # fmt: skip


@pytest.mark.parametrize("name,available,buffer_tokens,parked,refuse,fields,expected", CASES, ids=[c[0] for c in CASES])
def test_add_one_acts_on_the_verdict(name, available, buffer_tokens, parked, refuse, fields, expected):
    modes, admitted, offloaded, no_room, result = expected
    adder, kv = _admission_pass(available, buffer_tokens, parked)
    upstream = Upstream(refuse)
    req = FakeReq(prompt=100, max_new=50, **fields)  # device KV 151 tokens, 101 while offloaded, parks 100
    got = admission.add_one(upstream, adder, req, False, 0, NoActivation(), kv.host, None)
    assert upstream.modes == modes
    assert up_sched.adder_admitted(adder, req) is admitted
    assert is_offloaded(req) is offloaded
    assert (kv.host.offload["offload_no_room"] if kv.host is not None else 0) == no_room
    assert got == up_sched.add_result(result)
    assert up_sched.adder_state(adder).batch_tokens == (100 if admitted else 0)
