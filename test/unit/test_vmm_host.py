"""memory_ext.vmm host backend: host-specific checks (/proc/self/maps, 1 TiB
reservations, fds, foreign objects, threads). Behaviour shared with the CUDA
backend lives in test_vmm_conformance.py."""

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from memory_ext.vmm import HostVmmBackend, PhysicalChunk, VirtualRange, VmmBackend, host_backend

PAGE = os.sysconf("SC_PAGE_SIZE")
G = 4 * PAGE  # small granularity keeps the tests light


@pytest.fixture
def vmm():
    backend = host_backend(G)
    yield backend
    backend.close()


def _fill(vmm, vrange, offset, value):
    vmm.tensor_view(vrange, offset, G).fill_(value)


def _perms(addresses):
    """The /proc/self/maps permission string ("rw-s", "---p", ...) at each address."""
    entries = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            entries.append((lo, hi, perms))
    return [next((p for lo, hi, p in entries if lo <= a < hi), None) for a in addresses]


def _bytes(vmm, vrange, offset, n=G):
    return vmm.tensor_view(vrange, offset, n).clone()


def test_host_backend_is_a_vmm_backend_with_default_granularity():
    b = host_backend()
    try:
        assert isinstance(b, VmmBackend) and isinstance(b, HostVmmBackend)
        assert b.granularity == 2 << 20
    finally:
        b.close()


def test_round_trip_reserve_map_unmap_release(vmm):
    r = vmm.reserve(4 * G)
    assert isinstance(r, VirtualRange) and r.size == 4 * G and r.base % G == 0
    c = vmm.create_chunk()
    assert isinstance(c, PhysicalChunk) and c.size == G
    addr = vmm.map(r, G, c)
    assert addr == r.base + G
    assert vmm.mapped_slots(r) == {G: c}
    assert vmm.mappings_of(c) == [(r, G)]
    _fill(vmm, r, G, 7)
    assert vmm.unmap(r, G) is c
    assert vmm.mapped_slots(r) == {} and vmm.mappings_of(c) == []
    assert _perms([r.base, r.base + G]) == ["---p", "---p"]
    vmm.release(r)
    assert _perms([r.base]) == [None]
    vmm.destroy_chunk(c)
    assert vmm.ranges() == [] and vmm.live_chunks() == []
    with pytest.raises(ValueError, match="released"):
        vmm.map(r, 0, vmm.create_chunk())


def test_one_tib_reservation_costs_nothing(vmm):
    r = vmm.reserve(1 << 40)
    c = vmm.create_chunk()
    vmm.map(r, (1 << 40) - G, c)
    _fill(vmm, r, (1 << 40) - G, 3)
    assert int(_bytes(vmm, r, (1 << 40) - G).sum()) == 3 * G


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(granularity=PAGE + 1), "granularity"),
        (dict(granularity=0), "granularity"),
        (dict(granularity=-PAGE), "granularity"),
    ],
)
def test_bad_granularity_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HostVmmBackend(**kwargs)


def test_bad_size_and_offset_types_name_the_field(vmm):
    """Beyond the offset checks of test_vmm_conformance.py: sizes, negative and bool offsets."""
    with pytest.raises(ValueError, match="size"):
        vmm.reserve(0)
    with pytest.raises(TypeError, match="size"):
        vmm.reserve(1.5)
    r = vmm.reserve(2 * G)
    c = vmm.create_chunk()
    with pytest.raises(ValueError, match=r"offset .* is outside"):
        vmm.map(r, -G, c)
    with pytest.raises(TypeError, match="offset"):
        vmm.map(r, True, c)


def test_foreign_range_and_chunk_are_refused(vmm):
    other = host_backend(G)
    try:
        r, c = other.reserve(G), other.create_chunk()
        with pytest.raises(ValueError, match="range: .* another backend"):
            vmm.map(r, 0, vmm.create_chunk())
        with pytest.raises(ValueError, match="chunk: .* another backend"):
            vmm.map(vmm.reserve(G), 0, c)
    finally:
        other.close()


def test_tensor_view_write_read_and_shapes(vmm):
    r = vmm.reserve(3 * G)
    for i in range(2):
        vmm.map(r, i * G, vmm.create_chunk())
    n = 2 * G // 4
    t = vmm.tensor_view(r, 0, (2, n // 2), torch.float32)
    assert t.shape == (2, n // 2) and t.dtype == torch.float32 and t.device.type == "cpu"
    t.copy_(torch.arange(n, dtype=torch.float32).view(2, -1))
    # a view straddling the slot boundary, at a non-slot-aligned offset
    u = vmm.tensor_view(r, G - 8, 16, torch.float32)
    assert u.tolist() == [float(i) for i in range(G // 4 - 2, G // 4 + 2)]
    assert vmm.tensor_view(r, 0, 0).numel() == 0
    with pytest.raises(ValueError, match=f"offset {2 * G:#x} in range #.* not mapped"):
        vmm.tensor_view(r, G, G + 4)
    with pytest.raises(ValueError, match="offset 0x2 is not a multiple"):
        vmm.tensor_view(r, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="nbytes 6"):
        vmm.tensor_view(r, 0, 6, torch.float32)
    with pytest.raises(ValueError, match="outside"):
        vmm.tensor_view(r, 3 * G - 4, 8)


def test_aliasing_within_and_across_ranges(vmm):
    r1, r2 = vmm.reserve(4 * G), vmm.reserve(2 * G)
    c = vmm.create_chunk()
    vmm.map(r1, 0, c)
    vmm.map(r1, 3 * G, c)
    vmm.map(r2, G, c)
    assert sorted(o for _, o in vmm.mappings_of(c)) == [0, G, 3 * G]
    a = vmm.tensor_view(r1, 0, (G // 8,), torch.int64)
    b = vmm.tensor_view(r1, 3 * G, (G // 8,), torch.int64)
    d = vmm.tensor_view(r2, G, (G // 8,), torch.int64)
    a.copy_(torch.arange(G // 8))
    assert torch.equal(b, a) and torch.equal(d, a)
    d[5] = -1
    assert int(a[5]) == -1 and int(b[5]) == -1
    assert a.data_ptr() != b.data_ptr() != d.data_ptr()


def test_unmap_returns_the_slot_to_reserved_state(vmm):
    r = vmm.reserve(2 * G)
    c1, c2 = vmm.create_chunk(), vmm.create_chunk()
    vmm.map(r, 0, c1)
    _fill(vmm, r, 0, 1)
    vmm.map(r, G, c2)
    _fill(vmm, r, G, 2)
    assert _perms([r.base, r.base + G]) == ["rw-s", "rw-s"]
    vmm.unmap(r, 0)
    assert _perms([r.base, r.base + G]) == ["---p", "rw-s"]  # reserved, inaccessible, still ours
    with pytest.raises(ValueError, match="offset 0x0 in range #.* not mapped"):
        vmm.tensor_view(r, 0, 1)
    vmm.map(r, 0, c2)  # another chunk in the same slot shows that chunk's bytes
    assert int(_bytes(vmm, r, 0).min()) == 2 == int(_bytes(vmm, r, 0).max())
    vmm.unmap(r, 0)
    vmm.map(r, 0, c1)
    assert int(_bytes(vmm, r, 0).max()) == 1


def test_fresh_chunks_are_zero(vmm):
    r = vmm.reserve(G)
    vmm.map(r, 0, vmm.create_chunk())
    assert int(_bytes(vmm, r, 0).max()) == 0


def test_counters(vmm):
    r = vmm.reserve(2 * G)
    c = vmm.create_chunk()
    for _ in range(3):
        vmm.map(r, 0, c)
        vmm.unmap(r, 0)
    vmm.map(r, G, c)
    assert (vmm.map_calls, vmm.unmap_calls) == (4, 3)
    n = vmm.counters()
    assert n["reserve_calls"] == 1 and n["chunks_created"] == 1 and n["chunks_destroyed"] == 0
    with pytest.raises(ValueError):
        vmm.map(r, G, c)  # refused calls are not counted
    assert vmm.map_calls == 4


def test_view_guards(vmm):
    r = vmm.reserve(2 * G)
    c = vmm.create_chunk()
    vmm.map(r, 0, c)
    t = vmm.tensor_view(r, 0, 64)
    vmm.check_view(t)
    assert vmm.live_views(r, 0) == 1
    with pytest.raises(ValueError, match="1 live tensor view"):
        vmm.unmap(r, 0, strict=True)
    vmm.unmap(r, 0)
    with pytest.raises(ValueError, match="stale: offset 0x0"):
        vmm.check_view(t)
    vmm.map(r, 0, c)  # same chunk again: still a new mapping, the old view stays stale
    with pytest.raises(ValueError, match="stale"):
        vmm.check_view(t)
    del t
    u = vmm.tensor_view(r, 0, 64)
    del u
    assert vmm.live_views(r, 0) == 0
    vmm.unmap(r, 0, strict=True)
    with pytest.raises(ValueError, match="not made by tensor_view"):
        vmm.check_view(torch.zeros(3))


def test_close_releases_everything_and_is_idempotent():
    vmm = host_backend(G)
    r = vmm.reserve(2 * G)
    vmm.map(r, 0, vmm.create_chunk())
    vmm.create_chunk()
    fds_before = len(os.listdir("/proc/self/fd"))
    vmm.close()
    vmm.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before - 2
    assert vmm.ranges() == [] and vmm.live_chunks() == []
    with pytest.raises(RuntimeError, match="closed"):
        vmm.reserve(G)


def test_concurrent_map_unmap_keeps_bookkeeping_consistent(vmm):
    r = vmm.reserve(16 * G)
    chunks = [vmm.create_chunk() for _ in range(4)]

    def worker(k):
        for _ in range(50):
            vmm.map(r, (4 * k) * G, chunks[k])
            vmm.map(r, (4 * k + 1) * G, chunks[k])
            vmm.unmap(r, (4 * k) * G)
            vmm.unmap(r, (4 * k + 1) * G)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert vmm.mapped_slots(r) == {} and (vmm.map_calls, vmm.unmap_calls) == (400, 400)


# ------------------------------------------------------------ property test
SLOTS = 6


class VmmMachine(RuleBasedStateMachine):
    """Random create/map/unmap/move/write/destroy on a small range."""

    chunks = Bundle("chunks")

    def __init__(self):
        super().__init__()
        self.vmm = host_backend(PAGE)
        self.range = self.vmm.reserve(SLOTS * PAGE)
        self.model_slots = {}  # offset -> chunk
        self.model_bytes = {}  # handle_id -> byte value written into the whole chunk
        self.created = self.destroyed = 0

    def teardown(self):
        self.vmm.close()

    @rule(target=chunks)
    def create(self):
        c = self.vmm.create_chunk()
        self.created += 1
        self.model_bytes[c.handle_id] = 0
        return c

    @rule(chunk=chunks, slot=st.integers(0, SLOTS - 1))
    def map(self, chunk, slot):
        offset = slot * PAGE
        if chunk.handle_id not in self.model_bytes:
            with pytest.raises(ValueError, match="destroyed"):
                self.vmm.map(self.range, offset, chunk)
        elif offset in self.model_slots:
            with pytest.raises(ValueError, match="already mapped"):
                self.vmm.map(self.range, offset, chunk)
        else:
            self.vmm.map(self.range, offset, chunk)
            self.model_slots[offset] = chunk

    @rule(slot=st.integers(0, SLOTS - 1))
    def unmap(self, slot):
        offset = slot * PAGE
        if offset in self.model_slots:
            assert self.vmm.unmap(self.range, offset) is self.model_slots.pop(offset)
        else:
            with pytest.raises(ValueError, match="not mapped"):
                self.vmm.unmap(self.range, offset)

    @precondition(lambda self: self.model_slots and len(self.model_slots) < SLOTS)
    @rule(data=st.data())
    def move(self, data):
        src = data.draw(st.sampled_from(sorted(self.model_slots)))
        dst = data.draw(st.sampled_from([o * PAGE for o in range(SLOTS) if o * PAGE not in self.model_slots]))
        chunk = self.model_slots[src]
        self.vmm.map(self.range, dst, chunk)
        self.vmm.unmap(self.range, src)
        self.model_slots[dst] = self.model_slots.pop(src)

    @precondition(lambda self: self.model_slots)
    @rule(data=st.data(), value=st.integers(1, 255))
    def write(self, data, value):
        offset = data.draw(st.sampled_from(sorted(self.model_slots)))
        self.vmm.tensor_view(self.range, offset, PAGE).fill_(value)
        self.model_bytes[self.model_slots[offset].handle_id] = value

    @rule(chunk=consumes(chunks))
    def destroy(self, chunk):
        if chunk.handle_id not in self.model_bytes:
            return
        if any(c is chunk for c in self.model_slots.values()):
            with pytest.raises(ValueError, match="still mapped"):
                self.vmm.destroy_chunk(chunk)
            return
        self.vmm.destroy_chunk(chunk)
        self.destroyed += 1
        del self.model_bytes[chunk.handle_id]

    @invariant()
    def slots_point_to_live_chunks_and_bytes_survive(self):
        live = {c.handle_id for c in self.vmm.live_chunks()}
        offsets = [o * PAGE for o in range(SLOTS)]
        perms = _perms([self.range.base + o for o in offsets])
        assert perms == ["rw-s" if o in self.model_slots else "---p" for o in offsets]
        assert self.vmm.mapped_slots(self.range) == dict(sorted(self.model_slots.items()))
        for offset, chunk in self.model_slots.items():
            assert chunk.handle_id in live
            assert (self.range, offset) in self.vmm.mappings_of(chunk)
            t = self.vmm.tensor_view(self.range, offset, PAGE)
            want = self.model_bytes[chunk.handle_id]
            assert int(t[0]) == int(t[-1]) == int(t.min()) == int(t.max()) == want

    @invariant()
    def chunks_are_conserved(self):
        n = self.vmm.counters()
        assert n["chunks_created"] == self.created and n["chunks_destroyed"] == self.destroyed
        assert len(self.vmm.live_chunks()) == self.created - self.destroyed == len(self.model_bytes)


TestVmmProperties = VmmMachine.TestCase
TestVmmProperties.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
