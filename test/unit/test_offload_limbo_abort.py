"""An abort that arrives while an offloaded prefill is in limbo (out of its prefill batch, not yet
back in the queue) is remembered by the abort hook and replayed once the request is requeued."""

import types

from sglang_memx.config import MemxConfig
from sglang_memx.coordinator import device
from sglang_memx.coordinator.components import HostBufferPart
from sglang_memx.elastic import host_buffer
from sglang_memx.elastic.host_buffer import build_host_buffer, park_offloaded_prefills
from sglang_memx.hooks.scheduler import after_abort_request
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched
from support.fakes import FakeReq, FakeScheduler


class _Scheduler(FakeScheduler):
    def __init__(self, host):
        allocator = types.SimpleNamespace()
        kv = types.SimpleNamespace(host=host)
        device.tie(allocator, device.Coordinator(kv, (HostBufferPart(kv, host),)))
        super().__init__(allocator=allocator)
        self.running_batch = self.last_batch = None
        self.aborts = []

    def _add_request_to_queue(self, req, is_retracted=False):
        self.waiting_queue.append(req)

    def abort_request(self, recv_req):  # upstream's: pops matching requests from the queue
        self.aborts.append(recv_req)
        self.waiting_queue = [r for r in self.waiting_queue if not r.rid.startswith(recv_req.rid)]


def _offloaded(rid, outputs):
    req = FakeReq(rid=rid, outputs=outputs)
    up_req.memx_state(req).offload_bytes = 64
    return req


def test_an_abort_during_limbo_is_replayed_after_the_request_is_requeued(monkeypatch):
    host = build_host_buffer(MemxConfig(elastic_kv=True, host_buffer_gb=0.001), 4096)
    kv = types.SimpleNamespace(host=host)
    sched = _Scheduler(host)
    monkeypatch.setattr(up_sched, "release_req_kv", lambda scheduler, req: None)
    monkeypatch.setattr(up_sched, "req_to_token_rows", lambda scheduler: None)
    monkeypatch.setattr(host_buffer, "park_kv", lambda *a: True)
    waiting, aborted = _offloaded("keep", 1), _offloaded("gone", 0)  # "gone": its first token is not processed yet
    host.limbo += [waiting, aborted]
    host.pending_bytes = 128
    abort = types.SimpleNamespace(rid="gone", abort_all=False)
    assert after_abort_request(None, sched, abort) is None
    assert park_offloaded_prefills(kv.host, sched) == 1  # "keep" parked; "gone" still waits for its token
    assert sched.waiting_queue == [waiting] and sched.aborts == [] and host.limbo == [aborted]
    aborted.output_ids.append(7)
    park_offloaded_prefills(kv.host, sched)
    assert sched.aborts == [abort]  # replayed: upstream removed it from the queue
    assert sched.waiting_queue == [waiting] and host.limbo == [] and host.pending_bytes == 0
