"""The host buffer's logical size follows eLLM Alg. 2 from TTFT / TPOT samples measured in the scheduler."""

import types

from sglang_memx.config import MemxConfig
from sglang_memx.elastic import slo
from sglang_memx.elastic.host_buffer import build_host_buffer
from support.fakes import FakeReq, FakeScheduler

UNIT = 1 << 20  # one KV group = 1 MiB


def _req(outputs=0):
    return FakeReq(outputs=outputs)


def _scheduler(waiting=(), running=(), decode=True):
    return FakeScheduler(waiting=waiting, running=running, decode=decode)


def _state():
    config = MemxConfig(elastic_kv=True, host_buffer_gb=64 * UNIT / (1 << 30), ttft_slo_ms=100, tpot_slo_ms=10)
    return types.SimpleNamespace(host=build_host_buffer(config, UNIT))


def test_without_slos_the_whole_buffer_is_logical():
    config = MemxConfig(elastic_kv=True, host_buffer_gb=64 * UNIT / (1 << 30))
    state = build_host_buffer(config, UNIT)
    assert state.rule is None and state.buffer.logical_bytes == 64 * UNIT


def test_ttft_misses_grow_and_tpot_misses_shrink_the_logical_buffer():
    kv = _state()
    host = kv.host
    assert host.buffer.logical_bytes == UNIT  # Alg. 2 starts at one unit
    t = 0.0
    for _ in range(3):  # three requests wait 0.5 s (> 100 ms) for their first token; decode steps are fast
        r = _req()
        slo.observe(kv.host, _scheduler(waiting=[r]), now=t)
        r.output_ids.append(1)
        t += 0.5
        slo.observe(kv.host, _scheduler(running=[r], decode=False), now=t)
    assert host.rule.events["ttft"] >= 1 and host.buffer.logical_bytes > UNIT
    grown = host.buffer.logical_bytes
    slow = _req(1)
    for _ in range(5):  # a running request gets one token per 50 ms (> 10 ms TPOT SLO)
        t += 0.05
        slow.output_ids.append(1)
        slo.observe(kv.host, _scheduler(running=[slow]), now=t)
    assert host.rule.events["tpot"] >= 1 and host.buffer.logical_bytes < grown
    st = host.status()["slo_scaling"]
    assert st["ttft_slo_s"] == 0.1 and st["tpot_slo_s"] == 0.01 and st["unit_bytes"] == UNIT


def test_sparse_first_tokens_still_count_as_a_violation():
    """SGLang produces first tokens in few iterations (prefills among many fast decode steps); the
    window counts samples, so 3 slow first tokens spread over 30 iterations are a TTFT violation."""
    kv = _state()
    t, fast = 0.0, _req(1)
    for _i in range(3):
        r = _req()
        slo.observe(kv.host, _scheduler(waiting=[r], running=[fast]), now=t)
        for _ in range(10):  # fast decode steps in between: 1 ms per token, no first token
            t += 0.001
            fast.output_ids.append(1)
            slo.observe(kv.host, _scheduler(running=[fast]), now=t)
        r.output_ids.append(1)
        t += 0.5
        slo.observe(kv.host, _scheduler(running=[fast, r], decode=False), now=t)
    assert kv.host.rule.events == {"ttft": 1, "tpot": 0}
    assert kv.host.buffer.logical_bytes == 2 * UNIT  # grown by alpha = 2


def test_an_offloaded_prefill_waiting_for_decode_counts_in_tpot():
    """The wait between a parked request's first and second token is a TPOT sample."""
    kv = _state()
    r = _req(1)
    slo.observe(kv.host, _scheduler(running=[r]), now=0.0)
    r.output_ids.append(1)
    slo.observe(kv.host, _scheduler(running=[r]), now=2.0)
    assert kv.host.rule.scaler.window_misses() == (0, 1)
