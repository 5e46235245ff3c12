"""Parts of the fake ``cuda.bindings.driver`` (see ``fake_cuda_driver``): the enums, structs and
opaque values, with the names and numeric values of cuda-python and the CUDA headers for the
subset memx touches (``int()`` reads an opaque value, as with cuda-python's wrappers); the
fake's records of allocations and mappings; ``api``, the wrapper that turns a call into
cuda-python's ``(CUresult, value)`` convention; and the libc calls behind host memory."""

from __future__ import annotations

import ctypes
import enum
import functools
import os
from dataclasses import dataclass, field


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
    CU_MEM_HANDLE_TYPE_WIN32 = 2
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 4
    CU_MEM_HANDLE_TYPE_FABRIC = 8


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Opaque:
    """An int-valued driver object (cuda-python's CUdevice, CUdeviceptr, ...): ``int()`` reads it."""

    def __init__(self, value: int = 0):
        self._value = int(value)

    def __int__(self) -> int:
        return self._value

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and int(other) == self._value

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._value))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdevice(_Opaque):
    pass


class CUcontext(_Opaque):
    pass


class CUdeviceptr(_Opaque):
    pass


class CUmemGenericAllocationHandle(_Opaque):
    pass


class CUmemLocation:
    def __init__(self):
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationProp:
    def __init__(self):
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.requestedHandleTypes = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.location = CUmemLocation()


class CUmemAccessDesc:
    def __init__(self):
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


class FakeFault(RuntimeError):
    """The fake's device touched memory it may not: an illegal-address fault on a GPU."""

    def __init__(self, message: str):
        self.result = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
        super().__init__(f"CUDA_ERROR_ILLEGAL_ADDRESS: {message}")


PAGE = os.sysconf("SC_PAGE_SIZE")
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED = 0x01, 0x02, 0x10
MAP_ANON, MAP_NORESERVE = 0x20, 0x4000
RESERVE = MAP_PRIVATE | MAP_ANON | MAP_NORESERVE
FAILED = ctypes.c_void_p(-1).value


def load_libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


LIBC = load_libc()


class DriverErr(Exception):
    def __init__(self, code: CUresult, why: str):
        super().__init__(why)
        self.code = code


@dataclass
class Alloc:
    fd: int
    size: int
    device: int
    handle_types: int
    charged: int
    key: tuple[int, int]
    handles: set = field(default_factory=set)
    maps: int = 0


@dataclass
class Mapping:
    base: int
    size: int
    alloc: Alloc
    access: dict = field(default_factory=dict)  # device -> CUmemAccess_flags


def api(outs: int = 0, ctx: bool = True, init: bool = True):
    """Count the call, apply injected faults and the init/context rules, turn DriverErr into a tuple."""

    def wrap(fn):
        name = fn.__name__

        @functools.wraps(fn)
        def call(self, *args):
            with self._lock:
                self.calls[name] += 1
                try:
                    if self._faults.get(name):
                        raise DriverErr(self._faults[name].pop(0), "injected by fail_next")
                    if init and not self._initialized:
                        raise DriverErr(CUresult.CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called")
                    if ctx:
                        self._current_device()
                    out = fn(self, *args)
                except DriverErr as err:
                    self.last_error = (name, err.code.name, str(err))
                    return (err.code,) + (None,) * outs
            return (CUresult.CUDA_SUCCESS,) + ((out,) if outs == 1 else ())

        return call

    return wrap


def as_int(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__int__"):
        raise TypeError(f"{name}: expected an int-like driver value, got {type(value).__name__}")
    return int(value)


def host_mmap(addr, size: int, prot: int, flags: int, fd: int = -1) -> int:
    got = LIBC.mmap(addr, size, prot, flags, fd, 0)
    if got is None or got == FAILED:
        raise DriverErr(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"host mmap failed: {os.strerror(ctypes.get_errno())}")
    return got
