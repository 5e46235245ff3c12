"""A layer stream cache's donor dies while a decode step copies a streamed layer's KV into staging:
no token of that step reaches a client (docs/peer-kv.md, "Layer stream cache (W2)", donor death).

Who runs where: the donor is a ``PeerDonor`` in this process, found by the pool's discovery; the
borrower is ``peer.layer_stream`` through the attention hook (as the server runs it). The seam is
``PeerLink.copier``: ``DyingDonorCopier`` copies half the rows of one plane, closes the donor and
overwrites the bytes under the copy (what a third server granted the dead donor's chunks would do),
then copies the rest. The hook catches ``LayerStreamLost`` and the forward runs on those rows.

The scheduler is ``StepScheduler``: upstream's processing of a decode step's results, reduced to what
decides what a client gets (real upstream ``Req`` objects: the step's token is appended, the finish
state updated, ``to_finish`` wins; then the output stream, which skips a finished request whose final
output is out), wrapped by every memx hook on ``Scheduler.process_batch_result``, composed as upstream
applies around-hooks. Without such a hook (the code before this test) the step's token, computed from
the foreign rows, is streamed to the client: the test fails there.
"""

from __future__ import annotations

import functools
import threading
import time
import types

import pytest
import torch

from memory_ext.peer import HostCopier, PeerDonor, PeerKVLayout, donor_socket
from memory_ext.pool import ChunkPool
from memory_ext.vmm import host_backend
from sglang_memx.config import MemxConfig
from sglang_memx.hooks import all_hook_specs
from sglang_memx.hooks import layer_stream as hooks
from sglang_memx.peer import layer_stream
from sglang_memx.upstream.manifest import resolve

G = 1 << 16
LAYERS, HEADS, DIM, LOCAL = 4, 2, 8, 256
PROMPT = 40  # tokens of each request's prompt
FOREIGN = -999.0  # what the third server writes into the dead donor's chunks
RIGHT, WRONG = 11, 666  # the token a step samples from its own KV / from anything else
TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"


class DyingDonorCopier(HostCopier):
    """``HostCopier``; once armed, its ``at``-th ``copy_rows`` (0 = the first after ``arm``) copies half
    the rows, calls ``fault(src)``, then copies the rest."""

    def __init__(self):
        self.fault, self.calls, self.at = None, 0, 0

    def arm(self, at: int, fault) -> None:
        self.fault, self.calls, self.at = fault, 0, at

    def copy_rows(self, dst, src, rows):
        if self.fault is not None:
            self.calls += 1
            if self.calls - 1 == self.at:
                fault, self.fault = self.fault, None
                half = len(rows) // 2
                super().copy_rows(dst, src, rows[:half])
                fault(src)
                super().copy_rows(dst, src, rows[half:])
                return
        super().copy_rows(dst, src, rows)


class StepScheduler:
    """Upstream's decode result processing and output stream, reduced (see the module docstring);
    ``client`` is what the tokenizer side receives per request."""

    def __init__(self):
        self.client: dict[str, list] = {}
        self.freed: list[str] = []

    def send_abort_output(self, abort, req):  # upstream: straight to the tokenizer, no token of the step
        self.client.setdefault(abort.rid, []).append(("abort", abort.finished_reason))

    def process_batch_result(self, batch, result):
        for req in batch.reqs:
            if req.finished() or req.is_retracted:
                continue
            req.output_ids.append(result[req.rid])
            req.update_finish_state()
            if req.finished():
                self.freed.append(req.rid)  # upstream: release_kv_cache
        for req in batch.reqs:  # upstream: OutputStreamer._stream_output_generation
            if req.finished() and req.finished_output:
                continue
            if not (req.finished() or req.stream):  # a non-streaming client gets its answer at the end
                continue
            if req.finished():
                req.finished_output = True
            sent = req.__dict__.setdefault("_sent", 0)
            reason = req.finished_reason.to_json() if req.finished_reason else None
            self.client.setdefault(req.rid, []).append(("tokens", list(req.output_ids[sent:]), reason))
            req._sent = len(req.output_ids)


def hooked_process_batch_result(scheduler: StepScheduler):
    """``scheduler.process_batch_result`` wrapped by every memx around-hook on upstream's."""
    call = StepScheduler.process_batch_result
    for spec in all_hook_specs():
        if spec.target == TARGET:
            assert spec.kind == "around"
            call = functools.partial(spec.fn, call)
    return lambda batch, result: call(scheduler, batch, result)


@pytest.fixture
def donor(tmp_path):
    vmm = host_backend(G)
    pool = ChunkPool(vmm, capacity_chunks=128)
    layout = PeerKVLayout(num_layers=LAYERS, block_tokens=16, num_kv_heads=HEADS, head_dim=DIM, dtype="float32",
                          model="tiny")  # fmt: skip
    d = PeerDonor(pool, donor_socket(tmp_path, "p", "d1"), max_bytes_per_lease=64 * G, name="d1",
                  accept_layout=layout.check_same)  # fmt: skip
    stop = threading.Event()

    def grow():  # the donor's tick: give the new lease 40 chunks
        while not stop.is_set():
            for lid in d.leases():
                if d.region(lid).units == 0:
                    d.grow(lid, 40)
            time.sleep(0.01)

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    config = MemxConfig(elastic_kv=True, pool="p", pool_dir=str(tmp_path), peer_kv="borrow", peer_layer_stream=True)
    yield d, config, lambda: (stop.set(), grower.join())
    stop.set()
    grower.join()
    setup = layer_stream.active()
    if setup is not None:
        setup.link.close()
        layer_stream._active = None
    d.close()
    vmm.close()


def _req(rid: str, stream: bool):
    params = resolve("sglang.srt.sampling.sampling_params.SamplingParams")(max_new_tokens=8)
    params.normalize(None)  # upstream's tokenizer does this (no stop strings here)
    req = resolve("sglang.srt.managers.schedule_batch.Req")(rid, "", list(range(1, PROMPT + 1)), params)
    req.stream = stream
    return req


def test_a_step_whose_streamed_kv_was_lost_sends_no_token(donor, monkeypatch):
    monkeypatch.setattr(layer_stream, "SETTLE_S", 0.3)
    d, config, stop_growing = donor
    setup = layer_stream.plan(config, stock_tokens=LOCAL, layers=LAYERS, kv_heads=HEADS, head_dim=DIM,
                              dtype=torch.float32, page_size=1, model="tiny", name="b", chunk_bytes=G)  # fmt: skip
    stop_growing()
    assert setup.plan.resident_layers == 0 and setup.plan.streamed_layers == LAYERS
    rows = setup.plan.capacity_tokens + 1
    staging = [torch.zeros(rows, HEADS, DIM) for _ in range(2)]
    layer_stream.attach(setup, LAYERS, *staging)
    copier = DyingDonorCopier()
    setup.link.copier = copier
    req_to_token = torch.zeros(2, rows, dtype=torch.int32)
    req_to_token[0, : PROMPT + 1] = torch.arange(1, PROMPT + 2, dtype=torch.int32)
    req_to_token[1, : PROMPT + 1] = torch.arange(100, PROMPT + 101, dtype=torch.int32)
    setup.req_to_token = req_to_token
    ref = {layer: torch.zeros(rows, HEADS, DIM) for layer in range(LAYERS)}  # every layer's true K
    g = torch.Generator().manual_seed(0)
    exact: dict[int, bool] = {}

    def attention(attn_layer, q, k, v, forward_batch):  # upstream: write the new rows, read every row
        layer = attn_layer.layer_id
        loc = forward_batch.out_cache_loc.long()
        new = torch.randn(len(loc), HEADS, DIM, generator=g)
        staging[0][loc], staging[1][loc], ref[layer][loc] = new, -new, new
        used = torch.cat([req_to_token[i, : int(n)] for i, n in enumerate(forward_batch.seq_lens)]).long()
        exact[layer] = torch.equal(staging[0][used], ref[layer][used]) and torch.equal(staging[1][used],
                                                                                         -ref[layer][used])  # fmt: skip
        return layer

    def forward(seq_lens, out_loc) -> int:
        """One forward through the attention hook; the token it samples (RIGHT only from its own KV)."""
        exact.clear()
        batch = types.SimpleNamespace(req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(seq_lens),
                                      out_cache_loc=out_loc)  # fmt: skip
        for layer in range(LAYERS):
            hooks.around_attention(attention, types.SimpleNamespace(layer_id=layer), None, None, None, batch)
        return RIGHT if all(exact.values()) else WRONG

    scheduler = StepScheduler()
    process = hooked_process_batch_result(scheduler)
    reqs = [_req("a", stream=True), _req("b", stream=False)]
    batch = types.SimpleNamespace(reqs=reqs)
    # prefill: both prompts, every layer's rows stored at the donor; the first token is sent
    token = forward([PROMPT, PROMPT], torch.cat([req_to_token[0, :PROMPT], req_to_token[1, :PROMPT]]))
    assert token == RIGHT
    process(batch, {"a": token, "b": token})
    assert scheduler.client["a"] == [("tokens", [RIGHT], None)]

    def die(src):  # the donor dies mid-copy; its chunks, re-granted, get another server's bytes
        d.close()
        src.fill_(FOREIGN)

    copier.arm(4, die)  # layer 0: load K, V, store K, V; layer 1: load K -> the 5th copy
    token = forward([PROMPT + 1, PROMPT + 1], req_to_token[:, PROMPT].clone())
    assert (staging[0] == FOREIGN).any(), "the scenario must put the third server's bytes into staging"
    assert exact[0] and not exact[1] and token == WRONG  # the step really computed from lost KV
    assert layer_stream.broken(setup) is not None
    process(batch, {"a": token, "b": token})

    sent = [t for rid in ("a", "b") for kind, *rest in scheduler.client.get(rid, []) if kind == "tokens"
            for t in rest[0]]  # fmt: skip
    assert WRONG not in sent, f"a token computed from lost KV reached a client: {scheduler.client}"
    for rid in ("a", "b"):
        abort = scheduler.client[rid][-1]
        assert abort[0] == "abort" and abort[1]["status_code"] == 503
        assert abort[1]["message"].startswith(layer_stream.LOST)
    assert sorted(scheduler.freed) == ["a", "b"]  # finished at this step: upstream frees their KV
    assert all(r.finished() and r.finished_reason.to_json()["type"] == "abort" for r in reqs)
    st = setup.status()
    assert st["steps_withheld"] == 1 and st["requests_withheld"] == 2 and st["copies_skipped"] > 0
    # the next step (the tick's abort let one more forward run): still nothing sent, no second abort
    before = {rid: list(v) for rid, v in scheduler.client.items()}
    process(batch, {"a": WRONG, "b": WRONG})
    assert scheduler.client == before and setup.status()["requests_withheld"] == 2
