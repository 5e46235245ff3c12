"""How a CPU device's cores are split: among the device's engines (``engine_specs``) and an
engine's share among its tensor parallel ranks (``tensor_parallel``)."""

from __future__ import annotations

from collections.abc import Sequence


def split_cores(cores: Sequence[int], n: int) -> list[list[int]]:
    """n near-equal contiguous shares of ``cores`` (shared round-robin when there are fewer cores)."""
    cores = list(cores)
    if len(cores) >= n:
        per, extra = divmod(len(cores), n)
        out, i = [], 0
        for k in range(n):
            take = per + (1 if k < extra else 0)
            out.append(cores[i : i + take])
            i += take
        return out
    return [[cores[k % len(cores)]] for k in range(n)]
