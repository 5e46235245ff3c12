"""memory_ext.vmm.ipc: chunks cross a Unix socket (SCM_RIGHTS) and stay shared."""

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from memory_ext.vmm import ReceivedChunk, host_backend, listen_unix, recv_chunks, send_chunks
from memory_ext.vmm.ipc import KIND, VERSION

PAGE = os.sysconf("SC_PAGE_SIZE")
G = 4 * PAGE
REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, torch
    from memory_ext.vmm import connect_unix, host_backend, recv_chunks, send_chunks
    path, g = sys.argv[1], int(sys.argv[2])
    vmm = host_backend(g)
    sock = connect_unix(path)
    [chunk], meta = recv_chunks(sock, vmm, with_meta=True)
    assert meta == {"hello": "child"}, meta
    r = vmm.reserve(2 * g)
    vmm.map(r, g, chunk)
    view = vmm.tensor_view(r, g, g)
    assert int(view[0]) == 0xAB, int(view[0])          # the parent's marker
    view.copy_(torch.arange(g, dtype=torch.int64).remainder(251).to(torch.uint8))
    mine = vmm.create_chunk()
    vmm.map(r, 0, mine)
    vmm.tensor_view(r, 0, g).fill_(0x5A)
    send_chunks(sock, [mine], meta={"source_of_first": chunk.source_id})
    assert sock.recv(16) == b"bye"
    vmm.close()
""")


@pytest.fixture
def short_dir():
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="vmm-", dir="/tmp")
    yield Path(d)
    for p in Path(d).iterdir():
        p.unlink()
    os.rmdir(d)


def _nfds():
    return len(os.listdir("/proc/self/fd"))


def test_child_process_writes_through_a_received_chunk(short_dir):
    path = short_dir / "vmm.sock"
    vmm = host_backend(G)
    server = listen_unix(path)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(G)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(60)
        r = vmm.reserve(2 * G)
        chunk = vmm.create_chunk()
        vmm.map(r, 0, chunk)
        mine = vmm.tensor_view(r, 0, G)
        mine[0] = 0xAB
        send_chunks(conn, [chunk], meta={"hello": "child"})
        [theirs], meta = recv_chunks(conn, vmm, with_meta=True)
        assert meta == {"source_of_first": chunk.handle_id}
        # the child wrote its pattern before sending: our own mapping sees it
        want = torch.arange(G, dtype=torch.int64).remainder(251).to(torch.uint8)
        assert torch.equal(mine, want)
        # and the chunk the child created is readable here
        vmm.map(r, G, theirs)
        assert int(vmm.tensor_view(r, G, G).min()) == 0x5A == int(vmm.tensor_view(r, G, G).max())
        assert theirs.source_id is not None
        conn.sendall(b"bye")
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0, out.decode()
        conn.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        server.close()
        vmm.close()


def test_listen_unix_makes_a_0600_socket_even_under_umask_0(short_dir):
    old = os.umask(0)
    try:
        sock = listen_unix(short_dir / "a.sock")
    finally:
        os.umask(old)
    try:
        st = os.stat(short_dir / "a.sock")
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert os.umask(old) == old  # umask restored
        with pytest.raises(FileExistsError, match="a.sock"):
            listen_unix(short_dir / "a.sock")
    finally:
        sock.close()


@pytest.mark.parametrize("kind", [socket.SOCK_SEQPACKET, socket.SOCK_STREAM])
def test_round_trip_in_process(kind):
    a, b = socket.socketpair(socket.AF_UNIX, kind)
    src, dst = host_backend(G), host_backend(G)
    try:
        chunks = [src.create_chunk() for _ in range(3)]
        r = src.reserve(3 * G)
        for i, c in enumerate(chunks):
            src.map(r, i * G, c)
            src.tensor_view(r, i * G, G).fill_(i + 1)
        before = _nfds()
        send_chunks(a, chunks)
        send_chunks(a, chunks[:1], meta={"n": 1})
        got = recv_chunks(b, dst)
        assert _nfds() == before + 3  # one dup held by dst per imported chunk, nothing else
        assert [c.source_id for c in got] == [c.handle_id for c in chunks]
        raw, meta = recv_chunks(b, with_meta=True)
        assert meta == {"n": 1} and isinstance(raw[0], ReceivedChunk) and raw[0].size == G
        os.close(raw[0].fd)
        r2 = dst.reserve(3 * G)
        for i, c in enumerate(got):
            dst.map(r2, i * G, c)
            assert int(dst.tensor_view(r2, i * G, G).max()) == i + 1
    finally:
        a.close(), b.close(), src.close(), dst.close()


def _raw_message(header, nfds, *, length_delta=0):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(body) + length_delta).to_bytes(4, "big") + body


def _good(n=2, size=G):
    return {"version": VERSION, "kind": KIND, "count": n, "chunks": [{"id": i + 1, "size": size} for i in range(n)]}


def _with(**changes):
    h = _good()
    h.update(changes)
    return h


@pytest.mark.parametrize(
    "header, nfds, field",
    [
        (_with(version=2), 2, "version"),
        ({k: v for k, v in _good().items() if k != "version"}, 2, "version"),
        (_with(kind="other"), 2, "kind"),
        (_good(), 1, "count"),
        (_good(), 3, "count"),
        (_with(count=0), 2, "count"),
        (_with(count=3), 2, "chunks"),
        (_good(size=0), 2, r"chunks\[0\]\.size"),
        (_good(size=-G), 2, r"chunks\[0\]\.size"),
        (_with(chunks=[{"id": 1, "size": G}, {"id": "x", "size": G}]), 2, r"chunks\[1\]\.id"),
        (_with(extra=1), 2, "header: unknown field"),
        (b"{not json", 2, "header: not valid JSON"),
        (b"[1, 2]", 2, "header: expected a JSON object"),
    ],
)
def test_malformed_header_is_rejected_and_fds_are_closed(header, nfds, field):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    vmm = host_backend(G)
    try:
        baseline = _nfds()
        fds = [os.memfd_create("t") for _ in range(nfds)]
        for fd in fds:
            os.ftruncate(fd, G)
        socket.send_fds(a, [_raw_message(header, nfds)], fds)
        for fd in fds:
            os.close(fd)
        with pytest.raises(ValueError, match=field):
            recv_chunks(b, vmm)
        assert _nfds() == baseline  # every received fd was closed
        assert vmm.live_chunks() == []
    finally:
        a.close(), b.close(), vmm.close()


def test_bad_length_prefix_and_wrong_size_for_backend_close_the_fds():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    vmm = host_backend(G)
    try:
        baseline = _nfds()
        fd = os.memfd_create("t")
        os.ftruncate(fd, G)
        socket.send_fds(a, [_raw_message(_good(1), 1, length_delta=5)], [fd])
        with pytest.raises(ValueError, match="header length"):
            recv_chunks(b, vmm)
        # a well-formed header whose second chunk's size the backend cannot take:
        # the first chunk, already imported, is destroyed again
        fd2 = os.memfd_create("t")
        os.ftruncate(fd2, 2 * G)
        h = _good(2)
        h["chunks"][1]["size"] = 2 * G
        socket.send_fds(a, [_raw_message(h, 2)], [fd, fd2])
        os.close(fd), os.close(fd2)
        with pytest.raises(ValueError, match="size"):
            recv_chunks(b, vmm)
        assert _nfds() == baseline and vmm.live_chunks() == []
        assert vmm.counters()["chunks_imported"] == 1 == vmm.counters()["chunks_destroyed"]
    finally:
        a.close(), b.close(), vmm.close()


def test_non_memfd_fd_is_rejected():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    vmm = host_backend(G)
    try:
        baseline = _nfds()
        rp, wp = os.pipe()
        socket.send_fds(a, [_raw_message(_good(1), 1)], [rp])
        os.close(rp), os.close(wp)
        with pytest.raises(ValueError, match="fds: .* not a memfd"):
            recv_chunks(b, vmm)
        assert _nfds() == baseline and vmm.live_chunks() == []
    finally:
        a.close(), b.close(), vmm.close()
