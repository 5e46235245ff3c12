"""Two real processes on a gloo group, as upstream's tensor parallel CPU group is, for unit tests of
the ranks' agreements (``coordinator.rank_agreement``, ``coordinator.rank_pools``).

``run_two_ranks(target, per_rank)`` spawns ``target(rank, init_file, *per_rank[rank], out)`` for ranks 0
and 1 (``target`` a module-level function: spawn imports it by name); each puts ``(rank, *rest)`` on
``out`` once, and the result is ``{rank: rest}``. Both processes must exit cleanly. Inside ``target``,
``gloo_group(rank, init_file)`` joins the two-rank group."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable

TIMEOUT_S = 60


def gloo_group(rank: int, init_file: str):
    """Join the two ranks' default process group and return a gloo group of both."""
    import torch.distributed as d

    d.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                         timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip
    return d.new_group([0, 1], backend="gloo")


def run_two_ranks(target: Callable, per_rank: dict[int, tuple]) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=target, args=(r, init_file, *per_rank[r], out)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            rank, *rest = out.get(timeout=TIMEOUT_S)
            got[rank] = tuple(rest)
        for p in procs:
            p.join(TIMEOUT_S)
            assert p.exitcode == 0
    return got
