"""HostKVBuffer: parked KV entries, logical size, whole-entry take/drop (memory_ext.pool.host_kv_buffer)."""

import pytest
import torch

from memory_ext.pool.host_kv_buffer import HostKVBuffer


def _rows(n, width=8):
    return [torch.arange(n * width, dtype=torch.float32).reshape(n, width) + k for k in range(2)]


def test_park_take_round_trip_keeps_rows_and_accounts_bytes():
    buf = HostKVBuffer(4096)
    rows = _rows(4)  # 2 x 4 x 8 x 4 B = 256 B
    assert buf.park("a", [1, 2, 3, 4], rows)
    assert buf.used_bytes == 256 and "a" in buf and len(buf) == 1
    entry = buf.take("a")
    assert entry.tokens == [1, 2, 3, 4] and all(torch.equal(x, y) for x, y in zip(entry.rows, rows))
    assert buf.used_bytes == 0 and buf.take("a") is None
    assert buf.stats["parked"] == buf.stats["restored"] == 1 and buf.stats["restored_tokens"] == 4


def test_logical_size_limits_new_entries_but_never_evicts():
    buf = HostKVBuffer(4096, logical_bytes=300)
    assert buf.park("a", range(4), _rows(4))  # 256 B
    assert not buf.park("b", range(4), _rows(4))  # 512 > 300: refused, nothing kept
    assert buf.stats["refused"] == 1 and "b" not in buf
    buf.set_logical_bytes(100)  # shrinking keeps "a"
    assert "a" in buf and buf.room() == 0
    buf.set_logical_bytes(1 << 20)  # clamped to the capacity
    assert buf.logical_bytes == 4096
    assert buf.drop("a") and not buf.drop("a") and buf.used_bytes == 0


def test_bad_entries_are_refused_naming_the_problem():
    buf = HostKVBuffer(4096)
    with pytest.raises(ValueError, match="rows"):
        buf.park("a", [1, 2, 3], _rows(4))
    assert buf.park("a", range(4), _rows(4))
    with pytest.raises(ValueError, match="already parked"):
        buf.park("a", range(4), _rows(4))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostKVBuffer(0)


def test_a_fetch_keeps_the_entry_until_its_request_resumes():
    buf = HostKVBuffer(4096)
    buf.park("a", range(4), _rows(4))
    buf.record_fetch("a")
    buf.record_fetch("a")  # the device copy was evicted and fetched again
    assert "a" in buf and buf.used_bytes == 256
    assert buf.stats["fetched"] == 2 and buf.stats["fetched_tokens"] == 8
    assert buf.take("a") is not None and buf.stats["restored"] == 1
    with pytest.raises(KeyError, match="'a' is not parked"):
        buf.record_fetch("a")
