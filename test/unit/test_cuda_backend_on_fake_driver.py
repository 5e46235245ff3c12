"""memory_ext.vmm.cuda on the fake CUDA driver: the paths the conformance suite does not reach
(construction, error naming, out-of-memory, the access rollback, contexts on other threads,
export/import across processes), and deliberate contract violations that the fake catches.
The shared behaviour runs in test_vmm_conformance.py (kind "fakecuda")."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from memory_ext.pool import ChunkPool, Owner
from memory_ext.vmm import listen_unix, private_dir, send_chunks
from memory_ext.vmm.cuda import CudaDriverError, CudaVmmBackend, cuda_available
from support.fake_cuda import FakeCudaVmmBackend, fake_cuda_backend, installed
from support.fake_cuda_driver import CUresult, FakeDriver, FakeFault

G = 1 << 16
TEST_DIR = Path(__file__).resolve().parents[1]
REPO = TEST_DIR.parent


def clean(drv: FakeDriver) -> bool:
    return set(drv.live().values()) == {0}


@pytest.fixture
def vmm():
    backend = fake_cuda_backend()
    yield backend
    backend.close()
    assert clean(backend._drv), backend._drv.live()


def test_construction_follows_the_documented_call_sequence():
    drv = FakeDriver(min_granularity=G, device_count=2)
    with installed(drv):
        assert cuda_available(1) and not cuda_available(2)
    drv.calls.clear()
    b = FakeCudaVmmBackend(drv, 1)
    assert b.min_granularity == b.granularity == G and b.cuda_device == torch.device("cuda", 1)
    want = ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    assert list(drv.calls) == want + ["cuMemGetAllocationGranularity"]
    assert drv.live()["retained_contexts"] == 1
    b.close()
    assert clean(drv)
    with pytest.raises(ValueError, match="does not exist"):
        FakeCudaVmmBackend(drv, 2)
    with pytest.raises(ValueError, match="positive multiple"):
        FakeCudaVmmBackend(drv, 0, G + 4096)
    assert clean(drv)  # the failed constructor released the context it retained
    assert sys.modules.get("cuda.bindings.driver") is not drv  # `installed` put back what was there


def test_driver_errors_are_named_and_change_nothing(vmm):
    drv = vmm._drv
    drv.fail_next("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(CudaDriverError, match=r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)") as info:
        vmm.create_chunk()
    assert isinstance(info.value, OSError) and info.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert vmm.live_chunks() == [] and vmm.counters()["chunks_created"] == 0


def test_failed_set_access_unmaps_the_slot_again(vmm):
    r, c = vmm.reserve(2 * G), vmm.create_chunk()
    vmm._drv.fail_next("cuMemSetAccess", CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(CudaDriverError, match="cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE"):
        vmm.map(r, G, c)
    assert vmm.mapped_slots(r) == {} and vmm._drv.live()["mappings"] == 0
    vmm.map(r, G, c)  # the slot is a plain reservation again
    vmm.tensor_view(r, G, 16).fill_(1)


def test_out_of_memory_at_the_budget_leaves_the_pool_consistent():
    drv = FakeDriver(min_granularity=G, budget_bytes=4 * G)
    vmm = FakeCudaVmmBackend(drv)
    pool = ChunkPool(vmm, 8)
    kv = pool.acquire(Owner.KV, 3)
    with pytest.raises(CudaDriverError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        pool.acquire(Owner.ACTIVATION, 2)  # the 5th chunk is over budget
    pool.check_invariants()
    assert pool.usage()[Owner.ACTIVATION] == 0 and drv.used == [4 * G]  # the 4th waits in FREE
    pool.release(Owner.KV, kv)
    assert pool.trim() == 4 and drv.used == [0]
    pool.close()
    vmm.close()
    assert clean(drv)


def test_steady_state_reuse_makes_no_allocation_calls(vmm):
    pool = ChunkPool(vmm, 8)
    pool.release(Owner.KV, pool.acquire(Owner.KV, 4))
    before = dict(vmm._drv.calls)
    for _ in range(10):
        pool.release(Owner.KV, pool.acquire(Owner.KV, 4))
    assert dict(vmm._drv.calls) == before  # chunks are reused: not one driver call
    pool.close()


def test_unmap_synchronises_unless_told_not_to():
    for sync, want in ((True, 1), (False, 0)):
        b = fake_cuda_backend(sync_on_unmap=sync)
        r = b.reserve(G)
        b.map(r, 0, b.create_chunk())
        n = b._drv.calls["cuCtxSynchronize"]
        b.unmap(r, 0)
        assert b._drv.calls["cuCtxSynchronize"] - n == want
        b.close()


def test_primitives_work_from_another_thread(vmm):
    r = vmm.reserve(2 * G)
    errors = []

    def worker():
        try:
            c = vmm.create_chunk()
            vmm.map(r, G, c)
            vmm.tensor_view(r, G, G).fill_(3)
            vmm.unmap(r, G)
            vmm.destroy_chunk(c)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors == []


def test_export_is_private_and_import_checks_the_fd(vmm):
    c = vmm.create_chunk()
    fd = vmm.export_chunk(c)
    assert not os.get_inheritable(fd)  # the fake hands out inheritable fds: ours closed that
    os.close(fd)
    with tempfile.TemporaryFile() as f, pytest.raises(CudaDriverError, match="CUDA_ERROR_INVALID_VALUE"):
        vmm.import_chunk(f.fileno(), G)
    with pytest.raises(ValueError, match="not an open file descriptor"):
        vmm.import_chunk(fd, G)
    assert vmm.live_chunks() == [c]


def test_an_imported_chunk_of_the_wrong_size_fails_at_map():
    drv = FakeDriver(min_granularity=G)
    small, big = FakeCudaVmmBackend(drv, 0, G), FakeCudaVmmBackend(drv, 0, 2 * G)
    fd = small.export_chunk(small.create_chunk())
    try:
        chunk = big.import_chunk(fd, 2 * G)  # the driver cannot tell the size at import
    finally:
        os.close(fd)
    r = big.reserve(2 * G)
    with pytest.raises(CudaDriverError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        big.map(r, 0, chunk)
    big.close()
    small.close()
    assert clean(drv)


CHILD = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[2])
    from memory_ext.vmm import connect_unix, recv_chunks
    from support.fake_cuda import fake_cuda_backend
    vmm = fake_cuda_backend()
    g = vmm.granularity
    sock = connect_unix(sys.argv[1])
    [chunk], meta = recv_chunks(sock, vmm, with_meta=True)
    assert meta == {"granularity": g} and chunk.source_id is not None
    r = vmm.reserve(2 * g)
    vmm.map(r, g, chunk)
    view = vmm.tensor_view(r, g, g)
    assert int(view[0]) == 0xAB, int(view[0])
    view.copy_(torch.arange(g).remainder(251).to(torch.uint8))
    sock.sendall(b"done")
    assert sock.recv(16) == b"bye"
    drv = vmm._drv
    vmm.close()
    assert set(drv.live().values()) == {0}, drv.live()
    assert drv.used == [0]  # an import from another process is not charged here
""")


def test_child_process_writes_into_a_chunk_we_read(vmm, tmp_path):
    path = os.path.join(private_dir(tmp_path / "s"), "vmm.sock")
    server = listen_unix(path)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, str(TEST_DIR)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(60)
        r, chunk = vmm.reserve(G), vmm.create_chunk()
        vmm.map(r, 0, chunk)
        mine = vmm.tensor_view(r, 0, G)
        mine.zero_()
        mine[0] = 0xAB
        send_chunks(conn, [chunk], meta={"granularity": G})
        assert conn.recv(16) == b"done"
        assert torch.equal(mine, torch.arange(G).remainder(251).to(torch.uint8))
        conn.sendall(b"bye")
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0, out.decode()
        conn.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        server.close()


# ------------------------------------------------------------- deliberate contract violations
def test_violation_map_without_access_fails_the_first_touch(monkeypatch):
    def map_without_access(self, address, handle):
        self._current()
        self._drv.cuMemMap(address, self._granularity, 0, handle, 0)

    monkeypatch.setattr(CudaVmmBackend, "_os_map", map_without_access)
    b = fake_cuda_backend()
    r = b.reserve(G)
    b.map(r, 0, b.create_chunk())  # the driver accepts the map ...
    with pytest.raises(FakeFault, match="ILLEGAL_ADDRESS.*no write access"):
        b.tensor_view(r, 0, G)  # ... but the device may not touch the memory
    b.close()


def test_violation_primitive_without_making_the_context_current(monkeypatch):
    b = fake_cuda_backend()
    monkeypatch.setattr(CudaVmmBackend, "_current", lambda self: None)
    caught = []
    t = threading.Thread(target=lambda: caught.append(pytest.raises(CudaDriverError, b.create_chunk).value))
    t.start()
    t.join()
    assert caught and caught[0].error_name == "CUDA_ERROR_INVALID_CONTEXT"
    monkeypatch.undo()
    b.close()


def test_violation_release_or_destroy_out_of_order(vmm):
    """The base class refuses these; calling the primitives directly shows the driver would too."""
    r, c = vmm.reserve(G), vmm.create_chunk()
    vmm.map(r, 0, c)
    with pytest.raises(CudaDriverError, match="cuMemAddressFree failed: CUDA_ERROR_INVALID_VALUE"):
        vmm._os_release(r.base, r.size)  # a mapping remains inside
    with pytest.raises(CudaDriverError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        vmm._os_map(r.base, c.handle)  # map of a mapped range
    vmm.unmap(r, 0)
    with pytest.raises(CudaDriverError, match="cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE"):
        vmm._os_unmap(r.base)  # unmap of nothing
    vmm.destroy_chunk(c)
    with pytest.raises(CudaDriverError, match="cuMemRelease failed: CUDA_ERROR_INVALID_HANDLE"):
        vmm._os_destroy(c.handle)  # released twice
