"""Host (CPU memory) backend of the virtual-memory layer, on Linux libc via ctypes.

Call by call:

* reserve  -> ``mmap(NULL, size + g, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``,
  then ``munmap`` of the head and tail so that ``base`` is granularity-aligned.
* release  -> ``munmap(base, size)``.
* create   -> ``memfd_create`` + ``ftruncate(fd, g)`` (the fd is the chunk).
* destroy  -> ``close(fd)``.
* map      -> ``mmap(addr, g, PROT_READ|PROT_WRITE, MAP_FIXED|MAP_SHARED, fd, 0)``,
  replacing that slot of the reservation atomically.
* unmap    -> ``mmap(addr, g, PROT_NONE, MAP_FIXED|MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``:
  the slot is inaccessible again but stays inside the reservation, so no other
  mmap in the process can land there.
* export   -> ``dup(fd)``; import -> ``dup`` of the caller's fd after checking
  with ``fstat`` that it is a regular (memfd/shm) file of exactly ``size`` bytes.

Every libc return value is checked; failures raise OSError naming the call.
"""

from __future__ import annotations

import ctypes
import errno
import mmap as _mmap
import os
import stat
import sys
from typing import TYPE_CHECKING

from .base import VmmBackend

if TYPE_CHECKING:
    import torch

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = getattr(_mmap, "MAP_ANONYMOUS", 0x20)
MAP_NORESERVE = 0x4000  # same value on x86-64 and aarch64

DEFAULT_GRANULARITY = 2 << 20

_MAP_FAILED = ctypes.c_void_p(-1).value
_RESERVE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_libc = None


def _os_error(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call} failed: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})")


class HostVmmBackend(VmmBackend):
    """Virtual-memory backend over host memory (memfd chunks, mmap slots)."""

    @property
    def device(self) -> torch.device:
        """The CPU (torch is imported on first use: the arbiter process never needs it)."""
        import torch

        return torch.device("cpu")

    def __init__(self, granularity: int = DEFAULT_GRANULARITY, *, name: str = "memx-vmm"):
        global _libc
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, "HostVmmBackend needs Linux (memfd_create, MAP_FIXED)")
        super().__init__(granularity)
        page = os.sysconf("SC_PAGE_SIZE")
        if granularity % page:
            raise ValueError(f"granularity {granularity} is not a multiple of the page size {page}")
        if _libc is None:
            _libc = _load_libc()
        self._libc = _libc
        self._name = name

    # ------------------------------------------------------------ libc calls
    def _mmap(self, call: str, addr, length: int, prot: int, flags: int, fd: int = -1) -> int:
        ctypes.set_errno(0)
        result = self._libc.mmap(addr, length, prot, flags, fd, 0)
        if result is None or result == _MAP_FAILED:
            raise _os_error(call)
        if addr is not None and result != addr:  # cannot happen with MAP_FIXED; be certain
            raise OSError(errno.EFAULT, f"{call} mapped at {result:#x}, not at {addr:#x}")
        return result

    def _munmap(self, call: str, addr: int, length: int) -> None:
        ctypes.set_errno(0)
        if length and self._libc.munmap(addr, length) != 0:
            raise _os_error(call)

    # ------------------------------------------------------------ primitives
    def _os_reserve(self, size: int) -> int:
        g = self._granularity
        raw = self._mmap("mmap(PROT_NONE reservation)", None, size + g, PROT_NONE, _RESERVE_FLAGS)
        base = -(-raw // g) * g
        try:
            self._munmap("munmap(reservation head)", raw, base - raw)
            self._munmap("munmap(reservation tail)", base + size, raw + g - base)
        except OSError:
            self._libc.munmap(raw, size + g)
            raise
        return base

    def _os_release(self, base: int, size: int) -> None:
        self._munmap("munmap(release)", base, size)

    def _os_create(self) -> int:
        fd = os.memfd_create(self._name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self._granularity)
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, f"ftruncate(memfd, {self._granularity}) failed: {exc.strerror}") from None
        return fd

    def _os_destroy(self, handle: int) -> None:
        os.close(handle)

    def _os_map(self, address: int, handle: int) -> None:
        self._mmap(
            "mmap(MAP_FIXED|MAP_SHARED)",
            address,
            self._granularity,
            PROT_READ | PROT_WRITE,
            MAP_FIXED | MAP_SHARED,
            handle,
        )

    def _os_unmap(self, address: int) -> None:
        self._mmap("mmap(MAP_FIXED PROT_NONE unmap)", address, self._granularity, PROT_NONE, MAP_FIXED | _RESERVE_FLAGS)

    def _os_export(self, handle: int) -> int:
        return os.dup(handle)  # os.dup makes the new fd non-inheritable (O_CLOEXEC)

    def _os_import(self, fd: int, size: int) -> int:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"fds: fd {fd} is not a memfd/shared-memory file (mode {st.st_mode:#o})")
        if st.st_size != size:
            raise ValueError(f"size {size} differs from the size {st.st_size} of the file behind fd {fd}")
        return os.dup(fd)

    def _make_tensor(self, address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        import torch

        buf = (ctypes.c_char * nbytes).from_address(address)
        return torch.frombuffer(buf, dtype=dtype)
