"""A fake of the part of ``cuda.bindings.driver`` (cuda-python) that memx calls, over host memory.

Test-only. ``FakeDriver()`` is an object with the same names as the binding module (the calls,
``CUresult`` and the other enums, the structs); ``support.fake_cuda.installed`` puts one in
``sys.modules`` as ``cuda.bindings.driver``. Calls return ``(CUresult, value)`` / ``(CUresult,)``
tuples as cuda-python does; an error never raises.

Model: a device pointer is a host address. ``cuMemAddressReserve`` is an inaccessible
(PROT_NONE) anonymous mapping; ``cuMemCreate`` is a memfd; ``cuMemMap`` maps the memfd
MAP_FIXED|MAP_SHARED still PROT_NONE; only ``cuMemSetAccess`` makes it readable/writable.
``check_access`` is "the device touching memory": it raises ``FakeFault``
(CUDA_ERROR_ILLEGAL_ADDRESS) unless every byte is mapped with access for that device.

Semantics, from the driver documentation (Virtual Memory Management):
* cuMemCreate / cuMemMap: size, ptr and offset are multiples of the MINIMUM granularity;
  offset + size fits the allocation; flags are zero; the range is a reservation.
* cuMemMap does not make memory accessible; cuMemSetAccess needs a fully mapped range.
* cuMemUnmap takes whole mappings only; the range becomes a reservation again, and a new
  mapping there starts without access.
* cuMemRelease may come before the unmap: memory is freed when the last handle is released
  and the last mapping unmapped. Each import is paired with its own cuMemRelease.
* cuMemAddressFree: ptr and size exactly as reserved. cuMemAddressReserve: size a multiple
  of the page size, alignment zero or a power of two, flags zero.
* Export needs the handle type in prop.requestedHandleTypes; import does not take the fd.
Where the documentation names no error code, or calls misuse undefined, the fake is strict
and says so in ``last_error``: mapping over a mapping, an unknown handle (even to
cuMemRelease), freeing a reservation that still has mappings, any cuMem* call without an
active current context on the calling thread (contexts are per thread) -> an error.
A budget (``budget_bytes`` per device) makes cuMemCreate / cuMemAlloc fail with
CUDA_ERROR_OUT_OF_MEMORY. Imports from another process are not charged to this one.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import stat
import threading
from collections import Counter

from .fake_cuda_types import (
    LIBC,
    MAP_ANON,
    MAP_FIXED,
    MAP_PRIVATE,
    MAP_SHARED,
    PAGE,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    RESERVE,
    Alloc,
    CUcontext,
    CUdevice,
    CUdeviceptr,
    CUmemAccess_flags,
    CUmemAccessDesc,
    CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType,
    CUmemAllocationProp,
    CUmemAllocationType,
    CUmemGenericAllocationHandle,
    CUmemLocation,
    CUmemLocationType,
    CUresult,
    DriverErr,
    FakeFault,
    Mapping,
    api,
    as_int,
    host_mmap,
)


class FakeDriver:
    """One process's view of ``device_count`` fake devices. Thread-safe; see the module docstring."""

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemLocation = CUmemLocation
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc
    CUdevice = CUdevice
    CUcontext = CUcontext
    CUdeviceptr = CUdeviceptr
    CUmemGenericAllocationHandle = CUmemGenericAllocationHandle

    def __init__(self, *, device_count: int = 1, min_granularity: int = 2 << 20, budget_bytes: int | None = None):
        if min_granularity <= 0 or min_granularity % PAGE:
            raise ValueError(f"min_granularity {min_granularity} is not a positive multiple of the page size")
        self.device_count = device_count
        self.min_granularity = min_granularity
        self.budget_bytes = budget_bytes
        self.used = [0] * device_count
        self.calls: Counter = Counter()
        self.last_error: tuple[str, str, str] | None = None
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._initialized = False
        self._ctx_refs = [0] * device_count
        self._faults: dict[str, list[CUresult]] = {}
        self._reservations: dict[int, int] = {}  # base -> size
        self._raw: dict[int, tuple[int, int]] = {}  # base -> host mmap (addr, size)
        self._mappings: dict[int, Mapping] = {}  # base -> mapping
        self._handles: dict[int, Alloc] = {}
        self._by_key: dict[tuple[int, int], Alloc] = {}  # memfd (st_dev, st_ino) -> allocation
        self._dev_allocs: dict[int, tuple[int, int]] = {}  # cuMemAlloc ptr -> (size, device)
        self._ids = itertools.count(0x100)
        self._hooks: dict | None = None

    # ---------------------------------------------------------------- test controls
    def fail_next(self, call: str, code: CUresult, times: int = 1) -> None:
        """Make the next ``times`` calls of ``call`` return ``code`` and do nothing."""
        with self._lock:
            self._faults.setdefault(call, []).extend([CUresult(code)] * times)

    def live(self) -> dict[str, int]:
        """What is still allocated: a clean shutdown leaves every count at zero."""
        with self._lock:
            return {
                "reservations": len(self._reservations),
                "mappings": len(self._mappings),
                "handles": len(self._handles),
                "allocations": len(self._by_key),
                "device_allocs": len(self._dev_allocs),
                "retained_contexts": sum(self._ctx_refs),
            }

    def check_access(self, ptr: int, nbytes: int, device: int = 0, *, write: bool = True, holes: bool = False) -> None:
        """The device touches ``[ptr, ptr + nbytes)``: raise ``FakeFault`` unless it may. With
        ``holes=True`` bare reservation is skipped (a view may span holes it never touches)."""
        need = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if write else 1
        with self._lock:
            at, end = ptr, ptr + nbytes
            while at < end:
                dev = next((p + s for p, (s, _) in self._dev_allocs.items() if p <= at < p + s), None)
                m = self._mapping_at(at)
                if dev is not None:
                    at = dev
                elif m is not None:
                    if m.access.get(device, 0) & need != need:
                        raise FakeFault(
                            f"{at:#x} is mapped but device {device} has no {'write' if write else 'read'} "
                            f"access (cuMemSetAccess was not called for it)"
                        )
                    at = m.base + m.size
                elif holes:
                    at = min([b for b in self._mappings if at < b < end], default=end)
                else:
                    raise FakeFault(f"{at:#x} is not mapped (touched {nbytes} bytes at {ptr:#x})")

    # ---------------------------------------------------------------- internals
    def _current_device(self) -> int:
        ctx = getattr(self._tls, "ctx", None)
        if ctx is None:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_CONTEXT, "no current context on this thread")
        device = int(ctx) - 1
        if self._ctx_refs[device] == 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"the current context (device {device}) was released")
        return device

    def _device(self, ordinal) -> int:
        d = as_int("device", ordinal)
        if not 0 <= d < self.device_count:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {d} of {self.device_count}")
        return d

    def _aligned(self, what: str, value: int) -> int:
        if value % self.min_granularity:
            raise DriverErr(
                CUresult.CUDA_ERROR_INVALID_VALUE,
                f"{what} {value:#x} is not a multiple of the minimum granularity {self.min_granularity:#x}",
            )
        return value

    def _alloc_of(self, handle) -> Alloc:
        alloc = self._handles.get(as_int("handle", handle))
        if alloc is None:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_HANDLE, f"{handle!r} is not a live allocation handle")
        return alloc

    def _mapping_at(self, addr: int) -> Mapping | None:
        for m in self._mappings.values():
            if m.base <= addr < m.base + m.size:
                return m
        return None

    def _whole_mappings(self, ptr: int, size: int) -> list[Mapping]:
        """The mappings that exactly tile ``[ptr, ptr + size)``, else INVALID_VALUE."""
        out, at = [], ptr
        while at < ptr + size:
            m = self._mappings.get(at)
            if m is None or m.base + m.size > ptr + size:
                raise DriverErr(
                    CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"[{ptr:#x}, {ptr + size:#x}) is not made of whole mappings (at {at:#x})",
                )
            out.append(m)
            at += m.size
        if not out:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "empty range")
        return out

    def _charge(self, device: int, size: int) -> None:
        if self.budget_bytes is not None and self.used[device] + size > self.budget_bytes:
            raise DriverErr(
                CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                f"device {device}: {self.used[device]} + {size} bytes exceed the budget {self.budget_bytes}",
            )
        self.used[device] += size

    def _maybe_free(self, alloc: Alloc) -> None:
        if not alloc.handles and alloc.maps == 0:
            os.close(alloc.fd)
            self.used[alloc.device] -= alloc.charged
            del self._by_key[alloc.key]

    def _new_handle(self, alloc: Alloc) -> CUmemGenericAllocationHandle:
        hid = next(self._ids)
        alloc.handles.add(hid)
        self._handles[hid] = alloc
        return CUmemGenericAllocationHandle(hid)

    # ---------------------------------------------------------------- init, devices, contexts
    @api(ctx=False, init=False)
    def cuInit(self, flags):
        if as_int("flags", flags) != 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "cuInit flags must be 0")
        self._initialized = True

    @api(outs=1, ctx=False, init=False)
    def cuGetErrorName(self, error):
        try:
            return CUresult(as_int("error", error)).name.encode()
        except ValueError:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"unknown CUresult {error!r}") from None

    @api(outs=1, ctx=False)
    def cuDeviceGetCount(self):
        return self.device_count

    @api(outs=1, ctx=False)
    def cuDeviceGet(self, ordinal):
        return CUdevice(self._device(ordinal))

    @api(outs=1, ctx=False)
    def cuDevicePrimaryCtxRetain(self, dev):
        d = self._device(dev)
        self._ctx_refs[d] += 1
        return CUcontext(d + 1)

    @api(ctx=False)
    def cuDevicePrimaryCtxRelease(self, dev):
        d = self._device(dev)
        if self._ctx_refs[d] == 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"device {d}'s primary context is not retained")
        self._ctx_refs[d] -= 1

    @api(ctx=False)
    def cuCtxSetCurrent(self, ctx):
        if ctx is not None and not (isinstance(ctx, CUcontext) and 1 <= int(ctx) <= self.device_count):
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{ctx!r} is not a context")
        self._tls.ctx = ctx

    @api()
    def cuCtxSynchronize(self):
        return None  # host memory: nothing is ever pending

    # ---------------------------------------------------------------- granularity, reservations
    @api(outs=1)
    def cuMemGetAllocationGranularity(self, prop, option):
        if not isinstance(prop, CUmemAllocationProp):
            raise TypeError("prop must be a CUmemAllocationProp")
        if prop.location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "prop.location.type is not DEVICE")
        self._device(prop.location.id)
        option = CUmemAllocationGranularity_flags(as_int("option", option))
        return self.min_granularity * (1 if option == 0 else 2)

    @api(outs=1)
    def cuMemAddressReserve(self, size, alignment, addr, flags):
        size, alignment = as_int("size", size), as_int("alignment", alignment)
        as_int("addr", addr)  # a hint only
        if as_int("flags", flags) != 0 or size <= 0 or size % PAGE:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"size {size} (page multiple > 0) or flags")
        if alignment and alignment & (alignment - 1):
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"alignment {alignment} is not a power of two")
        align = max(alignment or self.min_granularity, PAGE)
        raw = host_mmap(None, size + align, PROT_NONE, RESERVE)
        base = -(-raw // align) * align
        self._reservations[base] = size
        self._raw[base] = (raw, size + align)
        return CUdeviceptr(base)

    @api()
    def cuMemAddressFree(self, ptr, size):
        ptr, size = as_int("ptr", ptr), as_int("size", size)
        if self._reservations.get(ptr) != size:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"[{ptr:#x}, +{size:#x}) is not a reservation as made")
        inside = [m.base for m in self._mappings.values() if ptr <= m.base < ptr + size]
        if inside:
            raise DriverErr(
                CUresult.CUDA_ERROR_INVALID_VALUE, f"{len(inside)} mapping(s) remain, first at {inside[0]:#x}"
            )
        raw, raw_size = self._raw.pop(ptr)
        del self._reservations[ptr]
        LIBC.munmap(raw, raw_size)

    # ---------------------------------------------------------------- physical allocations
    @api(outs=1)
    def cuMemCreate(self, size, prop, flags):
        size = as_int("size", size)
        if not isinstance(prop, CUmemAllocationProp):
            raise TypeError("prop must be a CUmemAllocationProp")
        if as_int("flags", flags) != 0 or size <= 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "size must be positive and flags 0")
        self._aligned("size", size)
        if prop.type != CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "prop.type must be PINNED")
        if prop.location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "prop.location.type must be DEVICE")
        device = self._device(prop.location.id)
        self._charge(device, size)
        try:
            fd = os.memfd_create("memx-fakecuda", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        except OSError as exc:
            self.used[device] -= size
            raise DriverErr(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"memfd: {exc}") from None
        st = os.fstat(fd)
        alloc = Alloc(fd, size, device, int(prop.requestedHandleTypes), size, (st.st_dev, st.st_ino))
        self._by_key[alloc.key] = alloc
        return self._new_handle(alloc)

    @api()
    def cuMemRelease(self, handle):
        alloc = self._alloc_of(handle)
        hid = int(handle)
        alloc.handles.discard(hid)
        del self._handles[hid]
        self._maybe_free(alloc)

    @api(outs=1)
    def cuMemExportToShareableHandle(self, handle, handle_type, flags):
        alloc = self._alloc_of(handle)
        kind = as_int("handleType", handle_type)
        if as_int("flags", flags) != 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "flags must be 0")
        if kind != CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            raise DriverErr(CUresult.CUDA_ERROR_NOT_SUPPORTED, f"handle type {kind} on Linux")
        if not alloc.handle_types & kind:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "the allocation did not request POSIX fd handles")
        fd = os.dup(alloc.fd)
        os.set_inheritable(fd, True)  # the driver promises nothing about it: our code must set it
        return fd

    @api(outs=1)
    def cuMemImportFromShareableHandle(self, os_handle, handle_type):
        fd = as_int("osHandle", os_handle)
        if as_int("shHandleType", handle_type) != CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            raise DriverErr(CUresult.CUDA_ERROR_NOT_SUPPORTED, "only POSIX fds")
        try:
            st = os.fstat(fd)
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as exc:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"fd {fd}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode) or not link.startswith("/memfd:memx-fakecuda"):
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"fd {fd} ({link}) is not a shareable allocation handle")
        alloc = self._by_key.get((st.st_dev, st.st_ino))
        if alloc is None:  # exported by another process (or another fake): not charged here
            kinds = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            alloc = Alloc(os.dup(fd), st.st_size, self._current_device(), kinds, 0, (st.st_dev, st.st_ino))
            self._by_key[alloc.key] = alloc
        return self._new_handle(alloc)

    # ---------------------------------------------------------------- mapping and access
    @api()
    def cuMemMap(self, ptr, size, offset, handle, flags):
        ptr, size, offset = as_int("ptr", ptr), as_int("size", size), as_int("offset", offset)
        if as_int("flags", flags) != 0 or size <= 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "size must be positive and flags 0")
        for what, v in (("ptr", ptr), ("size", size), ("offset", offset)):
            self._aligned(what, v)
        alloc = self._alloc_of(handle)
        if offset + size > alloc.size:
            raise DriverErr(
                CUresult.CUDA_ERROR_INVALID_VALUE, f"offset + size {offset + size:#x} > allocation {alloc.size:#x}"
            )
        if not any(b <= ptr and ptr + size <= b + s for b, s in self._reservations.items()):
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"[{ptr:#x}, +{size:#x}) is not inside one reservation")
        for m in self._mappings.values():
            if m.base < ptr + size and ptr < m.base + m.size:
                raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"{m.base:#x} is already mapped")
        got = LIBC.mmap(ptr, size, PROT_NONE, MAP_FIXED | MAP_SHARED, alloc.fd, offset)
        if got != ptr:
            raise DriverErr(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"host mmap failed: {os.strerror(ctypes.get_errno())}")
        self._mappings[ptr] = Mapping(ptr, size, alloc)
        alloc.maps += 1

    @api()
    def cuMemSetAccess(self, ptr, size, desc, count):
        ptr, size, count = as_int("ptr", ptr), as_int("size", size), as_int("count", count)
        desc = list(desc)
        if count <= 0 or count > len(desc):
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"count {count} with {len(desc)} descriptor(s)")
        grants = {}
        for d in desc[:count]:
            if not isinstance(d, CUmemAccessDesc):
                raise TypeError("desc must hold CUmemAccessDesc")
            if d.location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
                raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "access location type must be DEVICE")
            try:
                grants[self._device(d.location.id)] = CUmemAccess_flags(int(d.flags))
            except ValueError:
                raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"access flags {d.flags!r}") from None
        mappings = self._whole_mappings(ptr, size)
        for m in mappings:
            m.access.update(grants)
            flags = max(m.access.values(), default=0)
            prot = PROT_READ | PROT_WRITE if flags == 3 else (PROT_READ if flags == 1 else PROT_NONE)
            LIBC.mprotect(m.base, m.size, prot)

    @api()
    def cuMemUnmap(self, ptr, size):
        for m in self._whole_mappings(as_int("ptr", ptr), as_int("size", size)):
            host_mmap(m.base, m.size, PROT_NONE, MAP_FIXED | RESERVE)  # back to a bare reservation
            del self._mappings[m.base]
            m.alloc.maps -= 1
            self._maybe_free(m.alloc)

    # ---------------------------------------------------------------- plain device memory
    @api(outs=1)
    def cuMemAlloc(self, size):
        size = as_int("bytesize", size)
        if size <= 0:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, "bytesize must be positive")
        device = self._current_device()
        self._charge(device, size)
        try:
            ptr = host_mmap(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON)
        except DriverErr:
            self.used[device] -= size
            raise
        self._dev_allocs[ptr] = (size, device)
        return CUdeviceptr(ptr)

    @api()
    def cuMemFree(self, dptr):
        ptr = as_int("dptr", dptr)
        if ptr not in self._dev_allocs:
            raise DriverErr(CUresult.CUDA_ERROR_INVALID_VALUE, f"{ptr:#x} was not returned by cuMemAlloc")
        size, device = self._dev_allocs.pop(ptr)
        LIBC.munmap(ptr, size)
        self.used[device] -= size

    def arena_hooks(self) -> dict[str, int]:
        """C function pointers with the signatures ``SegmentArena`` takes (cuMemAlloc_v2,
        cuMemFree_v2, cuCtxSynchronize), calling this fake: ``cuda_driver_hooks()`` for tests."""
        if self._hooks is None:
            alloc_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
            free_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)
            sync_t = ctypes.CFUNCTYPE(ctypes.c_int)

            def alloc(out, size):
                result, ptr = self.cuMemAlloc(size)
                out[0] = int(ptr) if result == 0 else 0
                return int(result)

            keep = (
                alloc_t(alloc),
                free_t(lambda p: int(self.cuMemFree(p)[0])),
                sync_t(lambda: int(self.cuCtxSynchronize()[0])),
            )
            names = ("overflow_alloc", "overflow_free", "sync")
            self._hooks = {"_keep": keep} | {n: ctypes.cast(f, ctypes.c_void_p).value for n, f in zip(names, keep)}
        return {k: v for k, v in self._hooks.items() if k != "_keep"}
