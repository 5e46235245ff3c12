"""Peer KV tier on CUDA: the donor's chunks are VMM allocations exported as POSIX fds (the VMM
API's IPC handle), the borrower imports them on the donor's device and copies its KV in and out
device to device (P2P when a second GPU holds the borrower's KV). Same protocol and validation as
on the host; skipped without a GPU (conftest: "needs a CUDA GPU")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from memory_ext.peer import CudaPeerCopier, PeerKVLayout, PeerKVTier

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
LAYOUT = PeerKVLayout(num_layers=4, block_tokens=16, num_kv_heads=8, head_dim=128, dtype="float16", model="m")

DONOR = textwrap.dedent("""
    import sys
    from memory_ext.peer import PeerDonor
    from memory_ext.pool import ChunkPool, Owner
    from memory_ext.vmm import cuda_backend
    vmm = cuda_backend(0)
    pool = ChunkPool(vmm, capacity_chunks=64)
    donor = PeerDonor(pool, sys.argv[1], max_bytes_per_lease=32 * vmm.granularity)
    print("ready", flush=True)
    lease = None
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "lease":
            lease = donor.wait_for_lease(60)
            print(lease, flush=True)
        elif cmd == "grow":
            print(len(donor.grow(lease, int(arg))), flush=True)
        elif cmd == "reclaim":
            released = donor.reclaim(lease, int(arg))
            print(len(released), pool.usage()[Owner.PEER_DONATION], flush=True)
""")


def test_cuda_peer_round_trip_reclaim_and_donor_death():
    from memory_ext.vmm import cuda_backend

    kv_device = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    d = tempfile.mkdtemp(prefix="peercu-", dir="/tmp")
    os.chmod(d, 0o700)
    path = os.path.join(d, "donor.sock")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen(
        [sys.executable, "-c", DONOR, path], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def call(line):
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().split()

    try:
        assert child.stdout.readline().strip() == "ready"
        vmm = cuda_backend(0)  # the donor's device: views of its chunks live there
        tier = PeerKVTier(LAYOUT)
        link = tier.connect(path, "borrower", vmm)
        assert isinstance(link.copier, CudaPeerCopier)
        assert call("lease")
        assert call("grow 4") == ["4"]
        deadline = time.monotonic() + 30
        while link.units < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        n = 8
        tokens = list(range(16 * n))
        pages = [torch.randn(LAYOUT.block_shape, device=kv_device).half() for _ in range(n)]
        assert tier.store(tokens, pages) == n
        out = [torch.empty_like(p) for p in pages]
        assert tier.load(tokens, out) == n
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
        refs = tier.index.match(tier.hashes(tokens))
        released, still = call("reclaim 4")
        assert released == "4" and still == "0"
        deadline = time.monotonic() + 30
        while link.num_blocks:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        buf = torch.empty_like(pages[0])
        assert not any(link.read(r, buf) for r in refs)
        assert call("grow 2") == ["2"]
        deadline = time.monotonic() + 30
        while link.units < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert tier.store(tokens, pages) > 0
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        deadline = time.monotonic() + 30
        while not link.closed:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(tier.index) == 0 and vmm.live_chunks() == [] and vmm.ranges() == []
        vmm.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for p in Path(d).iterdir():
            p.unlink()
        os.rmdir(d)
