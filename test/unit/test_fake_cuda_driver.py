"""The fake CUDA driver's own semantics, each pinned to a sentence of the driver documentation
(CUDA Driver API, Virtual Memory Management) or marked as the fake's strict choice where the
documentation names no error. Calls go to the fake directly, with cuda-python's conventions."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest

from support.fake_cuda_driver import PAGE, CUresult, FakeDriver, FakeFault

G = 1 << 16
OK = CUresult.CUDA_SUCCESS
INVALID = CUresult.CUDA_ERROR_INVALID_VALUE
FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


@pytest.fixture
def d():
    drv = FakeDriver(min_granularity=G, budget_bytes=8 * G)
    assert drv.cuInit(0) == (OK,)
    _, dev = drv.cuDeviceGet(0)
    _, ctx = drv.cuDevicePrimaryCtxRetain(dev)
    assert drv.cuCtxSetCurrent(ctx) == (OK,)
    drv.ctx = ctx
    yield drv


def prop(d, handle_types=FD, device=0):
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.requestedHandleTypes = handle_types
    p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    return p


def access(d, flags=3, device=0):
    a = d.CUmemAccessDesc()
    a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = device
    a.flags = flags
    return [a]


def ok(out):
    assert out[0] == OK, out
    return out[1] if len(out) == 2 else None


def test_init_first_and_error_names(d):
    fresh = FakeDriver()
    assert fresh.cuDeviceGetCount() == (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
    assert fresh.cuGetErrorName(CUresult.CUDA_ERROR_OUT_OF_MEMORY) == (OK, b"CUDA_ERROR_OUT_OF_MEMORY")
    assert fresh.cuGetErrorName(12345)[0] == INVALID
    assert d.cuDeviceGet(1)[0] == CUresult.CUDA_ERROR_INVALID_DEVICE
    assert int(CUresult.CUDA_ERROR_INVALID_HANDLE) == 400 and int(CUresult.CUDA_ERROR_ILLEGAL_ADDRESS) == 700


def test_granularity_alignment_is_enforced(d):
    """cuMemCreate: size a multiple of the MINIMUM granularity. cuMemMap: ptr, size, offset too."""
    assert ok(d.cuMemGetAllocationGranularity(prop(d), 0)) == G
    assert d.cuMemCreate(G + PAGE, prop(d), 0) == (INVALID, None)
    assert d.cuMemCreate(G, prop(d), 1) == (INVALID, None)  # flags must be zero
    h = ok(d.cuMemCreate(2 * G, prop(d), 0))
    base = int(ok(d.cuMemAddressReserve(4 * G, G, 0, 0)))
    assert base % G == 0
    assert d.cuMemMap(base + PAGE, G, 0, h, 0) == (INVALID,)
    assert d.cuMemMap(base, G + PAGE, 0, h, 0) == (INVALID,)
    assert d.cuMemMap(base, G, PAGE, h, 0) == (INVALID,)
    assert d.cuMemMap(base, 2 * G, G, h, 0) == (INVALID,)  # offset + size beyond the allocation
    assert d.cuMemMap(base, G, G, h, 0) == (OK,)  # the second half of the allocation


def test_reserve_arguments(d):
    """cuMemAddressReserve: size a page multiple, alignment zero or a power of two, flags zero."""
    assert d.cuMemAddressReserve(PAGE + 1, 0, 0, 0)[0] == INVALID
    assert d.cuMemAddressReserve(G, 3 * PAGE, 0, 0)[0] == INVALID
    assert d.cuMemAddressReserve(G, 0, 0, 1)[0] == INVALID
    base = int(ok(d.cuMemAddressReserve(3 * G, 4 * G, 0, 0)))
    assert base % (4 * G) == 0
    assert d.cuMemAddressFree(base, 2 * G) == (INVALID,)  # the size must match the reservation
    assert d.cuMemAddressFree(base + G, 2 * G) == (INVALID,)
    assert d.cuMemAddressFree(base, 3 * G) == (OK,)
    assert d.live()["reservations"] == 0


def test_memory_is_inaccessible_until_set_access(d):
    """cuMemMap does not make the address accessible; cuMemSetAccess on a fully mapped range does."""
    base = int(ok(d.cuMemAddressReserve(2 * G, 0, 0, 0)))
    h = ok(d.cuMemCreate(G, prop(d), 0))
    ok(d.cuMemMap(base, G, 0, h, 0))
    with pytest.raises(FakeFault, match="no write access"):
        d.check_access(base, 8)
    assert d.cuMemSetAccess(base, 2 * G, access(d), 1) == (INVALID,)  # half of it is not mapped
    assert d.cuMemSetAccess(base, G, access(d), 0) == (INVALID,)
    ok(d.cuMemSetAccess(base, G, access(d, flags=1), 1))
    d.check_access(base, G, write=False)
    with pytest.raises(FakeFault):
        d.check_access(base, 8)
    ok(d.cuMemSetAccess(base, G, access(d), 1))
    d.check_access(base, G)
    with pytest.raises(FakeFault, match="not mapped"):
        d.check_access(base + G - 4, 8)  # runs into the unmapped slot


def test_map_over_a_mapping_is_refused(d):
    """The range must be a reservation: a mapped range is not (no error code documented: INVALID_VALUE)."""
    base = int(ok(d.cuMemAddressReserve(2 * G, 0, 0, 0)))
    a, b = ok(d.cuMemCreate(G, prop(d), 0)), ok(d.cuMemCreate(G, prop(d), 0))
    ok(d.cuMemMap(base, G, 0, a, 0))
    assert d.cuMemMap(base, G, 0, b, 0) == (INVALID,)
    assert "already mapped" in d.last_error[2]
    other = int(ok(d.cuMemAddressReserve(G, 0, 0, 0)))
    assert d.cuMemMap(other + G, G, 0, b, 0) == (INVALID,)  # outside any reservation


def test_unmap_whole_mappings_only_then_access_starts_over(d):
    """cuMemUnmap cannot unmap a sub-range; afterwards the range is a reservation again and a
    new mapping there starts with no access."""
    base = int(ok(d.cuMemAddressReserve(2 * G, 0, 0, 0)))
    h = ok(d.cuMemCreate(2 * G, prop(d), 0))
    ok(d.cuMemMap(base, 2 * G, 0, h, 0))
    assert d.cuMemUnmap(base, G) == (INVALID,)
    ok(d.cuMemSetAccess(base, 2 * G, access(d), 1))
    ok(d.cuMemUnmap(base, 2 * G))
    assert d.cuMemUnmap(base, 2 * G) == (INVALID,)  # nothing mapped any more
    ok(d.cuMemMap(base, 2 * G, 0, h, 0))
    with pytest.raises(FakeFault):
        d.check_access(base, 1)


def test_release_before_unmap_keeps_memory_until_the_unmap(d):
    """The generic handle can be freed with mappings outstanding; memory goes with the last of both."""
    base = int(ok(d.cuMemAddressReserve(G, 0, 0, 0)))
    h = ok(d.cuMemCreate(G, prop(d), 0))
    ok(d.cuMemMap(base, G, 0, h, 0))
    ok(d.cuMemSetAccess(base, G, access(d), 1))
    ok(d.cuMemRelease(h))
    assert d.used == [G] and d.live()["handles"] == 0
    d.check_access(base, G)  # still mapped, still usable
    assert d.cuMemRelease(h) == (CUresult.CUDA_ERROR_INVALID_HANDLE,)  # undefined in the docs: strict
    assert d.cuMemMap(base, G, 0, h, 0) == (CUresult.CUDA_ERROR_INVALID_HANDLE,)  # a released handle
    assert d.cuMemAddressFree(base, G) == (INVALID,)  # strict: a mapping remains inside
    ok(d.cuMemUnmap(base, G))
    assert d.used == [0] and d.live()["allocations"] == 0
    ok(d.cuMemAddressFree(base, G))


def test_out_of_memory_at_the_budget(d):
    handles = [ok(d.cuMemCreate(2 * G, prop(d), 0)) for _ in range(3)]
    assert d.cuMemCreate(4 * G, prop(d), 0) == (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    assert d.cuMemAlloc(3 * G) == (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    ptr = ok(d.cuMemAlloc(2 * G))
    d.check_access(int(ptr), 2 * G)  # plain device memory is accessible at once
    assert d.cuMemFree(int(ptr) + PAGE) == (INVALID,)
    ok(d.cuMemFree(ptr))
    ok(d.cuMemRelease(handles[0]))
    ok(d.cuMemCreate(4 * G, prop(d), 0))
    assert d.used == [8 * G]


def test_export_import_in_process(d):
    """Export needs the type in requestedHandleTypes; import does not take the fd; each import is
    its own handle, paired with its own cuMemRelease."""
    plain = ok(d.cuMemCreate(G, prop(d, handle_types=0), 0))
    assert d.cuMemExportToShareableHandle(plain, FD, 0) == (INVALID, None)
    h = ok(d.cuMemCreate(G, prop(d), 0))
    assert d.cuMemExportToShareableHandle(h, 2, 0)[0] == CUresult.CUDA_ERROR_NOT_SUPPORTED
    fd = ok(d.cuMemExportToShareableHandle(h, FD, 0))
    twin = ok(d.cuMemImportFromShareableHandle(fd, FD))
    os.fstat(fd)  # still open: the caller closes it
    os.close(fd)
    assert twin != h and d.used == [2 * G]  # same memory, not charged twice
    ok(d.cuMemRelease(h))
    assert d.used == [2 * G]
    ok(d.cuMemRelease(twin))
    assert d.used == [G]
    with tempfile.TemporaryFile() as f:
        assert d.cuMemImportFromShareableHandle(f.fileno(), FD) == (INVALID, None)
    assert d.cuMemImportFromShareableHandle(fd, FD) == (INVALID, None)  # closed


def test_contexts_are_per_thread_and_counted(d):
    result = {}

    def other():
        result["no ctx"] = d.cuMemCreate(G, prop(d), 0)[0]
        d.cuCtxSetCurrent(d.ctx)
        result["ctx"] = d.cuMemCreate(G, prop(d), 0)[0]

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert result == {"no ctx": CUresult.CUDA_ERROR_INVALID_CONTEXT, "ctx": OK}
    ok(d.cuDevicePrimaryCtxRelease(0))
    assert d.cuMemCreate(G, prop(d), 0)[0] == CUresult.CUDA_ERROR_INVALID_CONTEXT  # released
    assert d.cuDevicePrimaryCtxRelease(0) == (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
    assert d.calls["cuMemCreate"] == 3


def test_injected_failure(d):
    d.fail_next("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    assert d.cuMemCreate(G, prop(d), 0) == (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    assert d.used == [0]
    ok(d.cuMemCreate(G, prop(d), 0))
