"""One behavioural suite for every memory_ext.vmm backend (host always, CUDA on a GPU, and the
CUDA backend on the fake driver of test/support/fake_cuda_driver.py always).

Data is written and read through ``tensor_view`` only (never raw pointers), and
compared on the host via ``.cpu()``, so the same assertions hold on both. The
host-only checks (/proc/self/maps permissions, 1 TiB reservations, threads)
stay in test_vmm_host.py.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from memory_ext.vmm import COUNTER_NAMES, PhysicalChunk, VirtualRange, VmmBackend, host_backend

PAGE = os.sysconf("SC_PAGE_SIZE")
HOST_G = 4 * PAGE  # small granularity keeps the host runs light

BACKENDS = ["host", "fakecuda", pytest.param("cuda", marks=pytest.mark.gpu)]


def _make(kind, granularity=None) -> VmmBackend:
    if kind == "host":
        return host_backend(HOST_G if granularity is None else granularity)
    if kind == "fakecuda":
        from support.fake_cuda import fake_cuda_backend

        return fake_cuda_backend(granularity)
    from memory_ext.vmm import cuda_backend

    return cuda_backend(0, granularity)


def _unit(kind) -> int:
    """The smallest granularity the backend accepts (page size / driver minimum)."""
    if kind == "host":
        return PAGE
    b = _make(kind)
    try:
        return b.min_granularity
    finally:
        b.close()


@pytest.fixture(params=BACKENDS)
def kind(request):
    return request.param


@pytest.fixture
def vmm(kind):
    backend = _make(kind)
    yield backend
    backend.close()
    if kind == "fakecuda":  # close gave every reservation, mapping, handle and the context back
        assert set(backend._drv.live().values()) == {0}, backend._drv.live()


def _read(vmm, vrange, offset, n=None, dtype=torch.uint8):
    """A host copy of the bytes at ``offset`` (a whole slot by default)."""
    n = vmm.granularity if n is None else n
    return vmm.tensor_view(vrange, offset, n, dtype).cpu().clone()


def _write(vmm, vrange, offset, data: torch.Tensor):
    view = vmm.tensor_view(vrange, offset, data.numel() * data.element_size(), data.dtype)
    view.copy_(data.to(view.device))


def _fill(vmm, vrange, offset, value):
    vmm.tensor_view(vrange, offset, vmm.granularity).fill_(value)


def _uniform(vmm, vrange, offset):
    """The byte value that fills the slot, or None if it is not uniform."""
    view = vmm.tensor_view(vrange, offset, vmm.granularity)
    lo, hi = int(view.min()), int(view.max())
    return lo if lo == hi else None


def _pattern(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------------ basics
def test_reserve_map_unmap_release_round_trip(vmm):
    G = vmm.granularity
    r = vmm.reserve(4 * G)
    assert isinstance(r, VirtualRange) and r.size == 4 * G and r.base % G == 0
    c = vmm.create_chunk()
    assert isinstance(c, PhysicalChunk) and c.size == G and c.source_id is None
    assert vmm.map(r, G, c) == r.base + G
    assert vmm.mapped_slots(r) == {G: c} and vmm.mappings_of(c) == [(r, G)]
    _fill(vmm, r, G, 7)
    assert _uniform(vmm, r, G) == 7
    assert vmm.unmap(r, G) is c
    assert vmm.mapped_slots(r) == {} and vmm.mappings_of(c) == []
    with pytest.raises(ValueError, match=r"offset 0x0 in range #\d+ .* not mapped"):
        vmm.tensor_view(r, 0, 1)
    vmm.release(r)
    vmm.destroy_chunk(c)
    assert vmm.ranges() == [] and vmm.live_chunks() == []
    with pytest.raises(ValueError, match="released"):
        vmm.map(r, 0, vmm.create_chunk())
    with pytest.raises(ValueError, match="destroyed"):
        vmm.map(vmm.reserve(G), 0, c)


def test_sizes_round_up_to_granularity(vmm):
    G = vmm.granularity
    assert vmm.reserve(1).size == G
    assert vmm.reserve(G + 1).size == 2 * G
    assert vmm.reserve(3 * G).size == 3 * G
    assert vmm.round_up(G - 1) == G and vmm.round_up(0) == 0


def test_granularity_must_be_a_multiple_of_the_backend_unit(kind):
    unit = _unit(kind)
    with pytest.raises(ValueError, match="granularity"):
        _make(kind, unit + 1)
    with pytest.raises(ValueError, match="granularity"):
        _make(kind, -unit)
    b = _make(kind, 3 * unit)  # not a power of two: ranges must still be aligned to it
    try:
        assert b.granularity == 3 * unit
        r = b.reserve(2 * b.granularity)
        assert r.base % b.granularity == 0
        c = b.create_chunk()
        b.map(r, b.granularity, c)
        _write(b, r, b.granularity, _pattern(b.granularity, 1))
        assert torch.equal(_read(b, r, b.granularity), _pattern(b.granularity, 1))
    finally:
        b.close()


def test_offsets_are_validated_and_named(vmm):
    G = vmm.granularity
    r = vmm.reserve(2 * G)
    c = vmm.create_chunk()
    with pytest.raises(ValueError, match=r"offset 0x1 is not a multiple of granularity.*range #"):
        vmm.map(r, 1, c)
    with pytest.raises(ValueError, match=r"offset .* is outside range #"):
        vmm.map(r, 2 * G, c)
    vmm.map(r, 0, c)
    with pytest.raises(ValueError, match=r"offset 0x0 in range #\d+ .* already mapped to chunk #"):
        vmm.map(r, 0, vmm.create_chunk())
    with pytest.raises(ValueError, match=f"offset {G:#x} in range #.* not mapped"):
        vmm.unmap(r, G)


# ------------------------------------------------------------------- views
def test_tensor_view_write_read(vmm):
    G = vmm.granularity
    r = vmm.reserve(3 * G)
    for i in range(2):
        vmm.map(r, i * G, vmm.create_chunk())
    n = 2 * G // 4
    t = vmm.tensor_view(r, 0, (2, n // 2), torch.float32)
    assert t.shape == (2, n // 2) and t.dtype == torch.float32 and t.device == vmm.device
    t.copy_(torch.arange(n, dtype=torch.float32).view(2, -1).to(t.device))
    # straddles the slot boundary, at an offset that is not slot-aligned
    u = vmm.tensor_view(r, G - 8, 16, torch.float32)
    assert u.cpu().tolist() == [float(i) for i in range(G // 4 - 2, G // 4 + 2)]
    assert torch.equal(_read(vmm, r, 0, 2 * G, torch.float32), torch.arange(n, dtype=torch.float32))
    half = vmm.tensor_view(r, 0, (4,), torch.bfloat16)
    half.copy_(torch.tensor([1.5, -2.0, 3.0, 0.25], dtype=torch.bfloat16).to(half.device))
    assert half.cpu().tolist() == [1.5, -2.0, 3.0, 0.25]
    assert vmm.tensor_view(r, 0, 0).numel() == 0
    with pytest.raises(ValueError, match=f"offset {2 * G:#x} in range #.* not mapped"):
        vmm.tensor_view(r, G, G + 4)


def test_views_are_tracked_for_strict_unmap_and_staleness(vmm):
    G = vmm.granularity
    r = vmm.reserve(G)
    vmm.map(r, 0, vmm.create_chunk())
    view = vmm.tensor_view(r, 0, G)
    assert vmm.live_views(r, 0) == 1
    with pytest.raises(ValueError, match="1 live tensor view"):
        vmm.unmap(r, 0, strict=True)
    vmm.check_view(view)
    chunk = vmm.unmap(r, 0)
    with pytest.raises(ValueError, match="stale"):
        vmm.check_view(view)  # only the bookkeeping is consulted; the bytes are not touched
    del view
    vmm.map(r, 0, chunk)
    vmm.unmap(r, 0, strict=True)


# ----------------------------------------------------------------- aliases
def test_one_chunk_at_two_offsets_is_one_set_of_bytes(vmm):
    G = vmm.granularity
    r1, r2 = vmm.reserve(4 * G), vmm.reserve(2 * G)
    c = vmm.create_chunk()
    vmm.map(r1, 0, c)
    vmm.map(r1, 3 * G, c)
    vmm.map(r2, G, c)
    assert sorted(o for _, o in vmm.mappings_of(c)) == [0, G, 3 * G]
    _write(vmm, r1, 0, torch.arange(G // 8, dtype=torch.int64))
    assert torch.equal(_read(vmm, r1, 3 * G, G, torch.int64), torch.arange(G // 8))
    assert torch.equal(_read(vmm, r2, G, G, torch.int64), torch.arange(G // 8))
    vmm.tensor_view(r2, G, (G // 8,), torch.int64)[5] = -1
    assert int(vmm.tensor_view(r1, 0, (G // 8,), torch.int64)[5]) == -1
    assert int(vmm.tensor_view(r1, 3 * G, (G // 8,), torch.int64)[5]) == -1
    views = [vmm.tensor_view(r, o, 8) for r, o in vmm.mappings_of(c)]
    assert len({v.data_ptr() for v in views}) == 3  # three addresses, one chunk


def test_map_before_unmap_move_keeps_bytes(vmm):
    G = vmm.granularity
    r = vmm.reserve(8 * G)
    c = vmm.create_chunk()
    vmm.map(r, G, c)
    _write(vmm, r, G, _pattern(G, 7))
    vmm.map(r, 6 * G, c)  # new home first: no byte is copied
    assert vmm.unmap(r, G) is c
    assert vmm.mapped_slots(r) == {6 * G: c}
    assert torch.equal(_read(vmm, r, 6 * G), _pattern(G, 7))
    # the vacated slot can hold another chunk without disturbing the moved one
    other = vmm.create_chunk()
    vmm.map(r, G, other)
    _fill(vmm, r, G, 9)
    assert torch.equal(_read(vmm, r, 6 * G), _pattern(G, 7))


# ---------------------------------------------------------------- refusals
def test_destroy_while_mapped_is_refused_naming_every_slot(vmm):
    G = vmm.granularity
    r1, r2 = vmm.reserve(2 * G), vmm.reserve(2 * G)
    c = vmm.create_chunk()
    vmm.map(r1, G, c)
    vmm.map(r2, 0, c)
    with pytest.raises(ValueError) as info:
        vmm.destroy_chunk(c)
    msg = str(info.value)
    assert f"cannot destroy {c}" in msg
    assert f"{r1} offset {G:#x}" in msg and f"{r2} offset 0x0" in msg
    assert c in vmm.live_chunks()
    vmm.unmap(r1, G)
    vmm.unmap(r2, 0)
    vmm.destroy_chunk(c)
    assert c not in vmm.live_chunks()


def test_release_while_mapped_is_refused_naming_every_slot(vmm):
    G = vmm.granularity
    r = vmm.reserve(4 * G)
    a, b = vmm.create_chunk(), vmm.create_chunk()
    vmm.map(r, 0, a)
    vmm.map(r, 2 * G, b)
    with pytest.raises(ValueError) as info:
        vmm.release(r)
    msg = str(info.value)
    assert f"cannot release {r}" in msg
    assert f"offset 0x0 -> {a}" in msg and f"offset {2 * G:#x} -> {b}" in msg
    assert r in vmm.ranges()
    vmm.unmap(r, 0)
    vmm.unmap(r, 2 * G)
    vmm.release(r)
    assert r not in vmm.ranges()


# ---------------------------------------------------------------- counters
def test_counters_count_calls_and_chunks(kind):
    vmm = _make(kind)
    G = vmm.granularity
    try:
        assert vmm.counters() == dict.fromkeys(COUNTER_NAMES, 0)
        r = vmm.reserve(2 * G)
        a, b = vmm.create_chunk(), vmm.create_chunk()
        vmm.map(r, 0, a)
        vmm.map(r, G, a)
        vmm.tensor_view(r, 0, 16)
        vmm.unmap(r, 0)
        with pytest.raises(ValueError):
            vmm.unmap(r, 0)  # refused calls are not counted
        fd = vmm.export_chunk(b)
        try:
            imported = vmm.import_chunk(fd, G, source_id=b.handle_id)
        finally:
            os.close(fd)
        vmm.destroy_chunk(imported)
        want = dict(
            reserve_calls=1,
            release_calls=0,
            map_calls=2,
            unmap_calls=1,
            chunks_created=2,
            chunks_imported=1,
            chunks_destroyed=1,
            chunks_exported=1,
            views_made=1,
        )
        assert vmm.counters() == want
        assert vmm.map_calls == 2 and vmm.unmap_calls == 1
        c = vmm.counters()
        assert c["chunks_created"] + c["chunks_imported"] - c["chunks_destroyed"] == len(vmm.live_chunks())
        vmm.close()
        after = vmm.counters()
        assert after["unmap_calls"] == 2 and after["release_calls"] == 1 and after["chunks_destroyed"] == 3
        assert vmm.live_chunks() == [] and vmm.ranges() == []
        with pytest.raises(RuntimeError, match="closed"):
            vmm.create_chunk()
    finally:
        vmm.close()


# -------------------------------------------------------------- export/import
def test_export_import_in_one_process_aliases_the_same_bytes(vmm):
    G = vmm.granularity
    r = vmm.reserve(2 * G)
    c = vmm.create_chunk()
    vmm.map(r, 0, c)
    _write(vmm, r, 0, _pattern(G, 3))
    fd = vmm.export_chunk(c)
    try:
        twin = vmm.import_chunk(fd, G, source_id=c.handle_id)
    finally:
        os.close(fd)  # import does not take the fd
    assert twin is not c and twin.handle_id != c.handle_id and twin.source_id == c.handle_id
    vmm.map(r, G, twin)
    assert torch.equal(_read(vmm, r, G), _pattern(G, 3))
    vmm.tensor_view(r, G, 4).fill_(0xEE)
    assert _read(vmm, r, 0, 4).tolist() == [0xEE] * 4
    # the original may go first: the import keeps the memory alive
    vmm.unmap(r, 0)
    vmm.destroy_chunk(c)
    assert _read(vmm, r, G, 8).tolist() == [0xEE] * 4 + _pattern(G, 3)[4:8].tolist()
    with pytest.raises(ValueError, match="size"):
        vmm.import_chunk(0, G + 1)


# ---------------------------------------------------------- state machine
class _VmmMachine(RuleBasedStateMachine):
    """Random create/map/unmap/move/write/destroy against a model of slots and chunk bytes."""

    KIND = "host"
    SLOTS = 5

    def __init__(self):
        super().__init__()
        self.vmm = _make(self.KIND)
        self.G = self.vmm.granularity
        self.range = self.vmm.reserve(self.SLOTS * self.G)
        self.chunks = []  # live chunks, in creation order
        self.value = {}  # handle_id -> byte value filling the chunk (None: never written)
        self.slots = {}  # offset -> chunk
        self.created = self.destroyed = 0

    def teardown(self):
        self.vmm.close()

    def _chunk(self, i):
        return self.chunks[i % len(self.chunks)]

    def _off(self, s):
        return (s % self.SLOTS) * self.G

    @rule()
    def create(self):
        c = self.vmm.create_chunk()
        self.chunks.append(c)
        self.value[c.handle_id] = None  # fresh CUDA memory is not zeroed
        self.created += 1

    @precondition(lambda self: self.chunks)
    @rule(i=st.integers(0, 99), s=st.integers(0, 99))
    def map(self, i, s):
        c, off = self._chunk(i), self._off(s)
        if off in self.slots:
            with pytest.raises(ValueError, match="already mapped"):
                self.vmm.map(self.range, off, c)
        else:
            assert self.vmm.map(self.range, off, c) == self.range.base + off
            self.slots[off] = c

    @rule(s=st.integers(0, 99))
    def unmap(self, s):
        off = self._off(s)
        if off in self.slots:
            assert self.vmm.unmap(self.range, off) is self.slots.pop(off)
        else:
            with pytest.raises(ValueError, match="not mapped"):
                self.vmm.unmap(self.range, off)

    @rule(s=st.integers(0, 99), t=st.integers(0, 99))
    def move(self, s, t):
        src, dst = self._off(s), self._off(t)
        if src not in self.slots or dst in self.slots:
            return
        c = self.slots[src]
        self.vmm.map(self.range, dst, c)
        self.slots[dst] = c
        assert self.vmm.unmap(self.range, src) is c
        del self.slots[src]

    @rule(s=st.integers(0, 99), v=st.integers(0, 255))
    def write(self, s, v):
        off = self._off(s)
        if off in self.slots:
            _fill(self.vmm, self.range, off, v)
            self.value[self.slots[off].handle_id] = v

    @precondition(lambda self: self.chunks)
    @rule(i=st.integers(0, 99))
    def destroy(self, i):
        c = self._chunk(i)
        if any(m is c for m in self.slots.values()):
            with pytest.raises(ValueError) as info:
                self.vmm.destroy_chunk(c)
            assert f"cannot destroy {c}: still mapped at {self.range} offset" in str(info.value)
        else:
            self.vmm.destroy_chunk(c)
            self.chunks.remove(c)
            del self.value[c.handle_id]
            self.destroyed += 1

    @invariant()
    def matches_model(self):
        vmm = self.vmm
        assert vmm.mapped_slots(self.range) == dict(sorted(self.slots.items()))
        assert {c.handle_id for c in vmm.live_chunks()} == {c.handle_id for c in self.chunks}
        for c in self.chunks:
            want = sorted(o for o, m in self.slots.items() if m is c)
            assert sorted(o for _, o in vmm.mappings_of(c)) == want
        counters = vmm.counters()
        assert counters["chunks_created"] == self.created
        assert counters["chunks_destroyed"] == self.destroyed
        assert counters["chunks_created"] - counters["chunks_destroyed"] == len(vmm.live_chunks())
        for off, c in self.slots.items():
            v = self.value[c.handle_id]
            if v is not None:
                assert _uniform(vmm, self.range, off) == v, (off, c)


def test_state_machine_against_model(kind):
    machine = type(f"VmmMachine_{kind}", (_VmmMachine,), {"KIND": kind})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=20, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
