"""HostKVBuffer: KV rows of requests taken off the device, waiting in host memory (eLLM E3).

An entry is one request's KV: its token ids and, per KV buffer (2 x layers),
the rows of those tokens, copied to host tensors. Invariants:

* ``used_bytes`` is the sum of the entries' row bytes and never exceeds
  ``logical_bytes`` (the size the SLO rule allows now) at the time an entry
  is parked, nor ``capacity_bytes`` ever. Shrinking the logical size evicts
  nothing (eLLM §4.4.2); it only refuses new entries.
* An entry is taken out whole (``take``: its request resumed from it) or
  dropped whole (``drop``); a key is parked at most once. Copying an entry's
  rows back to the device (``record_fetch``) keeps the entry: the device copy
  may still be evicted before its request resumes.

The copies themselves (device -> host and back) are the caller's: rows are
``torch`` tensors on the host (pinned when the device is CUDA).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ParkedKV:
    tokens: list[int]
    rows: list[torch.Tensor]  # one [n, ...] host tensor per KV buffer

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rows)

    def __len__(self) -> int:
        return len(self.tokens)


class HostKVBuffer:
    def __init__(self, capacity_bytes: int, logical_bytes: int | None = None):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._logical = capacity_bytes
        self._entries: dict[str, ParkedKV] = {}
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.stats = {
            "parked": 0,
            "restored": 0,
            "dropped": 0,
            "refused": 0,
            "parked_tokens": 0,
            "restored_tokens": 0,
            "fetched": 0,
            "fetched_tokens": 0,
            "peak_used_bytes": 0,
        }
        if logical_bytes is not None:
            self.set_logical_bytes(logical_bytes)

    @property
    def logical_bytes(self) -> int:
        return self._logical

    def set_logical_bytes(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"logical_bytes must be an int >= 0, got {n!r}")
        self._logical = min(n, self.capacity_bytes)

    def room(self) -> int:
        return max(0, self._logical - self.used_bytes)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def park(self, key: str, tokens: Sequence[int], rows: Sequence[torch.Tensor]) -> bool:
        """Keep ``rows`` (already on the host) for ``key``; False (nothing kept) if there is no room."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        entry = ParkedKV(list(tokens), list(rows))
        if any(r.shape[0] != len(entry) for r in entry.rows):
            raise ValueError(f"every row tensor must have {len(entry)} rows (one per token)")
        with self._lock:
            if key in self._entries:
                raise ValueError(f"{key!r} is already parked")
            if entry.nbytes > self.room():
                self.stats["refused"] += 1
                return False
            self._entries[key] = entry
            self.used_bytes += entry.nbytes
            self.stats["parked"] += 1
            self.stats["parked_tokens"] += len(entry)
            self.stats["peak_used_bytes"] = max(self.stats["peak_used_bytes"], self.used_bytes)
            return True

    def peek(self, key: str) -> ParkedKV | None:
        return self._entries.get(key)

    def record_fetch(self, key: str) -> None:
        """Count one copy of ``key``'s rows back to the device (the entry stays)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(f"{key!r} is not parked")
            self.stats["fetched"] += 1
            self.stats["fetched_tokens"] += len(entry)

    def take(self, key: str) -> ParkedKV | None:
        """Remove and return ``key``'s entry (its request resumed from it), or None."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.nbytes
                self.stats["restored"] += 1
                self.stats["restored_tokens"] += len(entry)
            return entry

    def drop(self, key: str) -> bool:
        """Forget ``key``'s entry (its request finished, was aborted, or will recompute)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.used_bytes -= entry.nbytes
            self.stats["dropped"] += 1
            return True

    def keys(self) -> list[str]:
        return list(self._entries)

    def status(self) -> dict:
        return {
            "capacity_bytes": self.capacity_bytes,
            "logical_bytes": self._logical,
            "used_bytes": self.used_bytes,
            "requests": len(self._entries),
            **self.stats,
        }
