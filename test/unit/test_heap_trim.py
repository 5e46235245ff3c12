"""An idle engine returns its allocator's kept heap (the rule ``memory_ext.policy.idle_trim``, the
mechanism ``sglang_memx.heap_trim``): when it trims, that it never trims while busy, the interval
between trims, bad settings refused, and that glibc's trim really gives memory back in a process
that freed a burst's worth of blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memory_ext.policy.idle_trim import IdleTrimError, IdleTrimRule
from sglang_memx import heap_trim
from sglang_memx.heap_trim import IdleHeapTrim

# (busy per iteration, seconds between iterations, iterations that trim)
CASES = [
    ("idle from the start: nothing to give back", [False, False, False], 1.0, []),
    ("busy throughout: never while requests run", [True, True, True, True], 1.0, []),
    ("the first idle iteration after work", [True, True, False, False, False], 1.0, [2]),
    ("every idle period, far enough apart", [True, False, True, False, True, False], 3.0, [1, 3, 5]),
    ("idle periods closer than the interval wait", [True, False, True, False, True, False], 0.6, [1, 5]),
    ("a skipped idle period is not made up later in the same idle run", [True, False, True, False, False], 0.5, [1]),
]


@pytest.mark.parametrize("why, busy, dt, want", CASES, ids=[c[0] for c in CASES])
def test_trims_at_the_first_idle_iteration_after_work(why, busy, dt, want):
    calls = []
    trimmer = IdleHeapTrim(trim=lambda: calls.append(1), rule=IdleTrimRule(min_interval_s=2.0))
    did = [i for i, b in enumerate(busy) if trimmer.step(b, i * dt)]
    assert did == want, why
    assert trimmer.trims == len(calls) == len(want)
    assert trimmer.status()["trims"] == len(want)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "2"])
def test_a_bad_interval_is_refused_naming_the_field(bad):
    with pytest.raises(IdleTrimError, match="min_interval_s"):
        IdleTrimRule(min_interval_s=bad)


def test_the_rule_decides_without_trimming_and_the_mechanism_follows_it():
    rule = IdleTrimRule(min_interval_s=0.0)
    assert [rule.should_trim(b, float(i)) for i, b in enumerate([True, False, False, True, False])] == [
        False, True, False, False, True]  # fmt: skip
    calls = []
    told = IdleTrimRule()
    told.should_trim = lambda busy, now: busy  # a rule that (wrongly) says "trim while busy"
    trimmer = IdleHeapTrim(trim=lambda: calls.append(1), rule=told)
    assert trimmer.step(True, 0.0) and not trimmer.step(False, 1.0)
    assert calls == [1]


def test_without_malloc_trim_the_engine_logs_once_and_stops_trying(monkeypatch, caplog):
    monkeypatch.setattr(heap_trim, "_trimmer", None)
    monkeypatch.setattr(heap_trim, "_unavailable", False)
    looked = []
    monkeypatch.setattr(heap_trim, "glibc_trim", lambda: looked.append(1))  # returns None: no trim
    with caplog.at_level("INFO", logger="sglang_memx"):
        for busy in (True, False, True, False):
            heap_trim.tick(busy)
    assert looked == [1]
    assert heap_trim.status() is None
    assert sum("malloc_trim" in r.getMessage() for r in caplog.records) == 1


PROBE = r"""
import ctypes, sys
from sglang_memx.heap_trim import glibc_trim
def rss():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) // 1024
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: the blocks come from the heap, as after a burst
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() never trims by itself, only malloc_trim does
base = rss()
blocks = [libc.malloc(1 << 16) for _ in range(1600)]  # 100 MiB of 64 KiB blocks
guard = libc.malloc(64)  # above the burst: the heap's top is not free, as in a process still working
for b in blocks:
    ctypes.memset(b, 1, 1 << 16)
for b in blocks:
    libc.free(b)
kept = rss() - base
glibc_trim()()
print(kept, rss() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc are Linux's")
def test_glibc_trim_returns_a_freed_burst_to_the_system():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    kept, after = (int(x) for x in out.stdout.split())
    assert kept >= 90, f"the freed blocks should still be resident before the trim: {kept} MiB"
    assert after <= 10, f"the trim should have returned them: {after} MiB still resident"
