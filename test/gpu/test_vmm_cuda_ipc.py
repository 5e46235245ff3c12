"""CUDA chunks cross a Unix socket as POSIX fds (cuMemExportToShareableHandle /
cuMemImportFromShareableHandle) and stay shared between processes."""

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from memory_ext.vmm import listen_unix, send_chunks

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, torch
    from memory_ext.vmm import connect_unix, cuda_backend, recv_chunks
    path = sys.argv[1]
    vmm = cuda_backend(0)
    g = vmm.granularity
    sock = connect_unix(path)
    [chunk], meta = recv_chunks(sock, vmm, with_meta=True)
    assert meta == {"granularity": g}, (meta, g)
    r = vmm.reserve(2 * g)
    vmm.map(r, g, chunk)                                   # a different slot than the parent's
    view = vmm.tensor_view(r, g, g)
    assert int(view[0]) == 0xAB, int(view[0])              # the parent's marker
    view.copy_(torch.arange(g, dtype=torch.int64).remainder(251).to(torch.uint8).cuda())
    torch.cuda.synchronize()
    sock.sendall(b"done")
    assert sock.recv(16) == b"bye"
    vmm.close()
""")


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="vmmcu-", dir="/tmp")  # AF_UNIX paths are short
    yield Path(d)
    for p in Path(d).iterdir():
        p.unlink()
    os.rmdir(d)


def test_child_process_writes_into_a_cuda_chunk_we_read(short_dir):
    from memory_ext.vmm import cuda_backend

    vmm = cuda_backend(0)
    G = vmm.granularity
    path = short_dir / "vmm.sock"
    server = listen_unix(path)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        server.settimeout(120)
        conn, _ = server.accept()
        conn.settimeout(120)
        r = vmm.reserve(G)
        chunk = vmm.create_chunk()
        vmm.map(r, 0, chunk)
        mine = vmm.tensor_view(r, 0, G)
        mine.zero_()
        mine[0] = 0xAB
        torch.cuda.synchronize()
        send_chunks(conn, [chunk], meta={"granularity": G})
        assert conn.recv(16) == b"done"
        want = torch.arange(G, dtype=torch.int64).remainder(251).to(torch.uint8)
        assert torch.equal(mine.cpu(), want)
        conn.sendall(b"bye")
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0, out.decode()
        conn.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        server.close()
        vmm.close()
