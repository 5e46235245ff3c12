"""Passing physical chunks between processes over a Unix socket (SCM_RIGHTS).

One message carries a batch of chunks::

    4-byte big-endian header length | JSON header | fds (ancillary, SCM_RIGHTS)

    header = {"version": 1, "kind": "memx.vmm.chunks", "count": N,
              "chunks": [{"id": <sender handle_id>, "size": <bytes>}, ...],
              "meta": {...}}            # optional, caller-defined, JSON

The i-th fd belongs to the i-th entry of ``chunks``. The receiver validates
the header strictly; on any error it closes every fd it received, so nothing
leaks, and raises ValueError naming the offending field.

SOCK_SEQPACKET (what ``listen_unix``/``connect_unix`` make) keeps message
boundaries; SOCK_STREAM also works (the fds ride on the first 4 bytes and the
rest is read in full). ``listen_unix`` changes the process umask around
``bind``; do not create files from other threads at that moment.

Who can reach a socket: ``listen_unix`` makes the socket file 0600 and binds only in a
*private directory* (``check_private_dir``: owned by this process's effective uid, not
writable by group or others), so no other user can connect to it, replace it or plant
one under its name. ``private_dir`` creates such a directory (0700) or checks an
existing one.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .base import PhysicalChunk, VmmBackend

VERSION = 1
KIND = "memx.vmm.chunks"
MAX_HEADER_BYTES = 1 << 16
MAX_FDS = 253  # SCM_MAX_FD on Linux
_LEN = struct.Struct(">I")


@dataclass
class ReceivedChunk:
    """A chunk fd received but not imported; the caller owns ``fd``."""

    fd: int
    size: int
    source_id: int


def close_fds(fds: Sequence[int]) -> None:
    """Close every fd, ignoring those already closed (after a failed send or receive)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def send_chunks(sock: socket.socket, chunks: Sequence[PhysicalChunk], meta: dict[str, Any] | None = None) -> None:
    """Send ``chunks`` (exported by the backend that owns each) in one message."""
    chunks = list(chunks)
    if not chunks:
        raise ValueError("chunks: nothing to send")
    if len(chunks) > MAX_FDS:
        raise ValueError(f"chunks: {len(chunks)} exceeds {MAX_FDS} per message")
    for c in chunks:
        if not isinstance(c, PhysicalChunk) or not isinstance(c.owner, VmmBackend):
            raise ValueError(f"chunks: {c!r} is not a chunk owned by a VmmBackend")
    header = {
        "version": VERSION,
        "kind": KIND,
        "count": len(chunks),
        "chunks": [{"id": c.handle_id, "size": c.size} for c in chunks],
    }
    if meta is not None:
        header["meta"] = meta
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"meta: header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    fds: list[int] = []
    try:
        for c in chunks:
            fds.append(c.owner.export_chunk(c))
        data = _LEN.pack(len(body)) + body
        sent = socket.send_fds(sock, [data], fds)
        if sent != len(data):  # SEQPACKET sends all or fails; finish a short STREAM send
            sock.sendall(data[sent:])
    finally:
        close_fds(fds)  # the kernel holds its own references once sent


def _recv_exact(sock: socket.socket, n: int, data: bytes = b"") -> bytes:
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError(f"peer closed the socket after {len(data)} of {n} bytes")
        data += more
    return data


def _recv_message(sock: socket.socket):
    if sock.type == socket.SOCK_STREAM:
        data, fds, flags, _ = socket.recv_fds(sock, _LEN.size, MAX_FDS)
        try:
            if not data:
                raise ConnectionError("peer closed the socket")
            _check_flags(flags)
            data = _recv_exact(sock, _LEN.size, data)
            (length,) = _LEN.unpack(data)
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
            body = _recv_exact(sock, length)
        except BaseException:
            close_fds(fds)
            raise
        return body, fds
    data, fds, flags, _ = socket.recv_fds(sock, _LEN.size + MAX_HEADER_BYTES, MAX_FDS)
    try:
        if not data and not fds:
            raise ConnectionError("peer closed the socket")
        _check_flags(flags)
        if len(data) < _LEN.size:
            raise ValueError(f"header length: message of {len(data)} bytes is too short")
        (length,) = _LEN.unpack_from(data)
        if length != len(data) - _LEN.size:
            raise ValueError(f"header length {length} does not match the {len(data) - _LEN.size} bytes received")
    except BaseException:
        close_fds(fds)
        raise
    return data[_LEN.size :], fds


def _check_flags(flags: int) -> None:
    if flags & socket.MSG_CTRUNC:
        raise ValueError(f"fds: ancillary data truncated (more than {MAX_FDS} fds?)")
    if flags & socket.MSG_TRUNC:
        raise ValueError("header length: message truncated")


def _parse_header(body: bytes, nfds: int) -> dict:
    try:
        header = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"header: expected a JSON object, got {type(header).__name__}")
    unknown = set(header) - {"version", "kind", "count", "chunks", "meta"}
    if unknown:
        raise ValueError(f"header: unknown field(s) {sorted(unknown)}")
    if header.get("version") != VERSION:
        raise ValueError(f"version: expected {VERSION}, got {header.get('version')!r}")
    if header.get("kind") != KIND:
        raise ValueError(f"kind: expected {KIND!r}, got {header.get('kind')!r}")
    count = header.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ValueError(f"count: expected a positive int, got {count!r}")
    entries = header.get("chunks")
    if not isinstance(entries, list) or len(entries) != count:
        raise ValueError(f"chunks: expected a list of {count} entries, got {entries!r:.80}")
    if nfds != count:
        raise ValueError(f"count: header says {count} chunks but {nfds} fds arrived")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"id", "size"}:
            raise ValueError(f"chunks[{i}]: expected {{'id', 'size'}}, got {entry!r:.80}")
        for key in ("id", "size"):
            v = entry[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"chunks[{i}].{key}: expected an int, got {v!r}")
        if entry["size"] <= 0:
            raise ValueError(f"chunks[{i}].size: expected a positive size, got {entry['size']}")
    if "meta" in header and not isinstance(header["meta"], dict):
        raise ValueError("meta: expected a JSON object")
    return header


def recv_chunks(sock: socket.socket, backend: VmmBackend | None = None, *, with_meta: bool = False) -> list | tuple:
    """Receive one message from ``send_chunks``.

    With ``backend``: the chunks are imported into it (the backend checks that
    each fd is the right kind of handle and size) and every received fd is
    closed; returns ``[PhysicalChunk]`` (``source_id`` = sender's handle_id).
    Without: returns ``[ReceivedChunk]`` whose fds the caller owns.
    With ``with_meta=True`` returns ``(chunks, meta)``.
    On any error every received fd (and every chunk imported so far) is
    released before the exception propagates.
    """
    body, fds = _recv_message(sock)
    imported: list[PhysicalChunk] = []
    try:
        header = _parse_header(body, len(fds))
        entries = header["chunks"]
        if backend is None:
            out: list = [ReceivedChunk(fd, e["size"], e["id"]) for fd, e in zip(fds, entries)]
        else:
            for fd, e in zip(fds, entries):
                imported.append(backend.import_chunk(fd, e["size"], source_id=e["id"]))
            close_fds(fds)
            out = imported
    except BaseException:
        for chunk in imported:
            backend.destroy_chunk(chunk)
        close_fds(fds)
        raise
    return (out, header.get("meta", {})) if with_meta else out


class UnsafeDirectoryError(PermissionError):
    """A directory for control sockets that another user owns or may write to."""


def check_private_dir(path: str | os.PathLike) -> None:
    """Raise ``UnsafeDirectoryError`` unless ``path`` is a directory owned by this process's
    effective uid and not writable by group or others (0700 or stricter on the write bits;
    a sticky bit does not help: others could still create names that are not taken yet)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"directory {os.fspath(path)}: not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"directory {os.fspath(path)}: owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeDirectoryError(
            f"directory {os.fspath(path)}: mode {mode:#o} lets group or others write in it; "
            f"chmod go-w it (memx creates its own directories 0700) or choose another"
        )


def private_dir(path: str | os.PathLike) -> str:
    """Create ``path`` with mode 0700 (missing parents with the default mode) or accept an
    existing one; either way ``check_private_dir`` must pass. Returns the path."""
    path = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        os.mkdir(path, 0o700)  # the umask can only take bits away
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def listen_unix(path: str | os.PathLike, *, type: int = socket.SOCK_SEQPACKET, backlog: int = 8) -> socket.socket:
    """A listening Unix socket at ``path`` whose file has mode 0600 (verified), in a directory
    that passes ``check_private_dir`` (else ``UnsafeDirectoryError``, nothing created)."""
    path = os.fspath(path)
    check_private_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.lexists(path):
        raise FileExistsError(f"path {path} already exists")
    sock = socket.socket(socket.AF_UNIX, type)
    bound = False
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
            bound = True
        finally:
            os.umask(old)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode != 0o600:
            raise PermissionError(f"socket file {path} has mode {mode:#o}, expected 0o600")
        sock.listen(backlog)
    except BaseException:
        sock.close()
        if bound:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return sock


def connect_unix(path: str | os.PathLike, *, type: int = socket.SOCK_SEQPACKET) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, type)
    try:
        sock.connect(os.fspath(path))
    except BaseException:
        sock.close()
        raise
    return sock
