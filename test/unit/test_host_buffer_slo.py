"""The host buffer's logical size follows eLLM Alg. 2 from TTFT / TPOT measured per scheduler iteration."""

import types

from sglang_memx.config import MemxConfig
from sglang_memx.elastic.host_buffer import build_host_buffer, observe_slos

UNIT = 1 << 20  # one KV group = 1 MiB


class _Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode


def _req(outputs=0):
    return types.SimpleNamespace(output_ids=[0] * outputs)


def _scheduler(waiting=(), running=(), decode=True):
    batch = types.SimpleNamespace(reqs=list(running), forward_mode=_Mode(decode))
    return types.SimpleNamespace(waiting_queue=list(waiting), running_batch=batch, last_batch=batch)


def _state():
    config = MemxConfig(elastic_kv=True, host_buffer_gb=64 * UNIT / (1 << 30), ttft_slo_ms=100, tpot_slo_ms=10)
    kv = types.SimpleNamespace(host=build_host_buffer(config, UNIT))
    return kv


def test_without_slos_the_whole_buffer_is_logical():
    config = MemxConfig(elastic_kv=True, host_buffer_gb=64 * UNIT / (1 << 30))
    state = build_host_buffer(config, UNIT)
    assert state.scaler is None and state.buffer.logical_bytes == 64 * UNIT


def test_ttft_misses_grow_and_tpot_misses_shrink_the_logical_buffer():
    kv = _state()
    host = kv.host
    assert host.buffer.logical_bytes == UNIT  # Alg. 2 starts at one unit
    t = 0.0
    for _ in range(3):  # three requests wait 0.5 s (> 100 ms) for their first token; decode steps are fast
        r = _req()
        observe_slos(kv, _scheduler(waiting=[r]), now=t)
        r.output_ids.append(1)
        t += 0.5
        observe_slos(kv, _scheduler(running=[r], decode=False), now=t)
    assert host.events["ttft"] >= 1 and host.buffer.logical_bytes > UNIT
    grown = host.buffer.logical_bytes
    for _ in range(5):  # decode iterations of 50 ms (> 10 ms TPOT SLO)
        t += 0.05
        observe_slos(kv, _scheduler(running=[_req(5)]), now=t)
    assert host.events["tpot"] >= 1 and host.buffer.logical_bytes < grown
    st = host.status()["slo_scaling"]
    assert st["ttft_slo_s"] == 0.1 and st["tpot_slo_s"] == 0.01 and st["unit_bytes"] == UNIT
