"""The arbiter as its own process.

Run as a process::

    python -m memory_ext.pool.arbiter --socket /run/memx/gpu0.sock \\
        --budget-chunks 4096 --granularity-mib 2
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from ...proc import wait_for_exit
from .server import Arbiter

log = logging.getLogger("memory_ext.pool.arbiter")


def _stop_when_gone(pid: int, stop) -> None:
    """Call ``stop`` once process ``pid`` has exited (at once if it is gone already).

    Invariant: an arbiter whose owner died does not outlive it, so a SIGKILLed ``sglang-memx
    serve`` (whose engines die with it, ``PR_SET_PDEATHSIG``) leaves no pool holding memory."""
    wait_for_exit(pid)
    log.warning("arbiter: owner pid %d exited: stopping the pool", pid)
    stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m memory_ext.pool.arbiter",
        description="Per-device chunk arbiter shared by several engine processes.",
    )
    ap.add_argument("--socket", required=True, help="Unix socket path to create (mode 0600)")
    ap.add_argument("--budget-chunks", type=int, required=True)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--granularity-mib", type=int, default=None, help="chunk size in MiB (default 2)")
    size.add_argument("--granularity-kib", type=int, default=None, help="chunk size in KiB")
    ap.add_argument("--pid-file", default=None, help="write this process's pid here (removed on exit)")
    ap.add_argument("--floor-per-client", type=int, default=0)
    ap.add_argument("--reclaim-timeout", type=float, default=2.0)
    ap.add_argument("--backend", choices=("host",), default="host")
    ap.add_argument("--owner-pid", type=int, default=None,
                    help="stop the pool (free every chunk) when this process exits, e.g. the "
                         "`sglang-memx serve` that started the pool's engines")  # fmt: skip
    args = ap.parse_args(argv)
    if args.owner_pid is not None and args.owner_pid <= 0:
        ap.error(f"--owner-pid: must be a positive pid, got {args.owner_pid}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ...vmm import host_backend

    granularity = (args.granularity_kib << 10) if args.granularity_kib else ((args.granularity_mib or 2) << 20)
    backend = host_backend(granularity, name="memx-arbiter")
    arb = Arbiter(
        args.socket,
        backend,
        args.budget_chunks,
        floor_per_client=args.floor_per_client,
        reclaim_timeout=args.reclaim_timeout,
    )

    def _stop(signum, frame):
        arb.request_stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.owner_pid is not None:
        threading.Thread(target=_stop_when_gone, args=(args.owner_pid, lambda: _stop(None, None)), daemon=True,
                         name="memx-arbiter-owner").start()  # fmt: skip
    log.info("arbiter: serving %s, budget %d chunk(s) of %d KiB", args.socket, args.budget_chunks, granularity >> 10)
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    try:
        arb.serve_forever()
    finally:
        backend.close()
        if args.pid_file:
            try:
                os.unlink(args.pid_file)
            except OSError:
                pass
    return 0
